"""Experiment trackers of a training run (``--report-to tensorboard,wandb``, ``all`` or ``none``).

Rank 0 alone opens the trackers (:func:`open_trackers`) and sends them flat ``name -> float`` metrics
with a step (:meth:`Trackers.log`): each training step's record as :func:`step_scalars` names it
(HF's ``train/loss``, ``train/learning_rate``, ``train/grad_norm``, plus tokens/s, padding efficiency,
the predicted bubble, measured and predicted step time, per-task losses and memory), and evaluation's
``eval/...`` metrics as they arrive.

* **TensorBoard** (``torch.utils.tensorboard``): event files in ``OUTPUT/runs/`` (HF's logging folder),
  so ``tensorboard --logdir OUTPUT`` shows the run, and a ``--compare-method`` run (its own
  ``OUTPUT/compare-<method>/runs/``) as a second curve. A resumed run appends a new event file to the
  same folder with ``purge_step`` = its checkpoint's step: TensorBoard drops the earlier run's events
  from that step on, so every step shows once.
* **Weights & Biases**, if ``wandb`` is installed: one run in ``OUTPUT/wandb/``, offline unless
  ``WANDB_MODE`` says otherwise (``wandb sync`` uploads it later), project ``WANDB_PROJECT`` or
  ``dynabatch``. ``all`` means every tracker whose package is installed (HF's convention).

:func:`check_trackers` refuses, in one line, a tracker whose package is missing; it runs before any
data is loaded. :meth:`Trackers.close` flushes and closes every tracker, at the end and on error.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dynabatch.training.config.sections import TRACKERS

TENSORBOARD_DIR = "runs"
"""TensorBoard's folder inside the output folder (HF's ``logging_dir``)."""

_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each tracker needs (``torch.utils.tensorboard`` writes through ``tensorboard``)."""

_STEP_SCALARS = {
    "loss": "train/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "padding_efficiency": "train/padding_efficiency",
    "bubble_fraction_predicted": "train/bubble_fraction_predicted",
    "step_time_s": "train/step_time_s",
    "predicted_step_s": "train/predicted_step_s",
    "prediction_error": "train/prediction_error",
    "plan_wait_s": "train/plan_wait_s",
    "plan_overlap": "train/plan_overlap",
    "num_micro_batches": "train/num_micro_batches",
    "efficiency_balanced": "train/efficiency_balanced",
    "efficiency_amortised": "train/efficiency_amortised",
}
"""Step-record field -> tracker name (the record fields of :func:`dynabatch.training.trainer._record`)."""

_MIB = 2**20


def _installed(name: str) -> bool:
    return importlib.util.find_spec(_PACKAGES[name]) is not None


def check_trackers(report_to: str) -> tuple[str, ...]:
    """The trackers ``report_to`` names (comma-separated; ``all``: every installed one;
    ``none``: none). ``ValueError`` in one line when a named tracker's package is not installed."""
    names = [t.strip() for t in report_to.split(",") if t.strip() and t.strip() != "none"]
    if "all" in names:
        return tuple(t for t in TRACKERS if _installed(t))
    for name in names:
        if not _installed(name):
            raise ValueError(f"--report-to {name}: the {_PACKAGES[name]!r} package is not installed; "
                             f"`pip install {_PACKAGES[name]}`, or drop {name} from --report-to")
    return tuple(dict.fromkeys(names))


class _TensorBoard:
    """Scalars into ``OUTPUT/runs/``; ``purge_step`` hides the earlier run's events from a resumed run's start."""

    def __init__(self, output_dir: str, config: dict[str, Any], start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(output_dir, TENSORBOARD_DIR), purge_step=start_step or None)
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=1)}\n```", global_step=start_step)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()  # flushes


class _Wandb:
    """One W&B run (``wandb.init`` writes it into ``OUTPUT/wandb/``), offline unless ``WANDB_MODE`` is set."""

    def __init__(self, output_dir: str, config: dict[str, Any], start_step: int):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dynabatch"), dir=output_dir, config=config,
                              mode=os.environ.get("WANDB_MODE", "offline"),
                              name=f"{os.path.basename(os.path.abspath(output_dir))}-from-{start_step}")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


_OPEN = {"tensorboard": _TensorBoard, "wandb": _Wandb}


@dataclass
class Trackers:
    """The open trackers of this rank (none but on rank 0): :meth:`log` sends metrics to each of them."""

    open: list = field(default_factory=list)

    def log(self, metrics: Mapping[str, float | None], step: int) -> None:
        """Log flat ``name -> number`` ``metrics`` (``eval/loss``, ``eval/<task>/exact_match``, ...) at ``step``;
        ``None`` values are left out."""
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        if values:
            for tracker in self.open:
                tracker.log(values, step)

    def close(self) -> None:
        """Flush and close every tracker (once; later calls do nothing)."""
        opened, self.open = self.open, []
        for tracker in opened:
            tracker.close()


def open_trackers(report_to: str, output_dir: str, config: dict[str, Any], start_step: int = 0) -> Trackers:
    """Open the trackers ``report_to`` names (:func:`check_trackers`) for a run writing into ``output_dir``
    that starts (or resumes) at ``start_step``; rank 0 calls it, every other rank uses ``Trackers()``."""
    trackers = Trackers()
    try:
        for name in check_trackers(report_to):
            trackers.open.append(_OPEN[name](output_dir, config, start_step))
    except BaseException:
        trackers.close()
        raise
    return trackers


def step_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A training step's record as tracker metrics: :data:`_STEP_SCALARS`, per-task losses
    (``train/<task>/loss``), saved-activation memory per stage measured and predicted
    (``memory/stage_<s>_measured_mib``, ``..._predicted_mib``) and the peak RSS (``memory/peak_rss_mib``).

    On virtual stages the measured peaks are per device and the predicted ones per chunk (more of them): the
    predictions are then ``memory/chunk_<c>_predicted_mib``, so that no device's peak sits beside a chunk's."""
    out = {name: float(record[key]) for key, name in _STEP_SCALARS.items() if record.get(key) is not None}
    for task, loss in (record.get("task_loss") or {}).items():
        out[f"train/{task}/loss"] = float(loss)
    measured = record.get("memory_measured_bytes") or ()
    predicted = record.get("memory_predicted_bytes") or ()
    chunks = bool(measured) and len(predicted) > len(measured)
    for kind, values in (("measured", measured), ("predicted", predicted)):
        unit = "chunk" if kind == "predicted" and chunks else "stage"
        for s, value in enumerate(values):
            if value is not None:
                out[f"memory/{unit}_{s}_{kind}_mib"] = value / _MIB
    if record.get("peak_rss_bytes") is not None:
        out["memory/peak_rss_mib"] = record["peak_rss_bytes"] / _MIB
    return out
