"""Long samples kept whole, sliced or split: ``dynamic_sliced`` under the same name in ``plan``, ``simulate`` and
``bench``; the ``packing_free_split`` baseline (TRL bfd_split), which changes the objective and is labelled so; the
baselines' rows sized to the longest kept sample (no false gain from a limit the data never reaches)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from dynabatch.cli import main
from dynabatch.core.methods import COMPARED_METHODS, objective_note
from dynabatch.data.baselines import make_batcher, split_long_samples
from dynabatch.data.batching import LengthLimits
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.data.tokenize import TokenizerInfo
from dynabatch.training.workload import kept_limits

TOKENS = TokenizerInfo(pad_id=0, eos_id=1, decoder_start_id=0, vocab_size=100)


@pytest.fixture
def tail_lengths(tmp_path) -> str:
    """300 short samples and three of 3,700-3,900 input tokens (the longest total 3,963 at most)."""
    rng = np.random.default_rng(0)
    inputs = np.concatenate([rng.integers(16, 200, 300), [3900, 3800, 3700]])
    path = tmp_path / "tail.npz"
    np.savez(path, input_len=inputs, target_len=rng.integers(2, 64, inputs.size))
    return str(path)


def _json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _simulate(capsys, lengths: str, methods: str, *extra: str) -> dict:
    return _json(capsys, ["simulate", "--model", "gpt", "--lengths", lengths, "--num-batches", "2",
                          "--max-input-len", "4096", "--search-steps", "2", "--methods", methods, *extra])


def test_whole_sample_baselines_leave_out_the_split_rows():
    """What the benchmark scripts sweep (``scripts/bench_sweep.py``, ``scripts/bench_schedule.py``): every baseline a
    model runs but ``packing_free_split``, which changes the objective (and which a T5 cannot run: the scripts had
    stopped at it)."""
    from dynabatch.core.methods import BASELINE_METHODS, whole_sample_baselines

    for kind in ("causal", "seq2seq"):
        kept = whole_sample_baselines(kind)
        assert "packing_free_split" not in kept and "packing_free" in kept
        assert set(kept) == {m for m in BASELINE_METHODS if not objective_note(m)}


def test_dynamic_sliced_is_one_name_in_every_command():
    from dynabatch.commands import bench

    assert COMPARED_METHODS[:2] == ("dynamic", "dynamic_sliced")
    assert bench.SLICED == "dynamic_sliced" and set(COMPARED_METHODS) <= set(bench.METHODS)


def test_simulate_dynamic_sliced_equals_dynamic_with_slice_long(tail_lengths, capsys):
    both = _simulate(capsys, tail_lengths, "dynamic,dynamic_sliced")["methods"]
    flag = _simulate(capsys, tail_lengths, "dynamic", "--slice-long")["methods"]["dynamic"]
    assert both["dynamic"]["sliced_samples"] == 0 and both["dynamic_sliced"]["sliced_samples"] > 0
    for key in ("sliced_samples", "micro_batches", "step_s", "tokens_per_s", "real_tokens"):
        assert both["dynamic_sliced"][key] == pytest.approx(flag[key])
    assert both["dynamic_sliced"]["real_tokens"] == both["dynamic"]["real_tokens"]


def test_plan_takes_dynamic_sliced(tail_lengths, capsys):
    out = _json(capsys, ["plan", "--model", "gpt", "--lengths", tail_lengths, "--num-batches", "2",
                         "--max-input-len", "4096", "--methods", "dynamic,dynamic_sliced,packing_free"])
    rows = out["methods"]
    assert rows["dynamic"]["sliced_samples"] == 0 and rows["dynamic_sliced"]["sliced_samples"] > 0
    assert rows["dynamic_sliced"]["real_tokens"] == rows["packing_free"]["real_tokens"]
    # the speedup is the faster planner's, as in simulate; with dynamic_sliced alone, its own
    faster = min(("dynamic", "dynamic_sliced"), key=lambda m: rows[m]["predicted_step_s"])
    assert out["dynamic_method"] == faster and out["dynamic_speedup_vs_best_baseline"] == pytest.approx(
        rows["packing_free"]["predicted_step_s"] / rows[faster]["predicted_step_s"])
    alone = _json(capsys, ["plan", "--model", "gpt", "--lengths", tail_lengths, "--num-batches", "2",
                           "--max-input-len", "4096", "--methods", "dynamic_sliced,packing_free"])
    assert alone["dynamic_method"] == "dynamic_sliced" and alone["dynamic_speedup_vs_best_baseline"] is not None


@pytest.mark.parametrize("command", ["plan", "simulate"])
@pytest.mark.parametrize("method", ["dynamic_sliced", "packing_free_split"])
def test_t5_refuses_decoder_only_methods_with_one_line(command, method, tail_lengths, capsys):
    code = main([command, "--model", "t5", "--lengths", tail_lengths, "--num-batches", "1", "--methods",
                 f"dynamic,{method}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert method in err[0] and "decoder-only" in err[0] and "encoder-decoder" in err[0]


def _sample(e: int, d: int, start: int = 0) -> TokenizedSample:
    return TokenizedSample("t", np.arange(start, start + e, dtype=np.int32),
                           np.arange(start + e, start + e + d, dtype=np.int32))


def test_split_long_samples_cuts_only_long_ones_into_row_length_chunks():
    batch = GlobalBatch(0, (_sample(10, 3), _sample(2, 2, 100), _sample(1, 9, 200)))
    split = split_long_samples(batch, 4)
    assert split.num_tokens == batch.num_tokens
    assert split.samples[4] is batch.samples[1]  # a sample that fits stays whole
    # the chunks of each long sample are its sequence in order, inputs staying inputs and targets targets
    chunks = [split.samples[k] for k in range(4)]
    assert np.concatenate([np.concatenate([c.input_ids, c.target_ids]) for c in chunks]).tolist() == list(range(13))
    assert [(c.input_len, c.target_len) for c in chunks] == [(4, 0), (4, 0), (2, 2), (0, 1)]
    assert max(c.num_tokens for c in split.samples) <= 4
    assert split_long_samples(split, 4) is split  # idempotent: nothing left to cut


def test_packing_free_split_trains_every_token_once_in_rows_of_its_length():
    limits = LengthLimits("causal", max_seq_len=64)
    batch = GlobalBatch(0, tuple(_sample(e, d) for e, d in [(40, 20), (5, 3), (7, 2), (30, 1), (3, 3)]))
    batcher = make_batcher("packing_free_split", limits, TOKENS, row_tokens=16)
    micro = batcher(batch)
    assert sum(mb.num_real_tokens for mb in micro) == batch.num_tokens
    assert all(mb.shape[0] == 1 and mb.shape[1] <= 16 for mb in micro)  # one row of at most row_tokens per micro-batch
    whole = make_batcher("packing_free", limits, TOKENS, rows_per_micro_batch=1)(batch)
    assert max(mb.shape[1] for mb in whole) == 60  # packing_free keeps the 60-token sample whole
    with pytest.raises(ValueError, match="longer than a row"):  # grouping an unsplit batch is refused, not wrong
        batcher.group(batch)


def test_packing_free_split_is_labelled_and_never_the_best_whole_sample_baseline(tail_lengths, capsys):
    out = _simulate(capsys, tail_lengths, "dynamic,packing_free,packing_free_split")
    rows = out["methods"]
    assert "different objective" in rows["packing_free_split"]["changes_objective"]
    assert "changes_objective" not in rows["packing_free"]
    assert out["best_baseline"] == "packing_free"  # however fast the split rows are
    assert out["dynamic_throughput_vs_best_baseline"] == pytest.approx(
        rows["dynamic"]["tokens_per_s"] / rows["packing_free"]["tokens_per_s"])
    assert main(["simulate", "--model", "gpt", "--lengths", tail_lengths, "--num-batches", "1", "--max-input-len",
                 "4096", "--search-steps", "0", "--methods", "dynamic,packing_free_split"]) == 0
    table = capsys.readouterr().out
    assert "packing_free_split*" in table and f"* packing_free_split {objective_note('packing_free_split')}" in table


def test_tuned_packing_free_split_is_reported_but_not_the_best_tuned(tail_lengths, capsys):
    out = _simulate(capsys, tail_lengths, "dynamic,length_grouped,packing_free_split", "--tune-baselines")
    assert out["tuned"]["packing_free_split"]["knob"] == "packing_free_split_tokens"
    assert "changes_objective" in out["tuned"]["packing_free_split"]
    assert out["best_tuned_baseline"] == "length_grouped"


def test_kept_limits_narrow_to_the_longest_kept_sample():
    batch = GlobalBatch(0, (_sample(100, 20), _sample(300, 5)))
    gpt = kept_limits(LengthLimits("causal", max_input_len=32768, max_seq_len=32768), [batch])
    assert gpt.max_seq_len == 305 and gpt.max_input_len == 305
    t5 = kept_limits(LengthLimits("seq2seq", max_input_len=32768, max_target_len=8192), [batch])
    assert (t5.max_input_len, t5.max_target_len) == (300, 20)
    assert kept_limits(LengthLimits("causal", max_seq_len=200, max_input_len=200), [batch]).max_seq_len == 200


def test_a_limit_the_data_never_reaches_gives_the_baselines_no_longer_rows(tail_lengths, capsys):
    """The false gain: at a 32k limit on data whose longest sample has < 4k tokens, the baselines would be charged
    for 32k-token rows; sized to the longest kept sample they simulate exactly as at a 4k limit."""
    at = {limit: _json(capsys, ["simulate", "--model", "gpt", "--lengths", tail_lengths, "--num-batches", "2",
                                "--max-input-len", limit, "--global-batch-tokens", "65536", "--search-steps", "2",
                                "--methods", "packing_free,token_budget"])
          for limit in ("4096", "32768")}
    assert at["4096"]["row_limits"] == at["32768"]["row_limits"]
    for m in ("packing_free", "token_budget"):
        assert at["32768"]["methods"][m]["tokens_per_s"] == pytest.approx(at["4096"]["methods"][m]["tokens_per_s"])


def test_bench_runs_packing_free_split_on_chunks(tmp_path, capsys, monkeypatch):
    """One process, gpt2-tiny: packing_free_split trains every real token of the step (its chunks), in micro-batches
    no longer than its row, and is reported with its caveat, never as the best baseline. The bench runs in this
    process (a world of one, as the command started on its own; it gives the process its attention kernel back)."""
    path = str(tmp_path / "long.npz")
    np.savez(path, input_len=np.array([20, 30, 500, 40, 25, 60]), target_len=np.array([5, 4, 11, 6, 3, 5]))
    out = str(tmp_path / "bench.json")
    monkeypatch.delenv("RANK", raising=False)
    code = main(["bench", "--model", "gpt2-tiny", "--lengths", path, "--stages", "1",
                 "--methods", "packing_free,packing_free_split", "--packing-free-split-tokens", "128", "--steps",
                 "1", "--warmup", "0", "--global-batch-tokens", "1024", "--max-input-len", "512", "--json", out,
                 "--quiet"])
    assert code == 0, capsys.readouterr().err[-3000:]
    with open(out) as f:
        result = json.load(f)
    rows = result["methods"]
    assert result["best_baseline"] == "packing_free" and "changes_objective" in rows["packing_free_split"]
    split, whole = rows["packing_free_split"]["per_step"][0], rows["packing_free"]["per_step"][0]
    assert split["real_tokens"] == whole["real_tokens"]
    assert split["computed_tokens"] == split["real_tokens"]  # one row per micro-batch: nothing padded
    assert rows["packing_free_split"]["micro_batches_per_step"] >= 6  # 709 tokens in rows of 128


def test_long_tail_file_is_what_its_script_writes_and_has_the_tail():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts"))
    from make_long_tail import long_tail_lengths

    from dynabatch.training.workload import load_lengths

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "long_tail_32k.npz")
    assert os.path.getsize(path) < 100_000  # KBs, in the repository
    lengths = load_lengths(path)
    e, d, task = long_tail_lengths()
    assert np.array_equal(lengths.input_len, e) and np.array_equal(lengths.target_len, d)
    assert np.array_equal(lengths.task, task)
    total = lengths.input_len + lengths.target_len
    long = (total > 16384).mean()
    assert 0.001 <= long <= 0.009 and 16384 < total.max() <= 32768  # a few tenths of a percent, 16k-32k
    assert np.median(total) < 512 and len(np.unique(lengths.task)) > 10  # most samples short; many tasks


def test_data_report_shows_a_lengths_files_tail(tail_lengths, capsys):
    assert main(["data-report", "--lengths", tail_lengths]) == 0
    table = capsys.readouterr().out
    assert "p99.9" in table and "max" in table and "over   4096 tokens" in table
    out = _json(capsys, ["data-report", "--lengths", tail_lengths])
    with np.load(tail_lengths) as f:
        inputs, total = f["input_len"], f["input_len"] + f["target_len"]
    assert out["samples"] == total.size and out["percentiles"]["total"]["max"] == total.max()
    assert out["percentiles"]["input"]["p99.9"] == pytest.approx(np.percentile(inputs, 99.9))
    assert out["over"]["4096"]["samples"] == 0 and out["over"]["16384"]["samples"] == 0
    assert out["percentiles"]["total"]["p50"] < 200


def test_data_report_lengths_refuses_a_mixture_too(tail_lengths, capsys):
    assert main(["data-report", "--lengths", tail_lengths, "--mixture", "data/flan_mini.yaml"]) == 2
    assert "not both" in capsys.readouterr().err


def test_data_report_lengths_points_a_mixture_spec_to_mixture(capsys):
    """plan, simulate and bench take a mixture spec as ``--lengths``; data-report's reads lengths files only, and a
    spec given there says to pass it as ``--mixture`` (the line said only which suffixes lengths files have)."""
    assert main(["data-report", "--lengths", "data/flan_mini.yaml"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "pass --mixture data/flan_mini.yaml" in err[0], err


def test_train_runs_packing_free_split_and_says_it_changes_the_objective(tmp_path, capsys):
    assert main(["train", "--model", "gpt2-tiny", "--method", "packing_free_split", "--packing-free-split-tokens", "128",
                 "--max-steps", "1", "--stages", "1", "--max-input-len", "512", "--global-batch-tokens", "2048",
                 "--calibrate", "off", "--output-dir", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "note: packing_free_split" in err and "different objective" in err
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        step = json.loads(f.readline())
    assert step["padding_efficiency"] == 1.0  # one row of chunks per micro-batch: nothing padded



def test_a_compare_run_that_cannot_plan_says_it_is_the_compare_run(tmp_path, capsys):
    """``--slice-long --compare-method dynamic`` where samples fit only sliced: the sliced run trains, then the
    unsliced comparison cannot plan. Its one line named a sample that "does not fit alone" and nothing else, as if
    the run itself had failed; it must say that the comparison failed and where the run's own metrics are."""
    out = tmp_path / "run"
    assert main(["train", "--model", "gpt2-tiny", "--slice-long", "--memory-gib", "0.04", "--max-steps", "1",
                 "--compare-method", "dynamic", "--calibrate", "off", "--no-timeline", "--logging-steps", "0",
                 "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dynabatch train: error: --compare-method dynamic: ") and "do not fit alone" in err[-1]
    assert str(out / "metrics.jsonl") in err[-1] and "Traceback" not in "\n".join(err)
    with open(out / "metrics.jsonl") as f:
        assert json.loads(f.readline())["sliced_samples"] > 0

def test_bench_passes_its_timeout_to_the_runs():
    """A step of long micro-batches on a busy CPU can outlast the default 120 s peer timeout: --timeout-s raises it."""
    import argparse

    from dynabatch.commands import bench, bench_run

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--model", "gpt2-d256-8k", "--max-input-len", "8192", "--global-batch-tokens", "65536",
                         "--timeout-s", "1800"])
    bench_run.resolve_defaults(args)
    assert bench_run._config(args, "packing_free_split").timeout_s == 1800
    assert bench_run._config(args, "dynamic_sliced").slice_long


def test_plan_says_which_baselines_do_not_fit_and_compares_with_those_that_do(capsys):
    """T5-large at 8 GiB on the 1,024-token heavy tail: ``length_grouped``'s and ``padding``'s schedules peak over
    the 7.2 GiB device limit (simulate's check, :mod:`dynabatch.commands.scheduled`); ``token_budget``'s fits, though
    only with fewer than 4 micro-batches in flight, which the table says (its formula step is optimistic). Dynamic's
    speedup is over the best baseline that fits; with none fitting, over them all."""
    argv = ["plan", "--model", "t5", "--lengths", "data/heavy_tail_1024.npz", "--num-batches", "1"]
    methods = ["--methods", "dynamic,padding,length_grouped,token_budget"]
    out = _json(capsys, [*argv, "--memory-gib", "8", *methods])
    rows = out["methods"]
    assert rows["dynamic"]["fits_memory"] and rows["token_budget"]["fits_memory"]
    assert rows["token_budget"]["peak_memory_gib"] <= out["memory_limit_gib"]
    assert not rows["token_budget"]["fits_in_flight"]
    for m in ("padding", "length_grouped"):
        assert not rows[m]["fits_memory"] and rows[m]["peak_memory_gib"] > rows[m]["memory_limit_gib"]
    assert out["best_baseline"] == "token_budget" and out["dynamic_speedup_vs_best_baseline"] == pytest.approx(
        rows["token_budget"]["predicted_step_s"] / rows["dynamic"]["predicted_step_s"])
    assert main([*argv, "--memory-gib", "8", *methods]) == 0
    table = capsys.readouterr().out
    assert "length_grouped does not fit: its simulated schedule peaks at 8.58 GiB of the 7.20 GiB device limit" in table
    assert "token_budget does not fit" not in table
    assert "token_budget fits only with fewer than 4 micro-batches in flight" in table
    assert "token_budget's step assumes 4 micro-batches in flight, which do not fit: see above" in table
    alone = _json(capsys, [*argv, "--memory-gib", "7", "--methods", "dynamic,length_grouped,padding"])
    rows = alone["methods"]
    assert not rows["length_grouped"]["fits_memory"] and not rows["padding"]["fits_memory"]
    assert alone["baselines_compared"] == "none fits"
    assert alone["dynamic_speedup_vs_best_baseline"] == pytest.approx(
        min(rows[m]["predicted_step_s"] for m in ("length_grouped", "padding")) / rows["dynamic"]["predicted_step_s"])


def test_plan_tunes_the_baselines_within_the_memory_and_dynamic_is_never_slower_than_the_best(capsys):
    """``plan --tune-baselines`` (T5-large at 24 GiB, the 1,024-token heavy tail): each baseline is planned at every
    value of its knob's grid, each value as its default would be (its own layer split), and the best value that
    fits (simulate's check: the scheduled peak) is kept; ``token_budget``'s largest budget does not fit. Dynamic is
    predicted at least as fast as the best tuned baseline: its candidates hold every baseline's plan, and its layer
    split is balanced again over the plan it keeps (one balancing over the DP's plan left it at 0.99x the tuned
    ``token_budget``, whose plan it had chosen under a split balanced for another). At 8 GiB ``length_grouped``'s
    default (8 samples) does not fit and gives way to a smaller value that does."""
    methods = "dynamic,length_grouped,token_budget,packing_free"
    argv = ["plan", "--model", "t5", "--lengths", "data/heavy_tail_1024.npz", "--num-batches", "1", "--memory-gib", "24"]
    out = _json(capsys, [*argv, "--methods", methods, "--tune-baselines"])
    rows, tuned = out["methods"], out["tuned"]
    assert set(tuned) == {"length_grouped", "token_budget", "packing_free"}
    for m, t in tuned.items():
        trials = {x["value"]: x for x in t["trials"]}
        assert trials[t["value"]]["feasible"] and not trials[t["value"]]["note"]
        assert t["tokens_per_s"] == max(x["tokens_per_s"] for x in t["trials"] if x["feasible"] and x["tokens_per_s"])
    budget = {x["value"]: x for x in tuned["token_budget"]["trials"]}
    assert not budget[max(budget)]["feasible"] and "does not fit memory (peak" in budget[max(budget)]["note"]
    small = _json(capsys, [*argv[:-1], "8", "--methods", "length_grouped", "--tune-baselines"])
    grouped = small["tuned"]["length_grouped"]
    assert not small["methods"]["length_grouped"]["fits_memory"]
    assert grouped["value"] is not None and grouped["value"] < grouped["default"]
    best = out["best_tuned_baseline"]
    assert out["dynamic_speedup_vs_best_tuned_baseline"] == pytest.approx(
        rows["dynamic"]["predicted_tokens_per_s"] / tuned[best]["tokens_per_s"])
    assert out["dynamic_speedup_vs_best_tuned_baseline"] >= 1.0
    # a tuned value is what planning the baseline at that value gives
    for m in ("length_grouped", best):
        flag = "--" + tuned[m]["knob"].replace("_", "-")
        alone = _json(capsys, [*argv, "--methods", m, flag, str(tuned[m]["value"])])
        assert alone["methods"][m]["predicted_tokens_per_s"] == pytest.approx(tuned[m]["tokens_per_s"])
    assert main([*argv, "--methods", methods, "--tune-baselines"]) == 0
    table = capsys.readouterr().out
    assert "tuned baselines (best knob value that fits memory, predicted tokens/s):" in table
    assert f"dynamic vs best tuned baseline ({best}; whole-sample baselines)" in table


def test_simulated_dynamic_is_never_slower_than_a_baseline_plan_it_could_have_kept(capsys):
    """``simulate`` prices the dynamic planner's candidates (the DP's plan and every baseline's at its grid's knob
    values, :mod:`dynabatch.plan.candidates`) under the schedule its own step gets (every policy and order, then the
    seeded search), so dynamic simulates at least as fast as the best tuned baseline of the same split (T5-large, the
    long-tail file cut at 4,096 tokens, two batches: 0.95x tuned ``packing_free`` when the candidates were priced
    under the adaptive schedule alone, which made the DP's plan look faster than ``packing_free``'s)."""
    out = _json(capsys, ["simulate", "--model", "t5", "--lengths", "data/long_tail_32k.npz", "--max-input-len", "4096",
                         "--max-target-len", "1024", "--num-batches", "2", "--methods", "dynamic,packing_free",
                         "--tune-baselines", "--layer-split", "reference"])
    assert out["best_tuned_baseline"] == "packing_free"
    assert out["dynamic_throughput_vs_best_tuned_baseline"] >= 1.0 - 1e-9  # exactly 1 when it keeps that plan


def test_simulate_says_when_its_best_baseline_does_not_fit_the_memory(capsys):
    """``simulate``'s ratio falls back to every whole-sample baseline when none fits the memory, as ``plan``'s does,
    and says so: t5-d256 at 3 GiB, where ``packing_free`` with one long sample per row peaks above the limit, was
    printed as "vs best baseline (packing_free; whole-sample baselines)", as if it had fit."""
    argv = ["simulate", "--model", "t5-d256", "--lengths", "data/long_tail_32k.npz", "--max-input-len", "8192",
            "--global-batch-tokens", "32768", "--memory-gib", "3", "--packing-free-rows", "1", "--num-batches", "2",
            "--methods", "dynamic,packing_free", "--stages", "2", "--hardware", "cpu", "--search-steps", "2"]
    out = _json(capsys, argv)
    assert not out["methods"]["packing_free"]["fits_memory"] and out["methods"]["dynamic"]["fits_memory"]
    assert out["best_baseline"] == "packing_free" and out["baselines_compared"] == "none fits"
    assert main(argv) == 0
    assert ("dynamic vs best baseline (packing_free; no whole-sample baseline fits the memory: the best of those "
            "that do not), real tokens/s") in capsys.readouterr().out
