"""scripts/gpu_bench.py: its CPU smoke mode runs the whole path (profile, check, interleaved bench planned
with that profile) and ends with the JSON summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_gpu_bench_cpu_quick_smoke(tmp_path):
    out = str(tmp_path / "gb")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_bench.py"), "--device", "cpu", "--quick",
                           "--out", out], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["device"] == "cpu" and summary["stages"] == 1 and summary["planned_with"] == "profile"
    assert set(summary["tokens_per_s"]) == {"dynamic", "packing_free", "packing", "padding", "token_budget"}
    assert all(v > 0 for v in summary["tokens_per_s"].values())
    assert 0 <= summary["profile_check_time_median_rel_err"] < 10
    with open(os.path.join(out, "bench_main.json")) as f:
        result = json.load(f)
    assert result["config"]["cost_profile"] == os.path.join(out, "profile.json")  # dynamic planned with the profile
    assert result["best_baseline"] in ("packing_free", "packing", "padding", "token_budget")
    from dynabatch.cost.tables import CostTables

    tables = CostTables.load(os.path.join(out, "profile.json"))
    assert tables.meta["config"]["model_type"] == "t5"
    with open(os.path.join(out, "profile_check.json")) as f:
        assert json.load(f)["model"]["n"] >= 1
