"""Per-step metrics: one JSON object per line in ``OUTPUT/metrics.jsonl``, and the run summary.

The writer never loses the run over its own output: if the disk fills or the file becomes
unwritable, it warns once (naming the file and the error), keeps the metrics in memory for the
summary and goes on training.
"""

from __future__ import annotations

import json
import os
import resource
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynabatch.core.words import counted
from dynabatch.cost.planner_model import UNPRICED
from dynabatch.plan.ideal import (AMORTISED_TOKENS, balanced_efficiency, busy_fractions, ideal_step_time, ideal_work,
                                  measured_efficiency, planned_work, without_recompute)
from dynabatch.training.calibration import stage_times


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux ``ru_maxrss`` is in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class MetricsWriter:
    """Appends step records to a JSONL file; keeps them for the summary."""

    path: str
    records: list[dict[str, Any]] = field(default_factory=list)
    failed: bool = False

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.failed:
            return
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            self.failed = True
            warnings.warn(
                f"could not write metrics to {self.path} ({e}); training continues, metrics stay in memory "
                "and in the final summary",
                stacklevel=2,
            )


def summarize(records: list[dict[str, Any]], method: str) -> dict[str, Any]:
    """Loss at the start and end, throughput and efficiency over a run's step records. ``loss_start`` and
    ``loss_end`` are means over the first and last ``k`` steps (a third of the run, 1 to 3 steps), so one noisy
    step does not decide them; throughput leaves out step 0, which pays the warm-up (numba, the allocator)."""
    if not records:
        return {"method": method, "steps": 0}
    losses = [r["loss"] for r in records]
    k = max(1, min(3, len(losses) // 3))
    steady = records[1:] if len(records) > 2 else records  # step 0 pays warm-up (numba, allocator)
    real = sum(r["real_tokens"] for r in steady)
    seconds = sum(r["step_time_s"] for r in steady)
    return {
        "method": method,
        "steps": len(records),
        "loss_start": float(np.mean(losses[:k])),
        "loss_end": float(np.mean(losses[-k:])),
        "tokens_per_s": real / seconds if seconds > 0 else 0.0,
        "padding_efficiency": float(sum(r["real_tokens"] for r in records) / sum(r["computed_tokens"] for r in records)),
        "bubble_fraction_predicted": float(np.mean([r["bubble_fraction_predicted"] for r in records])),
        "step_time_s_median": float(np.median([r["step_time_s"] for r in steady])),
        "predicted_step_s_median": float(np.median([r["predicted_step_s"] for r in steady])),
        "plan_time_s_median": float(np.median([r["plan_time_s"] for r in records])),
        "plan_wait_s_total": float(sum(r["plan_wait_s"] for r in steady)),
        "plan_overlap": planning_overlap(steady),
        "micro_batches_per_step": float(np.mean([r["num_micro_batches"] for r in records])),
        **({"candidates": candidate_counts(records)} if any(r.get("candidate") for r in records) else {}),
        "peak_rss_bytes": int(max(r["peak_rss_bytes"] for r in records)),
        **({"prediction_error_median_last10": prediction_summary(records)["last10_median"]}
           if "prediction_error" in records[0] else {}),
        **{f"{key}_median": _median_of(steady, key) for key in ("efficiency_balanced", "efficiency_amortised")},
        "device_busy_fraction_median": _median_of(steady, "device_busy_fraction", axis=0),
    }


def candidate_counts(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many steps ran each candidate plan (:attr:`~dynabatch.training.planned_step.PlannedStep.candidate`: ``dp``,
    or a baseline at a knob value such as ``packing_free=4``), most frequent first."""
    counts: dict[str, int] = {}
    for r in records:
        if r.get("candidate"):
            counts[r["candidate"]] = counts.get(r["candidate"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def efficiency_record(ctx, gathered, planned, elapsed: float, cost_model, family: str) -> dict[str, Any]:
    """A step's measured efficiencies (:mod:`dynabatch.plan.ideal`): ``device_busy_fraction`` (replica 0, per
    device: its measured fwd + bwd seconds / the step time), ``efficiency_balanced`` (the amortised whole-model
    ideal over all devices, every replica's devices measured) and ``efficiency_amortised`` (the amortised
    bottleneck-stage ideal), both priced with ``cost_model``: the model ``planned.costs`` were planned with."""

    compute = [stage_times(ctx, gathered, r) for r in range(ctx.num_replicas)]
    devices = [t for replica in compute for t in replica]
    plan = planned_work(planned.costs)
    if elapsed <= 0 or plan <= 0 or sum(devices) <= 0:
        return {"device_busy_fraction": busy_fractions(compute[0], elapsed) if elapsed > 0 else None,
                "efficiency_balanced": None, "efficiency_amortised": None}
    bottleneck = ideal_step_time(planned.batch, without_recompute(cost_model), family, AMORTISED_TOKENS)
    work = ideal_work(planned.batch, cost_model, family)
    # an ideal priced beyond a cost profile's grid (amortised copies of a sample: batch sizes it did not time) is
    # not a time: no efficiency rather than one of 1e30
    return {"device_busy_fraction": busy_fractions(compute[0], elapsed),
            "efficiency_balanced": None if work >= UNPRICED else balanced_efficiency(work, plan, devices, elapsed),
            "efficiency_amortised": None if bottleneck >= UNPRICED else measured_efficiency(bottleneck, plan, devices,
                                                                                              elapsed)}


def _median_of(records: list[dict[str, Any]], key: str, axis: int | None = None):
    """Median of a record field over the records that have it (``None`` when none has)."""
    values = [r[key] for r in records if r.get(key) is not None]
    if not values:
        return None
    m = np.median(np.asarray(values, dtype=np.float64), axis=axis)
    return m.tolist() if axis is not None else float(m)


def planning_overlap(records: list[dict[str, Any]]) -> float:
    """The share of the background planner's time hidden behind training: ``1 - waited / planned`` over the
    step records (1: the steps never waited for a plan; 0: every plan was waited for in full). Each step record
    carries its own (``plan_overlap``, from its ``plan_time_s`` and ``plan_wait_s``); the summary's is over the
    steps after the first."""
    planned = sum(r["plan_time_s"] for r in records)
    waited = sum(r["plan_wait_s"] for r in records)
    return float(min(1.0, max(0.0, 1.0 - waited / planned))) if planned > 0 else 1.0


def prediction_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Predicted against measured over a run's step records: the median relative step-time error over all
    steps and over the last 10, and per stage the median relative error of forward + backward seconds."""
    err = np.array([r["prediction_error"] for r in records])
    stages = np.array([[abs(p - m) / m if m > 0 else 0.0 for p, m in zip(r["stage_time_predicted_s"], r["stage_time_measured_s"])]
                       for r in records])
    return {"steps": len(records), "median": float(np.median(err)), "last10_median": float(np.median(err[-10:])),
            "stage_median": [float(x) for x in np.median(stages, axis=0)],
            "calibration": records[-1].get("calibration", "off")}


def format_prediction_report(records: list[dict[str, Any]]) -> str:
    """``dynabatch profile --check RUN_DIR``: one line per step, then the summary."""
    head = f"{'step':>5s} {'measured s':>10s} {'predicted s':>11s} {'error':>7s} {'median10':>8s}  per stage measured/predicted s"
    lines = [head, "-" * len(head)]
    for r in records:
        stages = "  ".join(f"{m:.3f}/{p:.3f}" for m, p in zip(r["stage_time_measured_s"], r["stage_time_predicted_s"]))
        lines.append(f"{r['step']:5d} {r['step_time_s']:10.3f} {r['predicted_step_s']:11.3f} {r['prediction_error']:7.1%} "
                     f"{r['prediction_error_median']:8.1%}  {stages}")
    s = prediction_summary(records)
    # step -1 is the start-up round (calibration.as_of): the fit a run's first steps are planned with
    how = s["calibration"].replace("as of step -1", "as of the start-up round")
    lines.append(f"{counted(s['steps'], 'step')} ({how} at the last): median |predicted - measured| / measured of the "
                 f"step time {s['median']:.1%}, last 10 steps {s['last10_median']:.1%}; per stage (forward + backward) "
                 + ", ".join(f"{x:.1%}" for x in s["stage_median"]))
    return "\n".join(lines)


def format_summary(s: dict[str, Any]) -> str:
    if not s.get("steps"):
        return f"{s['method']}: no steps"
    return (
        f"{s['method']}: {counted(s['steps'], 'step')}, loss {s['loss_start']:.3f} -> {s['loss_end']:.3f}, "
        f"{s['tokens_per_s']:.0f} real tokens/s, padding efficiency {s['padding_efficiency']:.3f}, "
        f"predicted bubble {s['bubble_fraction_predicted']:.3f}, {s['micro_batches_per_step']:.1f} micro-batches/step, "
        f"step {s['step_time_s_median']:.3f} s measured vs {s['predicted_step_s_median']:.3f} s predicted, "
        f"plan {1e3 * s['plan_time_s_median']:.1f} ms/step, waited {s['plan_wait_s_total']:.2f} s for plans "
        f"({s['plan_overlap']:.0%} of planning overlapped with training), "
        + (f"plans run: {', '.join(f'{k} {v}' for k, v in s['candidates'].items())} (steps), "
           if s.get("candidates") else "")
        + f"peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB"
        + (f", prediction error {s['prediction_error_median_last10']:.1%} (median of the last 10 steps)"
           if "prediction_error_median_last10" in s else "")
        + _format_efficiency(s)
    )


def _format_efficiency(s: dict[str, Any]) -> str:
    """``, efficiency balanced X (amortised Y), device busy a/b`` of a summary (medians), or ``""``."""
    if s.get("efficiency_balanced_median") is None:
        return ""
    busy = "/".join(f"{x:.2f}" for x in s.get("device_busy_fraction_median") or ())
    return (f", efficiency balanced {s['efficiency_balanced_median']:.3f} "
            f"(amortised {s['efficiency_amortised_median']:.3f}), device busy {busy} (median step)")
