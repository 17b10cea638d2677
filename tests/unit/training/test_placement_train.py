"""`dynabatch train --placement cyclic` under torchrun: T5 chunks on 2 devices train, checkpoint and resume.

Device 0 holds encoder chunk 0 and decoder chunk 0, so the token table has two copies on one rank: the checkpoint
stores it once (by its global name) and a resume fills both copies. The run is uninterrupted for 4 steps (saving at
step 2); a second run starts from that step-2 checkpoint and must log the uninterrupted run's losses for steps 3-4
(the same plans: the calibration's observations are in the checkpoint, so the resumed planner fits exactly as
the uninterrupted one; ``--calibrate auto`` is ``quick``, one fit per chunk). Equality of the
gradients with the unsplit model is tests/dist/test_virtual_stages.py's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

COMMON = ["--model", "t5-tiny", "--tokenizer", "byt5", "--stages", "2", "--placement", "cyclic",
          "--global-batch-tokens", "1024", "--max-input-len", "128", "--log-every", "0", "--lr", "3e-3",
          "--save-steps", "2", "--eval-steps", "4", "--eval-samples", "2"]


def _train(out: str, mixture: str, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dynabatch",
           "train", *COMMON, "--mixture", mixture, "--eval-mixture", mixture, "--output-dir", out, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_cyclic_t5_trains_checkpoints_and_resumes_like_uninterrupted(tmp_path, toy_mixture_dir):
    mixture = os.path.join(toy_mixture_dir, "toy.json")
    full = str(tmp_path / "full")
    done = _train(full, mixture, "--max-steps", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(full)
    train = [r for r in rows if r.get("kind") != "eval"]
    assert [r["step"] for r in train] == [0, 1, 2, 3]
    assert any(r.get("kind") == "eval" for r in rows)  # forward-only plans run on the virtual stages too
    assert all(len(r["memory_measured_bytes"]) == 2 for r in train)  # per device
    assert all(len(r["device_busy_fraction"]) == 2 for r in train)  # per device, 2 chunks each
    assert all(0 < r["efficiency_balanced"] <= 1.05 for r in train)
    # each step's order on the virtual stages, one per replica
    from dynabatch.schedule.virtual import PLACED_POLICIES

    assert all(len(r["schedule_policy"]) == 1 and r["schedule_policy"][0] in set(PLACED_POLICIES) - {"auto"}
               for r in train)
    assert os.path.exists(os.path.join(full, "timeline.png"))  # measured next to the placement's simulated twin
    # --calibrate auto = quick: the start-up round and every step fit one set of coefficients per chunk
    assert all(r["calibration"].startswith("online as of step") for r in train)
    with open(os.path.join(full, "calibration.json")) as f:
        coefficients = json.load(f)["coefficients"]
    assert len(coefficients) == 4 and len(coefficients[0]) == 2  # 4 chunks x (forward, backward)
    assert any(c[d][0] != 1.0 for c in coefficients for d in range(2))  # moved off the warm start (base model)

    resumed = str(tmp_path / "resumed")
    os.makedirs(os.path.join(resumed, "checkpoints"))
    shutil.copytree(os.path.join(full, "checkpoints", "step-000002"), os.path.join(resumed, "checkpoints", "step-000002"))
    done = _train(resumed, mixture, "--max-steps", "4", "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    again = [r for r in _rows(resumed) if r.get("kind") != "eval"]
    assert [r["step"] for r in again] == [2, 3]
    assert [r["loss"] for r in again] == pytest.approx([r["loss"] for r in train[2:]], rel=1e-6)


def test_placement_flag_errors_are_one_line():
    from dynabatch.training.config import TrainConfig

    with pytest.raises(ValueError, match="interleaved:V needs a chunk count"):
        TrainConfig.of(placement="interleaved:x", stages=2)
    assert TrainConfig.of(model="gpt2-mini", placement="interleaved:2", stages=2, slice_long=True).slice_long
    assert TrainConfig.of(placement="cyclic", stages=2).calibration_mode == "quick"  # one fit per chunk
