"""A diverging 2-stage run under torchrun (gloo): every rank skips the same non-finite steps, the run stops
after ``--max-bad-steps`` with one clear line and a non-zero exit, and the newest checkpoint is finite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


@pytest.mark.parametrize("model", [pytest.param("t5-tiny", marks=pytest.mark.slow), "gpt2-tiny"])
# t5-tiny is slow-only: the guard is the same for every family, and gpt2-tiny runs it across two ranks
def test_two_stage_divergence_stops_every_rank(tmp_path, toy_mixture_dir, model):
    from dynabatch.engine.checkpoint import latest_checkpoint
    from dynabatch.training.reshard import model_weights

    out = tmp_path / "div"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dynabatch",
           "train", "--model", model, "--stages", "2", "--tokenizer", "byt5", "--global-batch-tokens", "1024",
           "--max-input-len", "128", "--max-target-len", "32", "--log-every", "0", "--no-timeline",
           "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--output-dir", str(out), "--steps", "12",
           "--lr", "1e6", "--checkpoint-every", "1", "--max-bad-steps", "2", "--timeout-s", "30"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    text = run.stdout + run.stderr
    assert run.returncode != 0, text[-3000:]
    assert text.count("training diverged") >= 2, text[-3000:]  # both ranks stop, each with its own line
    with open(out / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    last = records[-1]["step"]
    assert last < 11 and records[-1]["skipped"] and records[-2]["skipped"]
    assert f"up to step {last}" in text
    info = latest_checkpoint(str(out / "checkpoints"))
    assert info is not None and info.step <= last + 1
    weights = model_weights(info.path)  # both stages' parameters
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
