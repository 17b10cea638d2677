"""The ``packing_free`` baseline (TRL's bfd + padding_free), the baseline registry behind every command's
method list and knob flags, and ``--tune-baselines`` in simulate and bench."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np
import pytest

from dynabatch.data.baselines import (BASELINES, BaselineOptions, Trial, best_trial, grid_settings, make_batcher,
                                      with_twins)
from dynabatch.data.batching import LengthLimits
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.data.tokenize import TokenizerInfo

TOKENS = TokenizerInfo(pad_id=0, eos_id=1, decoder_start_id=0, vocab_size=50)


def _batch(lengths) -> GlobalBatch:
    """A global batch of samples with ``(input_len, target_len)`` and distinct token ids."""
    samples = [TokenizedSample("t", np.arange(2, 2 + e, dtype=np.int32) % 50, np.full(d, 7, np.int32), 0, k)
               for k, (e, d) in enumerate(lengths)]
    return GlobalBatch(step=0, samples=tuple(samples))


def _rows(groups) -> list[list[int]]:
    return [list(r) for g in groups for r in g.rows]


# ---------------------------------------------------------------------------------------------- batcher


def test_packing_free_rows_are_best_fit_decreasing_gpt():
    """Lengths 7, 4, 4, 2 in rows of 10: 7 opens row 0 (3 left), 4 opens row 1, the second 4 fits only
    row 1 (2 left); 2 fits both and best-fit puts it in row 1 (0 left), where first-fit would use row 0."""
    batch = _batch([(6, 1), (3, 1), (3, 1), (1, 1)])
    limits = LengthLimits("causal", max_seq_len=10)
    free = make_batcher("packing_free", limits, TOKENS, rows_per_micro_batch=1)
    dense = make_batcher("packing", limits, TOKENS, rows_per_micro_batch=1)
    assert _rows(free.group(batch)) == _rows(dense.group(batch)) == [[0], [1, 2, 3]]
    # padded to the longest row of the micro-batch, not to the row length
    assert [mb.shape[1] for mb in free(batch)] == [7, 10]
    assert [mb.shape[1] for mb in dense(batch)] == [10, 10]
    (mb,) = make_batcher("packing_free", limits, TOKENS, rows_per_micro_batch=2)(batch)
    assert mb.shape[:2] == (2, 10) and mb.num_real_tokens == batch.num_tokens == 17
    assert mb.position_ids[1].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]  # restart per sample
    assert mb.segment_ids[0].tolist() == [1] * 7 + [0] * 3


def test_packing_free_t5_packs_inputs_and_targets_into_separate_rows():
    """Encoder rows of 10 and decoder rows of 4; a sample goes where both fit. Sorted by input length:
    a(7,1) opens row 0 (3, 3 left); b(4,3) does not fit its encoder side: row 1 (6, 1 left); c(4,1)
    fits only row 1 (2, 0 left); d(2,1) fits only row 0; e(1,3) fits no decoder side left: row 2."""
    batch = _batch([(7, 1), (4, 3), (4, 1), (2, 1), (1, 3)])
    limits = LengthLimits("seq2seq", max_input_len=10, max_target_len=4)
    free = make_batcher("packing_free", limits, TOKENS, rows_per_micro_batch=2)
    assert _rows(free.group(batch)) == [[0, 3], [1, 2], [4]]
    shapes = [mb.shape for mb in free(batch)]
    assert shapes == [(2, 9, 4), (1, 1, 3)]  # longest encoder / decoder row of each micro-batch
    assert [mb.shape for mb in make_batcher("packing", limits, TOKENS, rows_per_micro_batch=2)(batch)] == [
        (2, 10, 4), (1, 10, 4)]


@pytest.mark.parametrize("family", ["causal", "seq2seq"])
def test_packing_free_rows_never_exceed_the_limits_and_hold_every_sample_once(family):
    rng = np.random.default_rng(3)
    limits = LengthLimits(family, max_input_len=64, max_target_len=16, max_seq_len=64)
    if family == "causal":
        lengths = [(int(e), int(d)) for e, d in zip(rng.integers(1, 40, 300), rng.integers(1, 24, 300))]
    else:
        lengths = [(int(e), int(d)) for e, d in zip(rng.integers(1, 65, 300), rng.integers(1, 17, 300))]
    batch = _batch(lengths)
    for rows in (1, 3, 8):
        groups = make_batcher("packing_free", limits, TOKENS, rows_per_micro_batch=rows).group(batch)
        assert sorted(i for r in _rows(groups) for i in r) == list(range(len(batch)))
        assert all(len(g.rows) <= rows and g.encoder_len is None and g.decoder_len is None for g in groups)
        for r in _rows(groups):
            e, d = sum(lengths[i][0] for i in r), sum(lengths[i][1] for i in r)
            assert (e + d <= 64) if family == "causal" else (e <= 64 and d <= 16)
    stats = make_batcher("packing_free", limits, TOKENS, rows_per_micro_batch=4).stats(batch)
    dense = make_batcher("packing", limits, TOKENS, rows_per_micro_batch=4).stats(batch)
    assert stats.real_tokens == dense.real_tokens and stats.computed_tokens < dense.computed_tokens


def test_a_sample_over_the_row_length_is_an_error():
    with pytest.raises(ValueError, match=r"sample 1 .* does not fit a packed row"):
        make_batcher("packing_free", LengthLimits("causal", max_seq_len=8), TOKENS).group(_batch([(2, 1), (8, 1)]))


# ---------------------------------------------------------------------------------------------- registry


def test_every_method_list_and_knob_comes_from_the_registry():
    from dynabatch.training import config, workload
    from dynabatch.commands import bench
    from dynabatch.integrations import dataloader

    names = tuple(BASELINES)
    assert "packing_free" in names
    assert config.METHODS == dataloader.METHODS == ("dynamic", *names)
    assert workload.COMPARED_METHODS == ("dynamic", "dynamic_sliced", *names)  # plan, simulate and bench's names
    assert set(workload.COMPARED_METHODS) <= set(bench.METHODS)
    assert bench.BASELINES == names and set(names) < set(bench.METHODS)
    option_fields = {f.name for f in dataclasses.fields(BaselineOptions)}
    config_fields = {f.name for f in dataclasses.fields(config.TrainConfig)}
    for spec in BASELINES.values():
        assert spec.option in option_fields and spec.option in config_fields
        assert spec.knob in {f.name for f in dataclasses.fields(spec.batcher)}
    cfg = config.TrainConfig(method="packing_free", packing_free_rows=3)
    assert BaselineOptions.of(cfg).batcher_options("packing_free", LengthLimits("causal")) == {"rows_per_micro_batch": 3}


def test_every_command_gets_the_method_and_its_knob_flag():
    from dynabatch.commands import bench, plan, simulate
    from dynabatch.commands import data_report as report
    from dynabatch.training.config import add_config_arguments

    p = argparse.ArgumentParser()
    add_config_arguments(p)
    method = next(a for a in p._actions if a.dest == "method")
    assert "packing_free" in method.choices
    assert p.parse_args(["--method", "packing_free", "--packing-free-rows", "2"]).packing_free_rows == 2
    for module in (simulate, plan, bench, report):
        p = argparse.ArgumentParser()
        module.add_arguments(p)
        args = p.parse_args(["--packing-free-rows", "3", "--methods", "packing_free"])
        assert args.packing_free_rows == 3
        assert "packing_free" in next(a for a in p._actions if a.dest == "methods").help


@pytest.fixture()
def lengths_file(tmp_path) -> str:
    rng = np.random.default_rng(0)
    e = np.clip(rng.lognormal(np.log(200), 0.8, 400), 1, 2000).astype(np.int64)
    d = np.clip(rng.lognormal(np.log(8), 1.0, 400), 1, 300).astype(np.int64)
    path = str(tmp_path / "lengths.npz")
    np.savez(path, input_len=e, target_len=d)
    return path


def test_simulate_and_plan_run_only_the_methods_given(lengths_file, capsys):
    from dynabatch.cli import main

    common = ["--lengths", lengths_file, "--model", "gpt", "--max-input-len", "512", "--global-batch-tokens", "16384",
              "--num-batches", "1", "--json"]
    assert main(["simulate", *common, "--search-steps", "0", "--methods", "packing_free,packing"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["methods"]
    assert list(rows) == ["packing_free", "packing"] and out["dynamic_throughput_vs_best_baseline"] is None
    assert rows["packing_free"]["computed_tokens"] < rows["packing"]["computed_tokens"]
    assert rows["packing_free"]["real_tokens"] == rows["packing"]["real_tokens"]
    assert main(["plan", *common, "--methods", "dynamic,packing_free"]) == 0
    assert set(json.loads(capsys.readouterr().out)["methods"]) == {"dynamic", "packing_free"}
    assert main(["simulate", *common, "--methods", "packing,nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_data_report_reports_packing_free(tmp_path, capsys):
    from conftest import random_rows, write_jsonl

    from dynabatch.cli import main

    path = write_jsonl(tmp_path / "mytask.jsonl", random_rows("mytask", 60, 5, 40, 5))
    assert main(["data-report", "--data", path, "--tokenizer", "byt5", "--family", "gpt2", "--max-lens", "128",
                 "--token-budget", "4096", "--num-batches", "2", "--methods", "packing,packing_free"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.strip().startswith("max_len"))
    assert header.split()[1:3] == ["packing", "packing_free"]
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("128"))
    packing, free = float(row[1]), float(row[2])
    assert 0 < packing <= free <= 1


# ---------------------------------------------------------------------------------------------- tuning


def test_grid_settings_skip_values_with_the_same_micro_batches():
    """Three packed rows: every rows-per-micro-batch value of 3 or more gives one micro-batch."""
    batch = _batch([(6, 1), (3, 1), (3, 1), (1, 1), (9, 1)])
    limits = LengthLimits("causal", max_seq_len=10)
    settings = dict(grid_settings("packing_free", [batch], limits, BaselineOptions(packing_free_rows=4)))
    assert settings == {1: None, 2: None, 4: None, 8: 4, 16: 4}
    budget = dict(grid_settings("token_budget", [batch], limits))  # the default, 2048, goes first
    assert budget[2048] is None and all(v == 2048 for k, v in budget.items() if k != 2048)


def test_tuning_picks_the_fastest_value_that_fits():
    """Synthetic speeds peaking at 8 rows; 16 would be faster but does not fit memory; 32 has the same
    micro-batches as 16 (so it does not fit either)."""
    from dynabatch.commands.tuning import tune

    speed = {1: 10.0, 2: 20.0, 4: 30.0, 8: 40.0, 16: 99.0}
    trials = with_twins({v: Trial(v, s, feasible=v < 16, note="" if v < 16 else "does not fit memory")
                         for v, s in speed.items()}, {32: 16})
    assert best_trial(trials).value == 8 and [t.feasible for t in trials] == [True] * 4 + [False] * 2
    assert best_trial([Trial(4, 1.0, feasible=False)]) is None

    batch = _batch([(30, 2)] * 40)  # 20 rows of 64 tokens
    limits = LengthLimits("causal", max_seq_len=64)
    run = lambda rows: (speed[rows], "" if rows < 16 else "does not fit memory")  # noqa: E731
    tuned = tune("packing", [batch], limits, BaselineOptions(packing_rows=4), run)
    assert (tuned.default, tuned.value, tuned.tokens_per_s) == (4, 8, 40.0)
    assert [(t.value, t.feasible) for t in tuned.trials] == [(1, True), (2, True), (4, True), (8, True), (16, False)]


def test_simulate_tune_baselines_skips_values_over_the_memory_limit(lengths_file, capsys):
    from dynabatch.cli import main

    argv = ["simulate", "--lengths", lengths_file, "--model", "gpt", "--max-input-len", "512",
            "--global-batch-tokens", "16384", "--num-batches", "1", "--search-steps", "0", "--memory-gib", "8",
            "--methods", "dynamic,packing_free", "--tune-baselines"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    tuned = out["tuned"]["packing_free"]
    trials = {t["value"]: t for t in tuned["trials"]}
    refused = [v for v, t in trials.items() if not t["feasible"]]
    assert refused and all(trials[v]["note"].startswith("does not fit memory") for v in refused)
    assert not out["methods"]["packing_free"]["fits_memory"] and tuned["default"] in refused  # the default: 4 rows
    best = max((t for t in tuned["trials"] if t["feasible"]), key=lambda t: t["tokens_per_s"])
    assert tuned["value"] == best["value"] not in refused and tuned["tokens_per_s"] == best["tokens_per_s"]
    assert out["best_tuned_baseline"] == "packing_free"
    assert out["dynamic_throughput_vs_best_tuned_baseline"] == pytest.approx(
        out["methods"]["dynamic"]["tokens_per_s"] / tuned["tokens_per_s"])
    # each value is simulated as its default would be (its own layer split): what simulating that value gives
    alone = argv[:argv.index("--methods")] + ["--methods", "packing_free", "--packing-free-rows", str(tuned["value"]),
                                               "--json"]
    assert main(alone) == 0
    assert json.loads(capsys.readouterr().out)["methods"]["packing_free"]["tokens_per_s"] == pytest.approx(
        tuned["tokens_per_s"])
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "packing_free    packing_free_rows 4 -> " in table and "does not fit memory" in table


def test_simulate_tunes_each_knob_value_on_its_own_layer_split(capsys):
    """A tuned value is what simulating the baseline at that value gives: its layer split balanced over its own
    micro-batches (``--layer-split data``), as its default's. T5-large at 24 GiB on the 1,024-token heavy tail:
    ``token_budget`` tuned to 4,096 tokens was simulated on the split of its 2,048-token default, 154,669 tok/s,
    which no run of ``token_budget`` at 4,096 gives (151,569)."""
    from dynabatch.cli import main

    argv = ["simulate", "--model", "t5", "--lengths", "data/heavy_tail_1024.npz", "--num-batches", "1",
            "--memory-gib", "24", "--search-steps", "2", "--json"]
    assert main([*argv, "--methods", "dynamic,token_budget", "--tune-baselines"]) == 0
    tuned = json.loads(capsys.readouterr().out)["tuned"]["token_budget"]
    assert tuned["value"] != tuned["default"]
    assert main([*argv, "--methods", "token_budget", "--token-budget-tokens", str(tuned["value"])]) == 0
    alone = json.loads(capsys.readouterr().out)["methods"]["token_budget"]
    assert alone["tokens_per_s"] == pytest.approx(tuned["tokens_per_s"])


def test_bench_tune_baselines_measures_the_grid_and_times_the_best(tmp_path, capsys):
    """One process: padding at 2 samples per micro-batch; 8 or more do not fit 0.06 GiB (skipped before the
    sweep), the rest are measured for one step each; the best is timed with the full steps."""
    from dynabatch.cli import main

    rng = np.random.default_rng(0)
    path = str(tmp_path / "lengths.npz")
    np.savez(path, input_len=rng.integers(1, 100, 200), target_len=rng.integers(1, 20, 200))
    out = str(tmp_path / "bench.json")
    argv = ["bench", "--model", "gpt2-tiny", "--lengths", path, "--methods", "padding", "--stages", "1", "--steps", "1",
            "--warmup", "0", "--tune-steps", "1", "--global-batch-tokens", "512", "--max-input-len", "128",
            "--samples-per-micro-batch", "2", "--memory-gib", "0.06", "--tune-baselines", "--json", out]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    with open(out) as f:
        result = json.load(f)
    tuned = result["tuned"]["padding"]
    trials = {t["value"]: t for t in tuned["trials"]}
    assert tuned["knob"] == "samples_per_micro_batch" and tuned["default"] == 2
    assert not trials[8]["feasible"] and trials[8]["note"].startswith("does not fit memory")
    assert not trials[32]["feasible"]  # same micro-batches as 16, which does not fit either
    assert all(trials[v]["tokens_per_s"] > 0 for v in (1, 2, 4))
    assert tuned["value"] in (1, 2, 4) and tuned["tokens_per_s"] > 0
    assert set(summary["tokens_per_s"]) == {"padding"} == set(result["methods"])  # keyed by --methods
    assert summary["tuned"]["padding"]["samples_per_micro_batch"] == tuned["value"]
    assert any(line.startswith("  padding         samples_per_micro_batch 2 -> ") for line in lines)


def test_train_packing_free_matches_packing(tmp_path, toy_mixture_dir):
    """Two steps of a tiny GPT-2, in one process: the same rows as packing, padded only to the longest
    row, and the same first loss (attention never crosses a sample either way)."""
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.trainer import train

    cfg = TrainConfig(model="gpt2-tiny", tokenizer="byt5", mixture=os.path.join(toy_mixture_dir, "toy.json"),
                      method="packing_free", compare_method="packing", packing_free_rows=2, packing_rows=2,
                      global_batch_tokens=1024, max_input_len=128, max_target_len=32, max_steps=2, logging_steps=0,
                      timeline=False, output_dir=str(tmp_path / "run"))
    train(cfg)

    def records(folder):
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]

    free, dense = records(cfg.output_dir), records(os.path.join(cfg.output_dir, "compare-packing"))
    assert len(free) == len(dense) == 2
    for a, b in zip(free, dense):
        assert a["samples_digest"] == b["samples_digest"] and a["num_micro_batches"] == b["num_micro_batches"]
        assert all(e == 128 for s in b["micro_batch_shapes"] for _, e, _ in s)
        assert all(e <= 128 for s in a["micro_batch_shapes"] for _, e, _ in s) and a["computed_tokens"] < b["computed_tokens"]
    assert np.isfinite(free[1]["loss"]) and free[0]["loss"] == pytest.approx(dense[0]["loss"], rel=1e-4)
    # packing is DynaPipe's dense-mask baseline whatever --attention says; packing_free is padding-free
    assert {r["attention"] for r in free} == {"segments"} and {r["attention"] for r in dense} == {"dense"}
    # which kernel ran: on CPU every padding-free call is per-segment SDPA; the dense path calls none of them
    assert all(set(r["attention_kernels"]) == {"sdpa"} and r["attention_kernels"]["sdpa"] > 0 for r in free)
    assert all(r["attention_kernels"] == {} for r in dense)


def test_hf_dataloader_runs_packing_free(toy_data):
    from dynabatch.integrations.dataloader import DynaBatchDataLoader

    limits = LengthLimits(toy_data.family, max_input_len=128, max_target_len=64, max_seq_len=192)
    loader = DynaBatchDataLoader(toy_data, limits, token_budget=3000, method="packing_free",
                                 method_options={"rows_per_micro_batch": 2}, max_steps=1)
    (step,) = list(loader)
    ids = sorted(i for mb in step.micro_batches for row in mb.sample_ids for i in row)
    assert ids == list(range(len(step.batch))) and sum(step.weights) == pytest.approx(1.0)
    assert step.stats.efficiency > 0.9 and all(len(mb.sample_ids) <= 2 for mb in step.micro_batches)
