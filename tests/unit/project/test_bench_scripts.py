"""The simulated-benchmark scripts that docs/benchmarks pages cite still run, at a small size: both had stopped with
an error once ``packing_free_split`` (decoder-only) joined the method list, and nothing ran them."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _script(name: str):
    """``scripts/NAME`` imported as a module (its ``main(argv)`` runs in this process: a subprocess per script would
    import torch again for each)."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(script: str, *argv: str) -> str:
    """What ``python scripts/SCRIPT ARGV`` prints, asserting it ends without an error."""
    out = io.StringIO()
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out):
            code = _script(script).main(list(argv))
    finally:
        os.chdir(cwd)
    assert code in (None, 0), out.getvalue()[-2000:]
    return out.getvalue()


def test_bench_sweep_runs_every_whole_sample_method_for_both_families(tmp_path):
    from dynabatch.core.methods import whole_sample_baselines

    out = tmp_path / "sweep.json"
    printed = _run("bench_sweep.py", "--lengths", "512", "--models", "t5,gpt", "--num-batches", "1", "--json", str(out))
    results = json.loads(out.read_text())
    for model in ("t5", "gpt"):
        assert set(results[model]["512"]) == {"dynamic", *whole_sample_baselines(model)}
        assert all(r["tokens_per_s"] > 0 for r in results[model]["512"].values())
    assert "t5      512 |" in printed and "gpt     512 |" in printed


def test_bench_schedule_runs_for_both_families():
    printed = _run("bench_schedule.py", "--num-batches", "1", "--lengths", "512", "--models", "t5,gpt")
    assert "t5      512 |" in printed and "gpt     512 |" in printed


def test_simulated_paper_setting_dynamic_is_at_least_every_tuned_baseline(tmp_path):
    """``scripts/simulate_papers.py`` (DynaPipe's setting: T5-3B and GPT-2.7B, 4 stages, inter-node links) at 1,024
    tokens: dynamic at or above the best tuned baseline that fits. It was 0.99x tuned ``packing_free`` for T5-3B when
    ``simulate`` skipped planning without recomputation once the auto plan recomputed nothing: the two price the
    baseline candidates differently, so they can keep different plans."""
    out = tmp_path / "papers.json"
    _run("simulate_papers.py", "--which", "dynapipe", "--lengths", "1024", "--json", str(out))
    rows = json.loads(out.read_text())["dynapipe"]
    assert {r["model"] for r in rows} == {"t5", "gpt"}
    for r in rows:
        assert r["dyn_over_best_fitting_baseline"] >= 1.0 - 1e-9, (r["model"], r["dyn_over_best_fitting_baseline"])


def test_a_boundary_moved_per_micro_batch_evens_what_a_whole_unit_overshoots():
    """Per step a unit moves whole: 10 | 6 with a 3 s boundary unit stays 10 (moving it gives 7 | 9, busier 9); per
    micro-batch 2 s of it move and both devices compute 8. A unit smaller than the gap moves entirely either way."""
    busier = _script("estimate_split_moves.py").busier_after_move
    assert busier(10.0, 6.0, 3.0, 1.0) == 9.0
    assert busier(10.0, 6.0, 3.0, 1.0, per_micro_batch=True) == 8.0
    assert busier(10.0, 6.0, 1.0, 1.0) == busier(10.0, 6.0, 1.0, 1.0, per_micro_batch=True) == 9.0
    assert busier(6.0, 10.0, 1.0, 5.0, per_micro_batch=True) == 8.0
    assert busier(8.0, 8.0, 2.0, 2.0, per_micro_batch=True) == 8.0


def test_estimate_split_moves_reads_a_stored_bench_result():
    """The script the long-tail page cites, on the result it names."""
    result = ROOT / "docs/benchmarks/long_tail/cpu_gpt2-d256-8k_8192_10steps_slice_candidates_2026-12-07.json"
    per_step = _run("estimate_split_moves.py", str(result))
    per_micro_batch = _run("estimate_split_moves.py", str(result), "--per-micro-batch")
    ratios = {}
    for printed, key in ((per_step, "step"), (per_micro_batch, "micro-batch")):
        for line in printed.splitlines():
            method, _, rest = line.partition(":")
            ratios[method, key] = float(rest.rsplit(":", 1)[1].strip().rstrip("x"))
    assert {m for m, _ in ratios} == {"dynamic_sliced", "dynamic", "length_grouped"}
    for method in ("dynamic_sliced", "dynamic", "length_grouped"):
        assert 1.0 <= ratios[method, "step"] <= ratios[method, "micro-batch"]


def test_plot_plan_prices_packed_rows_per_segment_as_plan_does(tmp_path):
    """``scripts/plot_plan.py`` (docs/algorithms/planner.md's figure) priced every micro-batch as dense attention over
    its padded shape, so a dynamic plan of packed rows was drawn with a predicted step slower than the token-budget
    baseline below it; it now prices as ``dynabatch plan`` does (per segment, ``plan.pairs``)."""
    import argparse
    import importlib.util

    import numpy as np

    from dynabatch.commands.common import add_workload_arguments, resolve
    from dynabatch.training.workload import global_batches, method_micro_batches

    spec = importlib.util.spec_from_file_location("plot_plan", ROOT / "scripts" / "plot_plan.py")
    plot_plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_plan)
    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "lens.npz", input_len=rng.integers(5, 300, 200), target_len=rng.integers(2, 60, 200))
    args = p.parse_args(["--model", "t5", "--global-batch-tokens", "16384", "--stages", "2",
                         "--lengths", str(tmp_path / "lens.npz")])
    w = resolve(args)
    batch = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, 1, args.tokenizer)[0]
    plan = method_micro_batches("packing_free", batch, w.limits, w.cost_model, 2, w.options)
    assert plan.pairs is not None and any(len(row) > 1 for g in plan.groups for row in g.rows)  # packed rows
    shapes = plan.shapes
    t, _, _ = w.cost_model.evaluate(shapes[:, 0], shapes[:, 1], shapes[:, 2], pairs=plan.pairs)
    dense, _, _ = w.cost_model.evaluate(shapes[:, 0], shapes[:, 1], shapes[:, 2])
    step = plot_plan.predicted_step(plan, w.cost_model, 2)
    assert step == float(t.sum() + t.max()) and not np.isclose(step, float(dense.sum() + dense.max()))
