"""Experiment tracking (``--report-to``): TensorBoard event files read back with TensorBoard's own reader,
resume without doubled steps, a compare run in its own folder, and the one-line refusals."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil

import pytest

from dynabatch.cli import main
from dynabatch.training.tracking import check_trackers, open_trackers, step_scalars

BASE = ["--model", "t5-tiny", "--tokenizer", "byt5", "--global-batch-tokens", "1024", "--max-input-len", "128",
        "--max-target-len", "32", "--logging-steps", "0", "--no-timeline", "--calibrate", "off"]


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files in ``log_dir``, as TensorBoard shows it: (step, value) pairs."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train(toy_mixture_dir, out, *extra: str) -> int:
    return main(["train", *BASE, "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--output-dir", str(out),
                 *extra])


def test_tensorboard_scalars_every_step_resume_appends_and_compare_has_its_own(tmp_path, toy_mixture_dir, capsys):
    out = tmp_path / "run"
    assert _train(toy_mixture_dir, out, "--report-to", "tensorboard", "--max-steps", "3", "--save-steps", "2",
                  "--compare-method", "packing",  # the DP's plans: their padding differs from packing's (asserted)
                  "--plan-candidates", "off") == 0, capsys.readouterr().err[-3000:]
    scalars = _scalars(out / "runs")
    records = _records(out)
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert [v for _, v in scalars["train/tokens_per_s"]] == pytest.approx([r["tokens_per_s"] for r in records],
                                                                          rel=1e-6)
    for tag in ("train/learning_rate", "train/grad_norm", "train/padding_efficiency", "train/bubble_fraction_predicted",
                "train/step_time_s", "train/predicted_step_s", "train/efficiency_balanced",
                "train/efficiency_amortised", "memory/stage_0_measured_mib",
                "memory/stage_0_predicted_mib", "memory/peak_rss_mib"):
        assert [s for s, _ in scalars[tag]] == [0, 1, 2], tag
    assert {t for t in scalars if t.endswith("/loss")} > {"train/loss"}  # per-task losses at the last step
    for r in records:  # measured against the balanced ideal (dynabatch.plan.ideal); one device
        assert 0 < r["efficiency_balanced"] <= 1.05 and 0 < r["efficiency_amortised"] <= 1.05
        assert len(r["device_busy_fraction"]) == 1 and 0 < r["device_busy_fraction"][0] <= 1.05
    assert [v for _, v in scalars["train/efficiency_balanced"]] == pytest.approx(
        [r["efficiency_balanced"] for r in records], rel=1e-6)
    assert "efficiency balanced" in capsys.readouterr().err  # format_summary's line (logged)
    compare = _scalars(out / "compare-packing" / "runs")  # the compare run's own events, same steps
    assert [s for s, _ in compare["train/loss"]] == [0, 1, 2]
    assert compare["train/padding_efficiency"] != scalars["train/padding_efficiency"]

    # A crash after step 2 was logged, before its checkpoint: resume from step 2 and train to step 4.
    shutil.rmtree(out / "checkpoints" / "step-000003")
    assert _train(toy_mixture_dir, out, "--report-to", "tensorboard", "--max-steps", "4",
                  "--resume-from-checkpoint") == 0, capsys.readouterr().err[-3000:]
    assert len(glob.glob(str(out / "runs" / "events.out.tfevents.*"))) == 2  # appended, not replaced
    resumed = _scalars(out / "runs")
    records = _records(out)
    assert [s for s, _ in resumed["train/loss"]] == [0, 1, 2, 3]  # the earlier run's step 2 is purged
    assert [v for _, v in resumed["train/loss"]] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_eval_metrics_go_through_log(tmp_path):
    trackers = open_trackers("tensorboard", str(tmp_path), {"model": "t5-tiny"})
    trackers.log({"eval/loss": 2.5, "eval/short/exact_match": 0.25, "eval/short/rouge_l": None}, step=10)
    trackers.log({"eval/loss": 2.0, "eval/short/exact_match": 0.5}, step=20)
    trackers.close()
    trackers.close()  # a second close (the finally after an explicit close) does nothing
    scalars = _scalars(tmp_path / "runs")
    assert scalars["eval/loss"] == [(10, 2.5), (20, 2.0)]
    assert scalars["eval/short/exact_match"] == [(10, 0.25), (20, 0.5)]
    assert "eval/short/rouge_l" not in scalars


def test_virtual_stage_memory_is_not_labelled_as_a_device_stage():
    """Interleaved/cyclic runs: measured peaks per device (2), predicted per chunk (4). A chunk's prediction must not
    be logged as ``stage_<s>_predicted`` beside device s's measured peak (chunk 1 is half of device 1)."""
    mib = 1024 * 1024
    virtual = step_scalars({"memory_measured_bytes": [1 * mib, 17 * mib],
                            "memory_predicted_bytes": [0.25 * mib, 0.25 * mib, 0.5 * mib, 16.5 * mib]})
    assert virtual["memory/stage_1_measured_mib"] == 17
    assert [virtual[f"memory/chunk_{c}_predicted_mib"] for c in range(4)] == [0.25, 0.25, 0.5, 16.5]
    assert not any(k.startswith("memory/stage_") and k.endswith("_predicted_mib") for k in virtual)
    linear = step_scalars({"memory_measured_bytes": [mib, 2 * mib], "memory_predicted_bytes": [mib, 3 * mib]})
    assert linear["memory/stage_1_predicted_mib"] == 3 and linear["memory/stage_1_measured_mib"] == 2


def test_report_to_none_and_all(tmp_path):
    assert check_trackers("none") == ()
    assert check_trackers("tensorboard, tensorboard") == ("tensorboard",)
    installed = ("tensorboard",) + (("wandb",) if importlib.util.find_spec("wandb") else ())
    assert check_trackers("all") == installed
    assert open_trackers("none", str(tmp_path), {}).open == []
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_report_to_wandb_without_wandb_is_one_line_before_any_data(tmp_path, capsys):
    code = main(["train", *BASE, "--mixture", str(tmp_path / "not-loaded.yaml"), "--output-dir", str(tmp_path / "o"),
                 "--report-to", "tensorboard,wandb"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert lines == ["dynabatch train: error: --report-to wandb: the 'wandb' package is not installed; "
                     "`pip install wandb`, or drop wandb from --report-to"]
    assert not os.path.exists(tmp_path / "o" / "runs")


def test_unknown_tracker_is_refused(tmp_path, capsys):
    code = main(["train", *BASE, "--output-dir", str(tmp_path / "o"), "--report-to", "tensorboard,mlflow"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == ("dynabatch train: error: report_to: unknown tracker 'mlflow'; valid: tensorboard, wandb, "
                           "all, none")
