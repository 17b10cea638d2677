"""``--dtype`` and ``--device`` (issue 18, item 5), in-process: bf16 / fp16 autocast training on this CPU close to
fp32, the dtype in the metrics and the planner's memory model, and ``--device`` refusals as one line.

The 2-stage bf16 / fp16 pipelines over gloo are in ``tests/dist/test_dtype_pipeline.py``.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from dynabatch.cli import main
from dynabatch.engine.dist import resolve_device

TINY = dict(model="gpt2-tiny", tokenizer="byt5", global_batch_tokens=512, max_input_len=64, max_target_len=16,
            logging_steps=0, task_loss_every=0, timeline=False, calibrate="off")


def _records(folder: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _run(tmp_path, toy_mixture_dir, dtype: str, steps: int) -> list[dict]:
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.trainer import train

    cfg = TrainConfig(**TINY, mixture=os.path.join(toy_mixture_dir, "toy.json"), dtype=dtype, max_steps=steps,
                      output_dir=str(tmp_path / dtype))
    summary = train(cfg)
    assert summary["config"]["dtype"] == dtype
    return _records(cfg.output_dir)


def test_bf16_and_fp16_train_on_cpu_close_to_fp32(tmp_path, toy_mixture_dir):
    fp32 = _run(tmp_path, toy_mixture_dir, "fp32", 1)
    bf16 = _run(tmp_path, toy_mixture_dir, "bf16", 1)
    fp16 = _run(tmp_path, toy_mixture_dir, "fp16", 1)
    assert [r["dtype"] for r in fp32 + bf16 + fp16] == ["fp32", "bf16", "fp16"]
    assert bf16[0]["samples_digest"] == fp32[0]["samples_digest"] == fp16[0]["samples_digest"]
    for run in (bf16, fp16):
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and not r["skipped"] for r in run)
        assert run[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=5e-2) and run[0]["loss"] != fp32[0]["loss"]
    assert fp16[0]["loss_scale"] == 2.0**16 and "loss_scale" not in bf16[0]


def test_the_planner_prices_activations_in_the_compute_dtype():
    from dynabatch.training.config import TrainConfig
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.trainer import planner_cost_model

    model = build_model("gpt2-tiny", vocab_size=384)
    layout = layout_for(model, 1)
    params = sum(p.numel() for p in model.parameters())
    for dtype, nbytes in (("fp32", 4), ("bf16", 2), ("fp16", 2)):
        cost = planner_cost_model(TrainConfig(**TINY, dtype=dtype), model.config, layout)
        assert cost.model.spec.dtype_bytes == nbytes
        # fp32 weights, gradients and Adam's moments (16 bytes), plus autocast's half-precision weight copies
        per_param = cost.model_state_bytes[0] / params
        assert per_param == pytest.approx(16 if dtype == "fp32" else 18, rel=0.01)


def test_device_choices_and_cuda_without_cuda_are_one_line(tmp_path, capsys, monkeypatch):
    assert resolve_device("cpu") == ("gloo", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine: --device cpu still means gloo
    assert resolve_device("cpu") == ("gloo", torch.device("cpu"))
    monkeypatch.undo()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert resolve_device("auto") == ("gloo", torch.device("cpu"))
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"--device {device}: CUDA is not available on this machine"):
            resolve_device(device)
    for argv, message in [(["--device", "cuda"], "--device cuda: CUDA is not available on this machine"),
                          (["--device", "gpu"], "--device must be auto, cpu, cuda or cuda:N (N a device number), "
                                                "got 'gpu'")]:
        code = main(["train", "--model", "t5-tiny", "--tokenizer", "byt5", "--max-steps", "1", "--output-dir",
                     str(tmp_path / "run"), *argv])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, err[-2000:]
        lines = [line for line in err.splitlines() if "dynabatch train: error:" in line]
        assert len(lines) == 1 and message in lines[0], err[-2000:]


def test_a_resumed_fp16_run_goes_on_with_the_saved_loss_scale(tmp_path, toy_mixture_dir, monkeypatch):
    """The loss scale is in the checkpoint: with the scale starting at 2^8 and doubling after every good step, a
    run resumed from step 2 trains step 2 at the uninterrupted run's scale (2^10), not at a fresh 2^8."""
    import functools
    import shutil

    import dynabatch.engine.executor as executor
    from dynabatch.training.config import TrainConfig
    from dynabatch.engine.precision import LossScaler
    from dynabatch.training.trainer import train

    monkeypatch.setattr(executor, "LossScaler", functools.partial(LossScaler, scale=2.0**8, growth_interval=1))
    common = dict(TINY, mixture=os.path.join(toy_mixture_dir, "toy.json"), dtype="fp16", max_steps=3, save_steps=2)
    full = str(tmp_path / "full")
    train(TrainConfig(**common, output_dir=full))
    scales = [r["loss_scale"] for r in _records(full)]
    assert scales == [2.0**8, 2.0**9, 2.0**10]
    resumed = str(tmp_path / "resumed")
    shutil.copytree(os.path.join(full, "checkpoints", "step-000002"), os.path.join(resumed, "checkpoints", "step-000002"))
    train(TrainConfig(**common, output_dir=resumed, resume_from_checkpoint="latest"))
    assert [(r["step"], r["loss_scale"]) for r in _records(resumed)] == [(2, 2.0**10)]
