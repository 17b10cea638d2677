"""``--moving-boundaries`` in a real 2-rank run (gpt2-mini, the built-in mixture): micro-batches run the unit beside
the cut on either stage, the losses are the fixed split's (the same arithmetic, on another rank), and a checkpoint
of the stages with their held copies resumes. Per-unit equality with the whole model, gradients included:
``tests/unit/models/test_moving_boundaries.py``; the plan side: ``tests/unit/plan/test_boundary_choice.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

STEPS = 4


def _train(out: str, *extra: str) -> subprocess.CompletedProcess:
    """A directly launched 2-rank ``dynabatch train`` (:mod:`dynabatch.engine.launch` starts the ranks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "dynabatch", "train", "--model", "gpt2-mini", "--stages", "2",
           "--global-batch-tokens", "2048", "--max-input-len", "256", "--output-dir", out, "--logging-steps", "0",
           "--no-timeline", "--task-loss-every", "0", "--full-determinism", "--save-steps", "2", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _records(out: str) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def test_moving_boundaries_train_the_fixed_splits_losses_and_resume(tmp_path):
    fixed, moving = str(tmp_path / "fixed"), str(tmp_path / "moving")
    for out, extra in ((fixed, ()), (moving, ("--moving-boundaries",))):
        run = _train(out, "--max-steps", str(STEPS), *extra)
        assert run.returncode == 0, run.stderr[-3000:]
    a, b = _records(fixed), _records(moving)
    assert sorted(a) == sorted(b) == list(range(STEPS))
    assert all(r["boundary_moves"] == {} for r in a.values())
    moved = [sum(r["boundary_moves"].values()) for r in b.values()]
    assert sum(moved) > 0, moved  # the units beside the cut really ran on the other stage
    for step in range(STEPS):
        assert b[step]["samples_digest"] == a[step]["samples_digest"], step
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
    resumed = _train(moving, "--max-steps", str(STEPS + 1), "--moving-boundaries", "--resume-from-checkpoint")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(_records(moving)) == list(range(STEPS + 1))
