"""Online calibration in real runs (torchrun, gloo, 2 stages; one process where the pipeline does not matter):
the start-up calibration changes no weight, metrics carry predicted against measured, the calibration file
warm-starts a later run's fit, and a resumed run plans with the checkpointed fit exactly as the interrupted one did."""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest


def _flags(tmp_path, toy_mixture_dir, out: str, stages: int, *extra: str) -> list[str]:
    return ["train", "--model", "gpt2-tiny", "--tokenizer", "byt5", "--stages", str(stages),
            "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--global-batch-tokens", "1024",
            "--max-input-len", "128", "--max-target-len", "32", "--output-dir", str(tmp_path / out),
            "--log-every", "0", "--no-timeline", "--task-loss-every", "0", *extra]


def _train(tmp_path, toy_mixture_dir, out: str, *extra: str, env_extra: dict | None = None,
           stages: int = 2) -> subprocess.CompletedProcess:
    """``dynabatch train`` on gpt2-tiny: ``stages`` 2 under torchrun, 1 as one plain process (a run to kill)."""
    env = {**os.environ, **(env_extra or {})}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
                if stages == 2 else [sys.executable])
    cmd = [*launcher, "-m", "dynabatch", *_flags(tmp_path, toy_mixture_dir, out, stages, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _train_in_process(capsys, tmp_path, toy_mixture_dir, out: str, *extra: str) -> None:
    """``dynabatch train`` on gpt2-tiny, one stage, in this process (no subprocess imports)."""
    from dynabatch.cli import main

    code = main(_flags(tmp_path, toy_mixture_dir, out, 1, *extra))
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_quick_calibration_changes_no_weight_and_metrics_compare_prediction(tmp_path, toy_mixture_dir, capsys):
    _train_in_process(capsys, tmp_path, toy_mixture_dir, "off", "--steps", "1", "--calibrate", "off")  # same loss
    quick = _train(tmp_path, toy_mixture_dir, "quick", "--steps", "4", "--calibrate", "quick")
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert "cost model: calibration quick; plans with the base costs" in quick.stderr + quick.stdout
    assert re.search(r"--plan-costs +base +decoder-only", quick.stderr + quick.stdout)  # auto, resolved (config.resolve)
    a, b = _records(tmp_path / "off" / "metrics.jsonl"), _records(tmp_path / "quick" / "metrics.jsonl")
    # the start-up passes ran forwards and backwards but no optimizer step: step 0 sees the initial weights
    np.testing.assert_allclose(b[0]["loss"], a[0]["loss"], rtol=1e-5)
    assert a[0]["calibration"] == "off" and b[0]["calibration"] == "online as of step -1"
    assert b[3]["calibration"] == "online as of step 0"  # plan_ahead 2: step 3 is planned with steps <= 0
    for r in b:
        assert len(r["stage_time_measured_s"]) == len(r["stage_time_predicted_s"]) == 2
        assert all(t > 0 for t in r["stage_time_measured_s"] + r["stage_time_predicted_s"])
        assert r["prediction_error"] == abs(r["predicted_step_s"] - r["step_time_s"]) / r["step_time_s"]
        assert len(r["device_busy_fraction"]) == 2 and all(0 < x <= 1.05 for x in r["device_busy_fraction"])
        assert 0 < r["efficiency_balanced"] <= 1.05  # scale-free: the analytic preset's optimism cancels
    assert b[-1]["prediction_error_median"] == float(np.median([r["prediction_error"] for r in b]))
    # the analytic preset alone is several times optimistic; the start-up round already corrects most of it
    assert np.median([r["prediction_error"] for r in b]) < np.median([r["prediction_error"] for r in a])
    saved = json.load(open(tmp_path / "quick" / "calibration.json"))
    assert saved["as_of_step"] == 3 and np.array(saved["coefficients"]).shape == (2, 2, 5)

    from dynabatch.cli import main

    assert main(["profile", "--check", str(tmp_path / "quick")]) == 0  # the run folder's prediction report
    report = capsys.readouterr().out.splitlines()
    assert len(report) == 2 + 4 + 1 and report[-1].startswith("4 steps (online as of step 0 at the last)")
    assert f"{np.median([r['prediction_error'] for r in b]):.1%}" in report[-1]
    assert main(["profile", "--check", str(tmp_path)]) == 2  # a folder without metrics: one clear line
    assert "pass a `dynabatch train` output folder" in capsys.readouterr().err

    # --calibration-file: build_run's run_calibration warm-starts the fit from the file (coefficients and overhead)
    from dynabatch.training.config import TrainConfig
    from dynabatch.cost.online import CalibratedStageCostModel
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.trainer import planner_cost_model, run_calibration

    cfg = TrainConfig(model="gpt2-tiny", stages=2, max_input_len=128, max_target_len=32, global_batch_tokens=1024,
                      calibrate="online", calibration_file=str(tmp_path / "quick" / "calibration.json"))
    model = build_model("gpt2-tiny", vocab_size=384)
    layout = layout_for(model, 2)
    base = planner_cost_model(cfg, model.config, layout)
    calibration, key = run_calibration(cfg, base, model.config.to_dict(), layout)
    assert key["layout"] == saved["key"]["layout"]
    warm = calibration.cost_model_for(0)
    assert isinstance(warm, CalibratedStageCostModel)
    np.testing.assert_allclose(warm.coefficients, saved["coefficients"])
    assert calibration.overhead_for(0) == saved["overhead_s"]

    from dynabatch.training.calibration import load_calibration

    key = dict(saved["key"], layout=[["embedding", "gpt", "gpt", "lm_head"]])  # the same model on one stage
    with pytest.raises(ValueError, match="another layout than this run; drop --calibration-file"):
        load_calibration(str(tmp_path / "quick" / "calibration.json"), key)


def test_resume_plans_with_the_checkpointed_fit(tmp_path, toy_mixture_dir, capsys):
    crashed = _train(tmp_path, toy_mixture_dir, "run", "--steps", "6", "--checkpoint-every", "3",
                     env_extra={"DYNABATCH_CRASH_AT": "4"}, stages=1)
    assert crashed.returncode != 0
    before = {r["step"]: r for r in _records(tmp_path / "run" / "metrics.jsonl")}
    assert sorted(before) == [0, 1, 2, 3]
    shutil.copy(tmp_path / "run" / "metrics.jsonl", tmp_path / "before.jsonl")
    _train_in_process(capsys, tmp_path, toy_mixture_dir, "run", "--steps", "6", "--checkpoint-every", "3", "--resume")
    after = {r["step"]: r for r in _records(tmp_path / "run" / "metrics.jsonl")}
    # step 3 is planned with the fit as of step 0, which the checkpoint after step 2 holds: the same plan and
    # the same prediction (which a fresh fit, or one fitted to the resumed run's own start, would not give)
    assert after[3]["micro_batch_shapes"] == before[3]["micro_batch_shapes"]
    assert after[3]["predicted_step_s"] == before[3]["predicted_step_s"]
    assert after[3]["calibration"] == before[3]["calibration"] == "online as of step 0"


def test_resume_whose_fit_cannot_be_restored_calibrates_at_start_again(tmp_path, toy_mixture_dir, capsys, monkeypatch):
    """A checkpoint without a fit this run can use (here: saved under --calibrate off; likewise another layout or
    device) leaves the resumed run a fresh fit: it gets the start-up calibration a fresh run gets, else its first
    steps are planned and predicted with no measurement at all (an interleaved -> linear resume predicted 0.013 s
    for 0.385 s steps). A restored fit is not recalibrated (test_resume_plans_with_the_checkpointed_fit)."""
    from dynabatch.training import trainer

    calls = []
    real = trainer.quick_calibration
    monkeypatch.setattr(trainer, "quick_calibration", lambda *a, **k: calls.append(a[4]) or real(*a, **k))
    _train_in_process(capsys, tmp_path, toy_mixture_dir, "run", "--steps", "1", "--calibrate", "off")
    assert calls == []
    _train_in_process(capsys, tmp_path, toy_mixture_dir, "run", "--steps", "2", "--resume")
    assert calls == [0]  # recorded as step -1 = as_of(1) with the default --plan-ahead 2: it plans step 1
    resumed = _records(tmp_path / "run" / "metrics.jsonl")[1]
    assert resumed["step"] == 1 and resumed["calibration"] == "online as of step -1"
