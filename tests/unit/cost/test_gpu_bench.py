"""scripts/gpu_bench.py: its CPU smoke mode runs the whole path (profile, check, interleaved bench planned
with that profile) and ends with the JSON summary."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def test_gpu_bench_cpu_quick_smoke(tmp_path, capsys, monkeypatch):
    """The script's ``main`` in this process (no subprocess imports); ``--device cpu`` hides CUDA from the
    process, which monkeypatch undoes afterwards."""
    spec = importlib.util.spec_from_file_location("gpu_bench", os.path.join(ROOT, "scripts", "gpu_bench.py"))
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    monkeypatch.delenv("RANK", raising=False)
    out = str(tmp_path / "gb")
    code = gpu_bench.main(["--device", "cpu", "--quick", "--out", out])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["device"] == "cpu" and summary["stages"] == 1 and summary["planned_with"] == "profile"
    assert set(summary["tokens_per_s"]) == {"dynamic", "dynamic_flat", "packing_free", "packing", "padding",
                                            "token_budget"}
    assert all(v > 0 for v in summary["tokens_per_s"].values())
    assert 0 <= summary["profile_check_time_median_rel_err"] < 10
    with open(os.path.join(out, "bench_main.json")) as f:
        result = json.load(f)
    assert result["config"]["cost_profile"] == os.path.join(out, "profile.json")  # dynamic planned with the profile
    assert result["best_baseline"] in ("packing_free", "packing", "padding", "token_budget")
    # the quick profile's grid (4 rows) cannot price the baselines' larger micro-batches: reported as such,
    # never as the profile's 1e30 "infeasible" marker; dynamic plans on the grid, so it is priced
    rows = result["methods"]
    assert rows["dynamic"]["priced_off_grid"] is False and rows["dynamic"]["predicted_step_s_median"] > 0
    off = [m for m, r in rows.items() if r["priced_off_grid"]]
    assert off and all(rows[m]["predicted_step_s_median"] is None for m in off)
    numbers = [v for r in rows.values() for k, v in r.items() if isinstance(v, float)]
    assert max(numbers) < 1e20, max(numbers)
    assert f"n/a: {', '.join(off)} ran micro-batches beyond the cost profile's grid" in captured.out
    from dynabatch.cost.tables import CostTables

    tables = CostTables.load(os.path.join(out, "profile.json"))
    assert tables.meta["config"]["model_type"] == "t5"
    with open(os.path.join(out, "profile_check.json")) as f:
        assert json.load(f)["model"]["n"] >= 1


def test_simulate_profile_prices_every_method_with_the_measured_h200_tables(tmp_path):
    """scripts/simulate_profile.py on the t5-small profile measured on the H200: plans, schedules and simulates
    with the profile (no analytic model), sends priced by the h200 preset's links."""
    spec = importlib.util.spec_from_file_location("simulate_profile", os.path.join(ROOT, "scripts", "simulate_profile.py"))
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    out = str(tmp_path / "sim.json")
    profile = os.path.join(ROOT, "docs", "benchmarks", "gpu_h200", "t5_small_h200_profile_2026-12-04.json")
    assert sim.main(["--profile", profile, "--stages", "1,2", "--num-batches", "1", "--methods", "dynamic,packing_free",
                     "--pack-rows", "auto", "--json", out]) == 0
    with open(out) as f:
        result = json.load(f)
    assert result["device"]["name"] == "NVIDIA H200"
    for stages in ("1", "2"):
        rows = result["stages"][stages]["methods"]
        assert all(r["tokens_per_s"] > 0 and r["fits"] for r in rows.values())
        assert result["stages"][stages]["best_baseline"] == "packing_free"
    # two stages send activations between them: the bubble is no longer zero
    assert result["stages"]["1"]["methods"]["dynamic"]["bubble"] == 0 < result["stages"]["2"]["methods"]["dynamic"]["bubble"]
