"""``--full-determinism`` (issue 42, item 3) on 2 ranks (t5-tiny, 2 stages, few steps, a small mixture): two runs
of the same seed cut every step into the same micro-batches and give bitwise-equal losses, and a run whose rank 1 is
killed mid-way and then resumed gives the clean run's losses bitwise. Without the switch the plans follow each run's
measured times (t5's ``--plan-costs auto`` plans with the online fit), so the runs may cut steps differently."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import write_mixture

STEPS = 5


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> str:
    return write_mixture(tmp_path_factory.mktemp("determinism-mixture"), "det",
                         {"a": (80, 1, 20, 4), "b": (80, 2, 60, 12)})


def _train(mixture: str, out: str, *extra: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    """A directly launched 2-rank ``dynabatch train`` (:mod:`dynabatch.engine.launch` starts the ranks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DYNABATCH_CRASH_AT")}
    env["OMP_NUM_THREADS"] = "1"
    if crash_at:
        env["DYNABATCH_CRASH_AT"] = crash_at
    cmd = [sys.executable, "-m", "dynabatch", "train", "--model", "t5-tiny", "--tokenizer", "byt5", "--mixture", mixture,
           "--stages", "2", "--global-batch-tokens", "1024", "--max-input-len", "96", "--max-target-len", "24",
           "--max-steps", str(STEPS), "--output-dir", out, "--logging-steps", "0", "--no-timeline",
           "--task-loss-every", "0", "--learning-rate", "3e-3", "--full-determinism", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _records(out: str) -> dict[int, dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}  # a resumed step's record is its last


@pytest.mark.slow  # fast cover: test_resolve.py's two in-process --full-determinism runs (bitwise); kill and resume: test_soak.py, test_faults.py
def test_full_determinism_two_runs_and_a_killed_and_resumed_run_give_bitwise_equal_losses(tmp_path, mixture):
    clean, again = str(tmp_path / "clean"), str(tmp_path / "again")
    run = _train(mixture, clean)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "--full-determinism: plans from the base model" in run.stderr  # the resolver's table says why
    # a second run of the same seed, its rank 1 killed at the start of step 3 (after the step-2 checkpoint)
    killed = _train(mixture, again, "--save-steps", "2", crash_at="3:1")
    assert killed.returncode != 0
    partial = _records(again)
    assert sorted(partial) == [0, 1, 2]
    resumed = _train(mixture, again, "--save-steps", "2", "--resume-from-checkpoint")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _records(clean), _records(again)
    assert sorted(a) == sorted(b) == list(range(STEPS))
    for step in range(STEPS):
        # the same micro-batches (samples and cuts) and the same loss, bit for bit
        assert b[step]["samples_digest"] == a[step]["samples_digest"], step
        assert b[step]["num_micro_batches"] == a[step]["num_micro_batches"], step
        assert b[step]["loss"] == a[step]["loss"], (step, a[step]["loss"], b[step]["loss"])
    for step in range(3):  # before the kill: two runs of the same seed
        assert partial[step]["loss"] == a[step]["loss"]
    assert a[STEPS - 1]["loss"] < a[0]["loss"]
