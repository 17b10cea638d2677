"""Online calibration in a training run: measured stage times from every rank to rank 0's fit, the
planner's cost model as of a step, the start-up calibration and the calibration file.

The model and the fit are :mod:`dynabatch.cost.online`'s; this module moves measurements and keeps the
planner deterministic:

* :func:`gather_measurements` (collective, once per step) brings every rank's forward and backward
  durations (its :attr:`~dynabatch.engine.executor.StepResult.timeline`) and saved-activation peak to
  rank 0; :meth:`RunCalibration.record` turns replica by replica, stage by stage, each micro-batch's
  measured time and its planned features (:attr:`~dynabatch.training.planned_step.PlannedStep.features`) into
  observations, and the step's measured minus predicted makespan into the overhead term.
* :meth:`RunCalibration.cost_model_for` gives the planner thread the model as of step
  ``k - plan_ahead - 1``, waiting (rarely: the loop records step ``j`` before it asks for step ``j + 1``)
  until that step is recorded, so threaded planning stays deterministic.
* :func:`quick_calibration` (``--calibrate quick``): before step 0, every rank runs a few synthetic
  micro-batches spanning the run's lengths through the real pipeline -- forward and backward only; the
  reduce and the optimizer step are left out, so no weight, optimizer state or RNG stream changes --
  and the measurements enter the fit as step ``start - 1``. Two rounds, the first a warm-up.
"""

from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import replace

import numpy as np

from dynabatch.cost.online import CalibratedStageCostModel, OnlineFit
from dynabatch.cost.tables import PROFILE_CONFIG_KEYS
from dynabatch.engine.dist import gather_to_planner
from dynabatch.engine.step import train_step


_COMPUTE_KEY = re.compile(r"^(\d+)([FB])(\d+)$")


def compute_times(timeline) -> dict[str, dict[tuple[int, int], float]]:
    """``{"F": {(stage, micro_batch): seconds}, "B": {...}}`` of a rank's step timeline: per pipeline stage (chunk)
    it holds, one on the linear placement, several on virtual stages."""
    out: dict[str, dict[tuple[int, int], float]] = {"F": {}, "B": {}}
    for key, start, end in timeline:
        m = _COMPUTE_KEY.match(key)
        if m:
            times, op = out[m.group(2)], (int(m.group(1)), int(m.group(3)))
            times[op] = times.get(op, 0.0) + float(end - start)
    return out


def gather_measurements(ctx, result) -> list[dict] | None:
    """Collective over the world: rank 0 gets, per global rank, ``{"F": ..., "B": ..., "saved_peak": bytes,
    "model_state": bytes, "grad_peak": bytes, "grad_peak_predicted": bytes, "grad_collectives": count}`` of this step; the other ranks ``None``."""
    mine = {**compute_times(result.timeline), "saved_peak": result.saved_peak_bytes,
            "model_state": result.model_state_bytes, "grad_peak": result.gradient_peak_bytes,
            "grad_peak_predicted": result.gradient_peak_bytes_predicted, "grad_collectives": result.gradient_collectives}
    return gather_to_planner(ctx, mine, f"step {result.step}'s measured stage times")


def stage_peaks(ctx, gathered: list[dict]) -> list[int | None]:
    """Replica 0's saved-activation peak per stage from :func:`gather_measurements`."""
    return [gathered[ctx.rank_of(0, s)]["saved_peak"] for s in range(ctx.num_stages)]


def stage_times(ctx, gathered: list[dict], replica: int = 0) -> list[float]:
    """Measured forward + backward seconds per device (rank) of one replica, all its chunks."""
    return [sum(g["F"].values()) + sum(g["B"].values()) for g in
            (gathered[ctx.rank_of(replica, s)] for s in range(ctx.num_stages))]


class RunCalibration:
    """Rank 0's online fit for one run, shared by the training loop (writer) and the planner thread."""

    def __init__(self, base, fit: OnlineFit | None, plan_ahead: int, recorded_through: int = -1):
        self.base = base
        self.fit = fit
        """``None``: calibration off (the planner keeps ``base``)."""
        self.plan_ahead = plan_ahead
        self.recorded_through = recorded_through
        self.startup_step: int | None = None
        """On a resume whose checkpoint fit could not be restored (``--calibrate quick``): the step the start-up
        calibration runs as (:func:`dynabatch.training.resume.resume`); ``None`` otherwise."""
        self._cond = threading.Condition()
        self._closed = False

    @property
    def enabled(self) -> bool:
        return self.fit is not None

    def as_of(self, step: int) -> int:
        """The last step whose measurements plan ``step``: ``step - plan_ahead - 1``, but at least -1 (the
        start-up calibration's round), so the first steps are planned with it."""
        return max(step - self.plan_ahead - 1, -1)

    def _wait(self, step: int, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self.recorded_through >= self.as_of(step), timeout_s)
            if self.recorded_through < self.as_of(step) and not self._closed:
                raise RuntimeError(f"planning step {step} needs the measurements of step {self.as_of(step)}, "
                                   f"recorded through {self.recorded_through} after {timeout_s:.0f} s")

    def cost_model_for(self, step: int, timeout_s: float = 600.0, scaled: bool = False):
        """The stage cost model of the fit as of :meth:`as_of` ``(step)``; ``scaled``: the base model scaled per stage
        and direction to it (:meth:`~dynabatch.cost.online.OnlineFit.scales`, ``--plan-costs scaled``)."""
        if not self.enabled:
            return self.base
        self._wait(step, timeout_s)
        with self._cond:
            k = self.as_of(step)
            theta = self.fit.scales(k) if scaled else self.fit.coefficients(k)
            return CalibratedStageCostModel.of(self.base, theta, self.fit.memory_scale(k))

    def overhead_for(self, step: int) -> float:
        if not self.enabled:
            return 0.0
        with self._cond:
            return self.fit.overhead_s(self.as_of(step))

    def record(self, ctx, planned, gathered: list[dict], measured_step_s: float | None) -> None:
        """Observations of one executed step (rank 0); ``measured_step_s=None`` for a start-up round."""
        with self._cond:
            if self.enabled:
                self._observe(ctx, planned, gathered, measured_step_s)
                self.fit.prune(planned.step - self.plan_ahead)
            self.recorded_through = max(self.recorded_through, planned.step)
            self._cond.notify_all()

    def _observe(self, ctx, planned, gathered, measured_step_s) -> None:
        """Every chunk's measured forward and backward times against its planned features. Chunk ``c`` of ``V``
        runs on device ``c mod S`` (the linear placement: ``V = S``, chunk = device; virtual stages: several
        chunks per device, :class:`~dynabatch.schedule.placement.Placement`), so the fit has one set of
        coefficients per chunk. The memory term compares per-device peaks with per-stage predictions, so it is
        fitted on the linear placement only (virtual stages keep the base model's activation bytes)."""
        for r, x in enumerate(planned.features):
            num_chunks = x.shape[0]
            for c in range(num_chunks):
                g = gathered[ctx.rank_of(r, c % ctx.num_stages)]
                for d, op in enumerate("FB"):
                    mbs = sorted(m for chunk, m in g[op] if chunk == c)
                    self.fit.add_times(planned.step, c, d, x[c, d, mbs], np.array([g[op][(c, m)] for m in mbs]))
        if measured_step_s is not None:
            self.fit.add_step(planned.step, measured_step_s, planned.predicted_makespan_s)
            if self.fit.num_stages == ctx.num_stages:
                self.fit.add_memory(planned.step, stage_peaks(ctx, gathered), list(planned.predicted_saved_bytes))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def state_dict(self) -> dict | None:
        with self._cond:
            return None if self.fit is None else self.fit.state_dict()


def new_fit(cost_model, cfg, warm_start: dict | None = None) -> OnlineFit:
    """The run's empty fit, warm-started from a calibration file's coefficients when given."""
    fit = OnlineFit(cost_model.num_stages, any("t5_decoder" in s for s in cost_model.layout.stages))
    if warm_start is not None:
        theta0 = np.asarray(warm_start["coefficients"], dtype=np.float64)
        if theta0.shape != fit.theta0.shape:
            raise ValueError(f"calibration file {cfg.calibration_file}: coefficients of shape {theta0.shape}, this "
                             f"run needs {fit.theta0.shape} ({cost_model.num_stages} stages); calibrate this layout "
                             "afresh (drop --calibration-file)")
        fit.theta0 = theta0
        fit.step_residuals.append((-1, float(warm_start.get("overhead_s", 0.0))))  # its step overhead, until measured
    return fit


def calibration_key(cfg, model_config: dict, layout) -> dict:
    """What a calibration file must share with the run that reuses it: device, threads, model, layout, base."""
    import platform

    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or platform.machine())
    return {"device": device, "threads": cfg.threads,
            "model": {k: model_config[k] for k in PROFILE_CONFIG_KEYS if k in model_config},
            "layout": [list(s) for s in layout.stages], "cost_profile": os.path.basename(cfg.cost_profile or ""),
            "attention": cfg.attention_path}


def save_calibration(path: str, key: dict, fit: OnlineFit, as_of: int) -> None:
    """Write the fit as of ``as_of`` as a calibration file (JSON): the next run's warm start."""
    payload = {"key": key, "as_of_step": as_of, "coefficients": fit.coefficients(as_of).tolist(),
               "overhead_s": fit.overhead_s(as_of)}
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def load_calibration(path: str, key: dict) -> dict:
    """A calibration file, checked against this run's :func:`calibration_key`."""
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"calibration file {path}: cannot read it ({e}); pass a calibration.json an earlier run "
                         "wrote, or drop --calibration-file") from e
    theirs = payload.get("key", {})
    diffs = [k for k in key if theirs.get(k) != key[k]]
    if diffs:
        raise ValueError(f"calibration file {path} was measured with another {', '.join(diffs)} than this run; "
                         "drop --calibration-file (the run calibrates itself)")
    return payload


def quick_calibration(executor, ctx, planner, spec, step: int, rounds: int = 2,
                      startup_timeout_s: float | None = None) -> None:
    """Collective (``--calibrate quick``, module docstring): ``rounds`` forward-and-backward passes of
    synthetic micro-batches spanning the run's lengths; rank 0 records the last round as step ``step - 1``.
    ``startup_timeout_s``: how long the other ranks wait for the first round's plan (rank 0 may still be
    loading and tokenizing the data), as for a run's first step."""
    planned = planner.synthetic_step(step) if ctx.is_planner else None
    for k in range(rounds):
        result = train_step(executor, ctx, step, planned.replica_micro_batches if planned else None, spec=spec,
                            schedules=planned.schedules if planned else None,
                            placement=planner.placement if planned else None,
                            costs=planned.costs if planned else None, slice_links=planned.slice_links if planned else None,
                            forward_backward_only=True, receive_timeout_s=startup_timeout_s if k == 0 else None)
        gathered = gather_measurements(ctx, result)
        if ctx.is_planner and k == rounds - 1 and planner.calibration is not None:
            planner.calibration.record(ctx, replace(planned, step=step - 1), gathered, None)
