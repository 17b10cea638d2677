"""scripts/bench_slicing.py runs both parts end to end (small settings) and reports every figure."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "bench_slicing.py")


@pytest.mark.slow  # the script's parts run fast elsewhere: test_bench.py's dynamic_sliced run, test_simulate_slicing.py
def test_bench_slicing_small_run_reports_both_parts():
    cmd = [sys.executable, SCRIPT, "--sim-batches", "1", "--sim-max-lens", "4096,8192", "--sim-batch-tokens", "16384",
           "--sim-hardware", "a100-80gb", "--cpu-model", "gpt2-tiny", "--cpu-max-len", "1024",
           "--cpu-batch-tokens", "3072", "--cpu-steps", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    sim = {row["max_len"]: row for row in result["simulated"]}
    assert sim[8192]["step_s_whole"] is None and sim[8192]["sliced_samples_per_batch"] > 0  # only fits sliced
    assert sim[4096]["step_s_sliced"] > 0 and sim[4096]["peak_gib_sliced"] <= 80
    measured = result["measured"]
    for key in ("step_s_whole", "step_s_sliced", "peak_mib_whole", "peak_mib_sliced"):
        assert measured[key] > 0, key
    assert "does not fit" in out.stdout
