"""`dynabatch bench`: runs every method on the same executor and reports the fields; lengths files give
samples of exactly their lengths."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dynabatch.commands.bench import add_arguments
from dynabatch.commands.bench_run import resolve_defaults
from dynabatch.commands.bench_data import load_batches

FIELDS = ("tokens_per_s", "tokens_per_s_per_step", "step_time_s", "padding_efficiency", "bubble_fraction_predicted",
          "predicted_peak_memory_mib", "micro_batches_per_step", "ratio_to_best_baseline",
          "paired_ratio_to_best_baseline")


def _lengths_file(path, n: int = 200, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    np.savez(path, input_len=rng.integers(1, 200, n), target_len=rng.integers(1, 40, n))


def test_lengths_file_batches_have_exact_lengths_and_random_ids(tmp_path):
    from dynabatch.data.batching import LengthLimits
    from dynabatch.data.tokenize import TokenizerInfo

    path = str(tmp_path / "lengths.npz")
    _lengths_file(path)
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--lengths", path, "--global-batch-tokens", "1024", "--max-input-len", "256"])
    limits = LengthLimits("gpt2", max_input_len=256, max_target_len=64, max_seq_len=256)
    info = TokenizerInfo(pad_id=0, eos_id=1, decoder_start_id=0, vocab_size=100)
    batches = load_batches(args, "gpt2", limits, info, 3)
    with np.load(path) as f:
        e, d = f["input_len"], f["target_len"]
    samples = [s for b in batches for s in b.samples]
    assert len(batches) == 3 and all(b.num_tokens <= 1024 for b in batches)
    assert [s.input_len for s in samples] == list(e[: len(samples)])
    assert [s.target_len for s in samples] == list(d[: len(samples)])
    ids = np.concatenate([np.concatenate([s.input_ids, s.target_ids]) for s in samples])
    assert ids.min() >= 2 and ids.max() < 100 and len(np.unique(ids)) > 50


def test_bench_two_ranks_reports_every_field(tmp_path):
    path = str(tmp_path / "lengths.npz")
    _lengths_file(path)
    out = str(tmp_path / "bench.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "dynabatch", "bench", "--model", "gpt2-tiny", "--lengths", path,
           "--methods", "dynamic,packing,padding,pipelining", "--stages", "2", "--steps", "2", "--warmup", "0",
           "--global-batch-tokens", "1024", "--max-input-len", "256", "--json", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "best baseline" in proc.stdout
    with open(out) as f:
        result = json.load(f)
    assert set(result["methods"]) == {"dynamic", "packing", "padding", "pipelining"}
    assert result["best_baseline"] in ("packing", "padding")  # the external peer is not a baseline
    assert result["machine"]["planner_preset"] == "cpu"  # a CPU run plans with the cpu preset (CUDA: its GPU's)
    resolved = result["resolved"]  # each method's configuration through the resolver, with the reasons
    assert set(resolved) == set(result["methods"]) and resolved["dynamic"]["device"][0] == "cpu"
    assert resolved["dynamic"]["recompute"][0] == "per_micro_batch" and resolved["padding"]["recompute"][0] == "none"
    assert all(why for choices in resolved.values() for _, why in choices.values())
    for row in result["methods"].values():
        for field in FIELDS:
            assert field in row, field
        assert row["tokens_per_s"] > 0 and 0 < row["padding_efficiency"] <= 1
        assert 0 <= row["bubble_fraction_predicted"] < 1
        assert np.isfinite(row["loss_first"])
    rows = result["methods"]
    assert rows[result["best_baseline"]]["ratio_to_best_baseline"] == 1.0
    assert rows["pipelining"]["ratio_to_pipelining"] == 1.0
    # the peer runs packing's rows as fixed shapes: at least one micro-batch per stage, never less padding;
    # same model, same data and the same first step, so the same first loss
    assert rows["pipelining"]["micro_batches_per_step"] >= max(2, rows["packing"]["micro_batches_per_step"])
    assert rows["pipelining"]["padding_efficiency"] <= rows["packing"]["padding_efficiency"]
    assert abs(rows["pipelining"]["loss_first"] - rows["packing"]["loss_first"]) < 1e-4
    assert all(b >= 1 and e == 256 and d == 0 for b, e, d in rows["pipelining"]["fixed_shapes"])  # GPT rows of max len
    # activations saved for backward: measured by the executor's meter, next to the schedule's prediction
    for m in ("dynamic", "packing", "padding"):
        measured, predicted = rows[m]["measured_saved_activation_mib"], rows[m]["predicted_saved_activation_mib"]
        assert measured > 0 and measured == pytest.approx(predicted, rel=0.10), (m, measured, predicted)
    assert rows["pipelining"]["measured_saved_activation_mib"] is None
    assert "activations saved for backward, largest stage, measured/predicted MiB: dynamic" in proc.stdout
    # which plan dynamic ran each timed step (the DP's or a baseline's), counted and named per step; none for baselines
    timed = len(rows["dynamic"]["per_step"])
    assert sum(rows["dynamic"]["candidates"].values()) == timed >= 1
    assert [s["candidate"] for s in rows["dynamic"]["per_step"]].count("dp") == rows["dynamic"]["candidates"].get("dp", 0)
    assert rows["packing"]["candidates"] == {} and "dynamic ran these plans (timed steps): " in proc.stdout
    # the last line is the JSON summary with per-method real tokens/s
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["tokens_per_s"] == {m: round(r["tokens_per_s"], 1) for m, r in rows.items()}
    assert summary["model"] == "gpt2-tiny" and summary["stages"] == 2


@pytest.mark.parametrize("model", ["gpt2-mini", pytest.param("llama-d256", marks=pytest.mark.slow)])
# llama-d256 is slow-only: the gpt2-mini run covers bench's slicing path and test_llama_cli's torchrun run llama's slices
def test_bench_dynamic_sliced_runs_token_slices_with_the_unsliced_loss(tmp_path, model):
    """GPT-2 and Llama (GQA, rotary), 2 ranks: steps of two 1024-token samples; slicing them shortens the simulated step (pipeline
    fill and drain), so ``dynamic_sliced`` runs token-slice chains, and its loss equals ``dynamic``'s
    (slices compute the same function; same model, same data). gpt2-mini and llama-d256, not the tiny presets: with
    two blocks of width 64 the output head's stage bounds their step, and with each slice's passes over its context
    priced the planner rightly keeps their samples whole. ``--calibrate off``: planned with the analytic model, so
    whether slices pay does not hang on times measured on a busy machine (calibrated, llama-d256's samples stayed
    whole while other jobs ran)."""
    path = str(tmp_path / "long.npz")
    np.savez(path, input_len=np.full(40, 1023), target_len=np.ones(40, dtype=np.int64))
    out = str(tmp_path / "bench.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "dynabatch", "bench", "--model", model, "--lengths", path,
           "--methods", "dynamic,dynamic_sliced,token_budget", "--stages", "2", "--steps", "2", "--warmup", "0",
           "--global-batch-tokens", "2048", "--max-input-len", "1024", "--json", out, "--quiet", "--calibrate", "off"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        rows = json.load(f)["methods"]
    assert rows["dynamic"]["sliced_samples_per_step"] == 0
    assert rows["dynamic_sliced"]["sliced_samples_per_step"] >= 1
    assert rows["dynamic_sliced"]["micro_batches_per_step"] > rows["dynamic"]["micro_batches_per_step"]
    assert rows["dynamic_sliced"]["bubble_fraction_predicted"] < rows["dynamic"]["bubble_fraction_predicted"]
    assert abs(rows["dynamic_sliced"]["loss_first"] - rows["dynamic"]["loss_first"]) < 1e-4
    for s in rows["dynamic_sliced"]["per_step"]:
        assert s["real_tokens"] == s["computed_tokens"] and s["time_s"] > 0  # equal lengths: no padding


def test_bench_rejects_unknown_method(capsys, monkeypatch):
    from dynabatch.cli import main  # in this process: the exit status python -m dynabatch exits with

    monkeypatch.delenv("RANK", raising=False)
    assert main(["bench", "--methods", "dynamic,nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_model_aliases_and_length_defaults():
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", "gpt", "--max-input-len", "2048"])
    resolve_defaults(args)
    assert (args.model, args.max_target_len, args.global_batch_tokens) == ("gpt2-d256", 512, 8192)
    assert args.methods.split(",")[:2] == ["dynamic", "dynamic_sliced"]
    args = p.parse_args(["--model", "llama"])
    resolve_defaults(args)
    assert args.model == "llama-d256" and "dynamic_sliced" in args.methods.split(",")
    args = p.parse_args([])
    resolve_defaults(args)
    assert (args.model, args.max_input_len, args.max_target_len, args.global_batch_tokens) == ("t5-d256", 512, 128, 8192)
    assert "dynamic_sliced" not in args.methods.split(",")  # T5 samples cannot be cut into causal slices
    args = p.parse_args(["--model", "t5-tiny", "--max-target-len", "7", "--global-batch-tokens", "100"])
    resolve_defaults(args)
    assert (args.model, args.max_target_len, args.global_batch_tokens) == ("t5-tiny", 7, 100)


def test_benchmark_presets_are_the_issue_sizes():
    from dynabatch.models.presets import build_model

    t5 = build_model("t5-d256")
    gpt = build_model("gpt2-d256")
    llama = build_model("llama-d256")
    assert (t5.config.d_model, t5.config.num_layers, t5.config.num_decoder_layers) == (256, 4, 4)
    assert (gpt.config.n_embd, gpt.config.n_layer) == (256, 8)
    assert (llama.config.hidden_size, llama.config.num_hidden_layers, llama.config.num_key_value_heads) == (256, 8, 2)
    n_t5, n_gpt, n_llama = (sum(p.numel() for p in m.parameters()) for m in (t5, gpt, llama))
    assert 0.8 < n_gpt / n_t5 < 1.25  # "GPT-2 of similar size"
    assert 0.9 < n_llama / n_gpt < 1.1  # "llama-d256 about the size of gpt2-d256"


@pytest.fixture
def one_process_bench(tmp_path, capsys, monkeypatch):
    """``dynabatch bench`` on one stage (one process, no torchrun) over an 80-sample lengths file, 1 timed step:
    ``(stdout, per-method JSON rows)``. It runs in this process (a world of one, as the command started on its own,
    without the 5 s a fresh process spends importing torch and transformers; the bench gives the process its
    attention kernel and threads back: test_an_in_process_bench_gives_the_process_its_attention_kernel_and_threads_back)."""
    from dynabatch.cli import main

    monkeypatch.delenv("RANK", raising=False)

    def run(model: str, methods: str, *flags: str):
        path = str(tmp_path / "lengths.npz")
        _lengths_file(path, n=80)
        out = str(tmp_path / "bench.json")
        capsys.readouterr()
        code = main(["bench", "--model", model, "--lengths", path, "--stages", "1", "--methods", methods, "--steps", "1",
                     "--warmup", "0", "--global-batch-tokens", "1024", "--max-input-len", "256", "--json", out, *flags])
        captured = capsys.readouterr()
        assert code == 0, captured.err[-3000:]
        with open(out) as f:
            return captured.out, json.load(f)["methods"]

    return run


def test_bench_one_stage_t5_with_the_pipelining_peer(one_process_bench):
    """One process (stage 0 is also the last: the peer passes both inputs and target), T5, a lengths file."""
    stdout, result = one_process_bench("t5-tiny", "packing,pipelining", "--quiet")
    rows = json.loads(stdout.strip().splitlines()[-1])["tokens_per_s"]
    assert set(rows) == {"packing", "pipelining"} and min(rows.values()) > 0
    assert result["pipelining"]["fixed_shapes"] == [[4, 256, 64]]  # packing rows x max lengths (target L/4)
    assert abs(result["pipelining"]["loss_first"] - result["packing"]["loss_first"]) < 1e-4
    # --dtype bf16 reaches both executors: the same rows, autocast, close to fp32 but not equal
    _, bf16 = one_process_bench("t5-tiny", "packing,pipelining", "--quiet", "--dtype", "bf16")
    for m in ("packing", "pipelining"):
        assert bf16[m]["loss_first"] != result[m]["loss_first"]
        assert abs(bf16[m]["loss_first"] - result[m]["loss_first"]) < 5e-2 * result[m]["loss_first"]
    assert abs(bf16["pipelining"]["loss_first"] - bf16["packing"]["loss_first"]) < 1e-2


def test_bench_recompute_against_no_recompute(one_process_bench):
    """One process, GPT-2: dynamic under --recompute full recomputes every stage forward while
    dynamic_norecompute (its --recompute none twin) recomputes none; both start from the same loss, and their
    measured saved activations fit --memory-gib and match the prediction (they differ: the cheaper memory of
    full recomputation lets the planner form larger micro-batches, whose logits the head stores as before)."""
    stdout, rows = one_process_bench("gpt2-tiny", "dynamic,dynamic_norecompute", "--recompute", "full",
                                      "--calibrate", "off")
    assert "dynamic (--recompute full) vs dynamic_norecompute:" in stdout
    full, none = rows["dynamic"], rows["dynamic_norecompute"]
    assert full["recomputed_forwards_per_step"] == full["micro_batches_per_step"] > 0
    assert none["recomputed_forwards_per_step"] == 0
    assert abs(full["loss_first"] - none["loss_first"]) < 1e-5
    assert full["fits_memory_measured"] and none["fits_memory_measured"]
    for row in (full, none):
        assert row["measured_saved_activation_mib"] == pytest.approx(row["predicted_saved_activation_mib"], rel=0.1)
    assert full["micro_batches_per_step"] <= none["micro_batches_per_step"]


def test_bench_plan_cost_variants_share_one_fit(one_process_bench):
    """One process, GPT-2: dynamic_plan_{base,scaled,calibrated} are dynamic planned with each --plan-costs, all
    calibrated by the one fit the bench shares (--calibrate quick), whatever --plan-costs says; the same global
    batches, so the same first loss."""
    variants = ("dynamic_plan_base", "dynamic_plan_scaled", "dynamic_plan_calibrated")
    _, rows = one_process_bench("gpt2-tiny", ",".join(variants), "--calibrate", "quick", "--quiet")
    assert set(rows) == set(variants)
    for m in variants:
        assert rows[m]["calibration"] == "quick"  # calibrated (OWN_BASE methods say "off")
        assert rows[m]["loss_first"] == pytest.approx(rows["dynamic_plan_base"]["loss_first"], abs=1e-5)


def test_bench_packed_rows_variants_plan_with_their_pack_rows(one_process_bench):
    """One process, T5: dynamic_packed and dynamic_flat are dynamic planned with --pack-rows auto and flat next to
    dynamic's --pack-rows (off), on the same global batches (same first loss: one long row of samples back to
    back computes what padded rows do); the report compares each with dynamic."""
    stdout, rows = one_process_bench("t5-tiny", "dynamic,dynamic_packed,dynamic_flat", "--calibrate", "off",
                                     "--untimed-steps", "1")
    from dynabatch.commands.bench_report import COLUMNS

    assert COLUMNS in stdout  # the legend: what each column is a total, mean or median of
    for row in rows.values():  # padding efficiency over the timed steps, as tokens/s (the untimed one left out)
        steps = row["per_step"]
        assert len(steps) == 1 and row["padding_efficiency"] == pytest.approx(
            steps[0]["real_tokens"] / steps[0]["computed_tokens"])
    for method, value in (("dynamic_packed", "auto"), ("dynamic_flat", "flat")):
        assert f"{method} (--pack-rows {value}) vs dynamic:" in stdout
        assert rows[method]["pack_rows"] == value
        assert rows[method]["loss_first"] == pytest.approx(rows["dynamic"]["loss_first"], abs=1e-5)
    assert rows["dynamic"]["pack_rows"] == "off"
    assert rows["dynamic_flat"]["padding_efficiency"] == 1.0 > rows["dynamic"]["padding_efficiency"]


def test_an_in_process_bench_gives_the_process_its_attention_kernel_and_threads_back(tmp_path, capsys):
    """``dynabatch bench --attention-kernel sdpa`` run in a process that goes on (a notebook, a test) sets the
    kernel and torch's thread count for its run only: after it ends (here at start, on a memory limit too small for
    the model states, after both were set), the process's own are back."""
    from dynabatch.cli import main
    from dynabatch.models import attention_kernels

    import torch

    path = str(tmp_path / "lengths.npz")
    _lengths_file(path, n=8)
    assert attention_kernels.attention_kernel() == "auto"
    threads = torch.get_num_threads()
    mine = 2 if threads == 1 else 1  # the bench sets --threads 1
    torch.set_num_threads(mine)
    try:
        code = main(["bench", "--model", "t5-tiny", "--lengths", path, "--stages", "1", "--methods", "dynamic", "--steps", "1",
                     "--warmup", "0", "--global-batch-tokens", "1024", "--max-input-len", "256", "--attention-kernel",
                     "sdpa", "--memory-gib", "0.01"])
        assert torch.get_num_threads() == mine
    finally:
        torch.set_num_threads(threads)
    assert code == 2
    assert "needs 0.010 GiB for model states alone" in capsys.readouterr().err
    assert attention_kernels.attention_kernel() == "auto"


def test_the_legend_names_every_column_of_the_table():
    """The legend under ``dynabatch bench``'s table said what each column is computed over but left out ``peak MiB``
    (measured or predicted, the largest step's) and ``vs pipe``."""
    from dynabatch.commands.bench_report import COLUMNS

    for label in ("tok/s =", "p50, p10-p90 =", "pad eff =", "bubble =", "mbs, slc =", "step s, pred s =",
                  "peak MiB =", "vs best =", "paired =", "vs pipe ="):
        assert label in COLUMNS


def test_dynamic_profiled_in_methods_asks_for_compare_profile(capsys):
    """The report, the JSON and --compare-profile's help name the method dynamic_profiled, but --methods naming it
    was "unknown method 'dynamic_profiled'" even with --compare-profile given. Without the profile it now says which
    flag it needs; with it the name is taken."""
    from dynabatch.cli import main

    code = main(["bench", "--model", "t5-tiny", "--stages", "1", "--methods", "dynamic,dynamic_profiled"])
    err = capsys.readouterr().err
    assert code == 2 and "dynamic_profiled is dynamic planned with a `dynabatch profile` JSON: pass --compare-profile" \
        in err, err[-2000:]


def test_a_missing_profile_is_one_line_before_the_ranks_start(tmp_path, capsys):
    """``bench --cost-profile`` / ``--compare-profile`` and ``train --stages 2 --cost-profile`` naming a file that is
    not there were said by rank 0 after the launch, the model build and the data; now before any rank starts."""
    from dynabatch.cli import main

    for command, flag in (("bench", "--compare-profile"), ("bench", "--cost-profile"), ("train", "--cost-profile")):
        code = main([command, "--model", "t5-tiny", "--stages", "2", flag, str(tmp_path / "nope.json"),
                     *(["--output-dir", str(tmp_path / "run")] if command == "train" else [])])
        err = capsys.readouterr().err
        assert code == 2 and f"{flag}: cost profile '{tmp_path / 'nope.json'}' not found" in err, err[-2000:]
        assert "[rank" not in err and not (tmp_path / "run").exists()
