"""``--zero 1`` against ``--zero 0`` through real gloo processes: 2 stages x 2 replicas (4 ranks) of GPT-2 (its token
table tied between the first and the last stage), started directly by ``dynabatch train``.

The planner must plan both runs alike, so the plans may not depend on measured times: ``--calibrate off`` (the
analytic cost model only) and dropout 0; memory does not bind at the default ``--memory-gib`` (so the larger
activation budget ``--zero 1`` leaves changes no plan). The replicas of a stage run different numbers of micro-batches
(asserted), which the step-boundary collectives of ``--zero 1`` allow. ``--max-grad-norm 0.05`` keeps global-norm clipping active at every step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from dynabatch.runtime.checkpoint import step_dir

STEPS, SAVE_AT = 4, 2
COMMON = ["--model", "gpt2-tiny", "--tokenizer", "byt5", "--stages", "2", "--replicas", "2",
          "--global-batch-tokens", "4096", "--max-input-len", "128", "--max-target-len", "32",
          "--logging-steps", "0", "--no-timeline", "--task-loss-every", "0", "--calibrate", "off",
          "--planner", "thread", "--timeout-s", "60", "--max-grad-norm", "0.05"]


def _train(out, toy_mixture_dir, *extra: str, ok: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "dynabatch", "train", *COMMON, "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
           "--output-dir", str(out), *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    text = run.stdout + run.stderr
    assert (run.returncode == 0) == ok, text[-3000:]
    return text


def _records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def _checkpoint_tensors(out) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state of the newest checkpoint (RNG states left out), by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    from dynabatch.runtime.checkpoint import latest_checkpoint

    folder = latest_checkpoint(os.path.join(out, "checkpoints")).path
    meta = HuggingFaceStorageReader(folder).read_metadata().state_dict_metadata
    targets = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if not k.startswith("rng/")}
    dcp.load(targets, storage_reader=HuggingFaceStorageReader(folder), no_dist=True)
    return targets


def _same_steps(got: list[dict], want: list[dict], rtol: float = 1e-5) -> None:
    assert [r["samples_digest"] for r in got] == [r["samples_digest"] for r in want]
    assert [r["micro_batch_shapes"] for r in got] == [r["micro_batch_shapes"] for r in want]
    assert [r["skipped"] for r in got] == [r["skipped"] for r in want]
    for key in ("loss", "grad_norm"):
        a, b = [r[key] for r in got], [r[key] for r in want]
        assert [math.isfinite(x) for x in a] == [math.isfinite(x) for x in b], (key, a, b)
        torch.testing.assert_close(torch.tensor([x for x in a if math.isfinite(x)], dtype=torch.float64),
                                   torch.tensor([x for x in b if math.isfinite(x)], dtype=torch.float64),
                                   rtol=rtol, atol=0)


def test_zero1_trains_like_zero0_with_unequal_micro_batch_counts(tmp_path, toy_mixture_dir):
    """Also the checkpoints: a ``--zero 1`` checkpoint of 2 replicas resumes on 1 replica under ``--zero 0``, and a
    ``--zero 0`` one on 2 replicas under ``--zero 1``, each continuing with the uninterrupted run's losses."""
    z0, z1 = tmp_path / "zero0", tmp_path / "zero1"
    _train(z0, toy_mixture_dir, "--max-steps", str(STEPS), "--save-steps", str(SAVE_AT), "--zero", "0")
    _train(z1, toy_mixture_dir, "--max-steps", str(STEPS), "--save-steps", str(SAVE_AT), "--zero", "1")
    got, want = _records(z1), _records(z0)
    assert [r["step"] for r in got] == list(range(STEPS))
    assert any(len({len(replica) for replica in r["micro_batch_shapes"]}) > 1 for r in got)  # unequal counts
    assert all(r["grad_norm"] > 0.05 for r in got)  # every step was clipped
    _same_steps(got, want)

    # final weights and AdamW moments (gathered to per-parameter tensors at save) equal zero 0's
    a, b = _checkpoint_tensors(z1), _checkpoint_tensors(z0)
    assert sorted(a) == sorted(b) and any(k.startswith("optim/exp_avg_sq/") for k in a)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)

    # measured model-state bytes per rank: weights 4N + gradients 4N + AdamW 8N / R (R = 2) against 16N
    for r1, r0 in zip(got, want):
        assert len(r1["model_state_bytes"]) == 4
        for m1, m0 in zip(r1["model_state_bytes"], r0["model_state_bytes"]):
            assert m1 / m0 == pytest.approx((4 + 4 + 8 / 2) / 16, rel=0.01)
        for r, zero in ((r1, 1), (r0, 0)):  # and equal what the planner priced per stage (rank = replica x 2 + stage)
            for rank, measured in enumerate(r["model_state_bytes"]):
                assert measured == pytest.approx(r["model_state_bytes_predicted"][rank % 2], rel=0.05), (zero, rank)

    # resumes across --zero and replica counts: the same samples and (1e-5) losses as the uninterrupted runs
    for source, reference, extra in ((z1, z1, ("--replicas", "1", "--zero", "0")), (z0, z0, ("--zero", "1"))):
        resumed = tmp_path / f"resumed-from-{source.name}"
        checkpoint = step_dir(os.path.join(source, "checkpoints"), SAVE_AT)
        _train(resumed, toy_mixture_dir, "--max-steps", str(STEPS), "--resume-from-checkpoint", checkpoint, *extra)
        got, want = _records(resumed), _records(reference)[SAVE_AT:]
        assert [r["step"] for r in got] == list(range(SAVE_AT, STEPS))
        assert [r["samples_digest"] for r in got] == [r["samples_digest"] for r in want]
        torch.testing.assert_close(torch.tensor([r["loss"] for r in got], dtype=torch.float64),
                                   torch.tensor([r["loss"] for r in want], dtype=torch.float64), rtol=1e-5, atol=0)


def test_zero1_fp16_loss_scaling_and_non_finite_skip_match_zero0(tmp_path, toy_mixture_dir):
    """fp16 autocast with loss scaling (unscaled together with the clipping on the shard), then a learning rate that
    diverges: the same steps are skipped on every rank, as under ``--zero 0``.

    Under fp16 the runs agree less tightly than in fp32: the gradient norm of ``--zero 1`` sums squares over shards
    (float64), not per-tensor float32 norms, so the clipping factor differs in its last bits (about 1e-7 relative);
    the fp32 weights then differ by an ulp, and a few of them round to other fp16 values in the next forward."""
    for z in ("0", "1"):
        _train(tmp_path / f"fp16-{z}", toy_mixture_dir, "--max-steps", "3", "--dtype", "fp16", "--zero", z)
        _train(tmp_path / f"diverge-{z}", toy_mixture_dir, "--max-steps", "6", "--learning-rate", "1e6",
               "--max-bad-steps", "2", "--save-steps", "0", "--zero", z, ok=False)
    got, want = _records(tmp_path / "fp16-1"), _records(tmp_path / "fp16-0")
    assert [r["loss_scale"] for r in got] == [r["loss_scale"] for r in want] == [2.0**16] * 3
    _same_steps(got, want, rtol=1e-4)
    a, b = _checkpoint_tensors(tmp_path / "fp16-1"), _checkpoint_tensors(tmp_path / "fp16-0")
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-4, msg=name)

    got, want = _records(tmp_path / "diverge-1"), _records(tmp_path / "diverge-0")
    assert any(r["skipped"] for r in got) and not got[0]["skipped"]
    _same_steps(got, want)

