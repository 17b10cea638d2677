"""`dynabatch train`: resume after a kill matches an uninterrupted run; plan-ahead equals synchronous."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dynabatch.training.config import TrainConfig


def _flags(tmp_path, toy_mixture_dir, out: str, *extra: str) -> list[str]:
    return ["train", "--model", "t5-tiny", "--tokenizer", "byt5", "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
            "--global-batch-tokens", "1024", "--max-input-len", "128", "--max-target-len", "32",
            "--output-dir", str(tmp_path / out), "--log-every", "0", "--no-timeline", "--lr", "3e-3", *extra]


def _train(tmp_path, toy_mixture_dir, out: str, *extra: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """``dynabatch train`` in a subprocess: for a run that must be killed (``DYNABATCH_CRASH_AT``)."""
    env = {**os.environ, **(env_extra or {})}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "dynabatch", *_flags(tmp_path, toy_mixture_dir, out, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def _train_in_process(capsys, tmp_path, toy_mixture_dir, out: str, *extra: str) -> tuple[int, str]:
    """``dynabatch train`` in this process (a world of one; no subprocess imports): (exit code, standard error)."""
    from dynabatch.cli import main

    code = main(_flags(tmp_path, toy_mixture_dir, out, *extra))
    return code, capsys.readouterr().err


def _records(tmp_path, out: str) -> list[dict]:
    with open(tmp_path / out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_kill_and_resume_matches_uninterrupted(tmp_path, toy_mixture_dir, capsys):
    # Bit-equal losses need equal plans in both runs; with online calibration plans follow each run's own
    # measured times, so this comparison plans with the base model (test_calibration_run covers the fit's resume).
    # Only the killed run needs its own process; the uninterrupted and the resumed run train in this one.
    code, err = _train_in_process(capsys, tmp_path, toy_mixture_dir, "full", "--steps", "6", "--calibrate", "off")
    assert code == 0, err[-2000:]
    crashed = _train(tmp_path, toy_mixture_dir, "crash", "--steps", "6", "--checkpoint-every", "3", "--calibrate", "off",
                     env_extra={"DYNABATCH_CRASH_AT": "4"})
    assert crashed.returncode != 0
    assert [r["step"] for r in _records(tmp_path, "crash")] == [0, 1, 2, 3]
    code, err = _train_in_process(capsys, tmp_path, toy_mixture_dir, "crash", "--steps", "6", "--checkpoint-every", "3",
                                  "--resume", "--calibrate", "off")
    assert code == 0, err[-2000:]
    a = {r["step"]: r for r in _records(tmp_path, "full")}
    b = {r["step"]: r for r in _records(tmp_path, "crash")}  # steps 0-3, then 3-5 again after resume
    for step in (3, 4, 5):
        assert b[step]["samples_digest"] == a[step]["samples_digest"]
        np.testing.assert_allclose(b[step]["loss"], a[step]["loss"], rtol=1e-6)
    assert a[5]["loss"] < a[0]["loss"]


def test_resume_without_checkpoint_warns_and_starts_fresh(tmp_path, toy_mixture_dir, capsys):
    code, err = _train_in_process(capsys, tmp_path, toy_mixture_dir, "fresh", "--steps", "1", "--resume")
    assert code == 0, err[-2000:]
    assert "no complete checkpoint" in err


def test_world_size_mismatch_is_a_clear_error(tmp_path, monkeypatch):
    """``train(cfg)`` from Python in one process cannot run 2 stages (the ``dynabatch train`` command launches its own
    ranks instead: tests/dist/test_faults.py)."""
    from dynabatch.training.trainer import train

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="need 2 processes: launch with `torchrun --nproc-per-node 2"):
        train(TrainConfig.of(model="gpt2-tiny", stages=2, steps=1, output_dir=str(tmp_path / "bad")))
    assert not (tmp_path / "bad").exists()


def test_config_validation():
    with pytest.raises(ValueError, match="method must be one of"):
        TrainConfig(method="magic")
    with pytest.raises(ValueError, match="cannot hold one maximal sample"):
        TrainConfig(global_batch_tokens=100)


def test_plan_ahead_delivers_the_synchronous_plans(toy_data):
    from dynabatch.cost.analytic import AnalyticCostModel
    from dynabatch.cost.hardware import hardware_spec
    from dynabatch.models.families import analytic_spec as spec_from_hf_config
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.models.presets import build_config
    from dynabatch.models.split import layout_for
    from dynabatch.models.presets import build_model
    from dynabatch.training.plan_ahead import PlanAhead
    from dynabatch.training.planner import StepPlanner

    preset = "t5-tiny" if toy_data.family == "seq2seq" else "gpt2-tiny"
    cfg = TrainConfig(model=preset, stages=2, global_batch_tokens=1024, max_input_len=128, max_target_len=32)
    model = build_model(preset, vocab_size=toy_data.tokens.vocab_size)
    layout = layout_for(model, 2)
    cost = StageCostModel(AnalyticCostModel(spec_from_hf_config(build_config(preset)), hardware_spec("cpu")), layout, 4 * 2**30)
    limits = LengthLimits(toy_data.family, max_input_len=128, max_target_len=32, max_seq_len=128)

    def planner():
        return StepPlanner(GlobalBatcher(toy_data, limits, token_budget=1024), cfg, cost, toy_data.tokens)

    sync = planner()
    expected = [sync() for _ in range(5)]
    ahead = PlanAhead(planner(), 5, depth=2)
    got = [ahead.get()[0] for _ in range(5)]
    ahead.close()
    for e, g in zip(expected, got):
        assert e.step == g.step and e.shapes == g.shapes
        assert [s.row_index for s in e.batch.samples] == [s.row_index for s in g.batch.samples]
        for mbs_e, mbs_g in zip(e.replica_micro_batches, g.replica_micro_batches):
            assert [m.sample_ids for m in mbs_e] == [m.sample_ids for m in mbs_g]


def test_export_to_hugging_face(tmp_path, toy_mixture_dir, capsys):
    import torch
    from transformers import T5ForConditionalGeneration

    from dynabatch.models.presets import build_model
    from dynabatch.engine.checkpoint import latest_checkpoint
    from dynabatch.training.export import export_checkpoint
    from dynabatch.training.reshard import model_weights

    code, err = _train_in_process(capsys, tmp_path, toy_mixture_dir, "exp", "--steps", "2")
    assert code == 0, err[-2000:]
    hf_dir = export_checkpoint(str(tmp_path / "exp" / "checkpoints"), str(tmp_path / "hf"))
    model = T5ForConditionalGeneration.from_pretrained(hf_dir)
    saved = model_weights(latest_checkpoint(str(tmp_path / "exp" / "checkpoints")).path)
    fresh = build_model("t5-tiny", vocab_size=model.config.vocab_size, seed=0)
    params = dict(model.named_parameters())
    changed = 0
    for name, p in fresh.named_parameters():
        trained = params[name]
        changed += not torch.equal(trained, p)
    assert changed > 0  # training moved the weights
    assert all(torch.equal(params[name], w) for name, w in saved.items()) and set(saved) == set(params)


def test_task_losses_average_to_the_step_loss(tmp_path, toy_mixture_dir, capsys):
    code, err = _train_in_process(capsys, tmp_path, toy_mixture_dir, "tasks", "--steps", "2", "--task-loss-every", "1")
    assert code == 0, err[-2000:]
    for r in _records(tmp_path, "tasks"):
        assert set(r["task_loss"]) <= {"short", "classify", "summarize"} and len(r["task_loss"]) >= 2
        losses = list(r["task_loss"].values())
        assert min(losses) <= r["loss"] <= max(losses)  # the step loss is a token-weighted mean of them


def test_the_printed_step_line_is_rounded_and_metrics_jsonl_keeps_full_values(tmp_path, toy_mixture_dir, capsys):
    """``--logging-steps`` prints a short JSON line a reader can scan (it printed ``"plan_wait_s":
    1.7875994672067463e-05``); the record in ``metrics.jsonl`` is unchanged."""
    code, err = _train_in_process(capsys, tmp_path, toy_mixture_dir, "line", "--steps", "1", "--log-every", "1")
    assert code == 0, err[-2000:]
    shown = json.loads(next(line for line in err.splitlines() if line.startswith('{"step": 0')))
    record = _records(tmp_path, "line")[0]
    assert set(shown) == {"step", "loss", "tokens_per_s", "padding_efficiency", "num_micro_batches", "step_time_s",
                          "predicted_step_s", "plan_wait_s"}
    for key, value in shown.items():
        if isinstance(value, float):
            assert len(f"{value:e}".split("e")[0].rstrip("0").replace(".", "").lstrip("-")) <= 4, (key, value)
            assert value == pytest.approx(record[key], rel=1e-3), key
    assert shown["tokens_per_s"] == round(record["tokens_per_s"]) and shown["step"] == record["step"]
