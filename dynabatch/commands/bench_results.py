"""What ``dynabatch bench`` reports per method from its planned and measured steps: per-step statistics
(:func:`step_stats`), the simulated twin of a fixed-shape run (:func:`simulated`) and the result dict
(:func:`results`) that :mod:`dynabatch.commands.bench_report` prints and ``--json`` writes."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from dynabatch.commands.bench_report import PEER
from dynabatch.core.methods import objective_note
from dynabatch.data.baselines import BASELINES
from dynabatch.plan.ideal import balanced_efficiency, ideal_work, planned_work
from dynabatch.schedule.step import compute_schedule
from dynabatch.schedule.simulate import simulate
from dynabatch.training.config.resolve import lower
from dynabatch.cost.planner_model import UNPRICED
from dynabatch.models.attention_kernels import KERNEL_CALLS
from dynabatch.models.families import check_model
from dynabatch.training.step_score import send_time_of
from dynabatch.schedule.virtual import placed_step


def simulated(shapes, policy: str, cfg, cost_model):
    """Schedule (``policy``) and simulated run of one replica's micro-batch shapes under the planner's cost model."""

    arr = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
    costs = cost_model.per_stage(*(arr[:, i].astype(np.float64) for i in range(3)))
    schedule = compute_schedule(policy, arr, cfg.stages, costs, cfg.memory_gib * 2**30)
    return simulate(schedule, costs, model_state_bytes=np.array(cost_model.model_state_bytes))


def step_stats(r, cost_model) -> list[dict]:
    """Per step: real and computed tokens, micro-batches, predicted step time, bubble and peak memory."""
    out = []
    for i, p in enumerate(r.planned):
        if r.peer_steps is not None:  # fixed shapes, 1F1B
            num, (b, e, d), _, _ = r.peer_steps[i]
            shapes = [(b, e, d)] * num
            sim = simulated(shapes, "1f1b", r.cfg, cost_model)
        elif r.placement is not None:  # virtual stages: ordered on the placement as the planner did, sends priced
            (shapes,) = p.shapes
            sim = placed_step((p.predicted_costs or p.costs)[0], r.placement, p.model_state_bytes,
                              r.cfg.memory_gib * 2**30, send_time_of(cost_model))
        else:  # the schedule and costs the runtime ran (token slices priced with their context)
            (shapes,) = p.shapes
            sim = simulate(p.schedules[0], (p.predicted_costs or p.costs)[0],
                           model_state_bytes=np.array(cost_model.model_state_bytes))
        out.append({"real": p.real_tokens, "computed": sum(b * (e + d) for b, e, d in shapes), "mbs": len(shapes),
                     "predicted_s": float(sim.makespan_s), "bubble": float(sim.bubble_fraction),
                     "predicted_step_s": float(p.predicted_step_s if r.peer_steps is None and r.placement is None
                                               else sim.makespan_s),
                     "peak": float(np.max(sim.peak_memory_bytes)), "plan_s": p.plan_time_s,
                     "sliced": 0 if r.peer_steps is not None else p.num_sliced_samples,
                     "order": "1f1b" if r.peer_steps is not None else p.schedules[0].policy,
                     "candidate": "" if r.peer_steps is not None else p.candidate,
                     "recomputed": 0 if r.peer_steps is not None else sum(p.recompute_counts.values()),
                     "moved": 0 if r.peer_steps is not None else sum(p.moved_micro_batches.values())})
    return out


def _device_sums(per_stage, num_devices: int) -> np.ndarray:
    """Per-stage values summed per device (stage ``s`` is on device ``s mod num_devices``)."""
    a = np.asarray(per_stage, dtype=np.float64)
    return np.array([a[d::num_devices].sum() for d in range(num_devices)])


def _plan_cost_model(run, base, base_profile: str | None):
    """The stage cost model ``run``'s plans were priced with (``PlannedStep.costs``): a calibrated method's
    planner's (its base, or its latest fit with ``--plan-costs calibrated``), else the shared base; ``None`` for a
    method planned with another cost profile (``dynamic_profiled``), whose units the base's ideal does not share.
    Virtual-stage methods are priced per chunk with the same preset: their whole-model work is the base's."""
    planner = getattr(run.planned, "planner", None)
    if planner is not None:
        return planner.cost_model
    return base if run.cfg.cost_profile == base_profile else None


def _efficiency_balanced(run, measured: np.ndarray, times: np.ndarray, warmup: int, cost_model, args) -> float | None:
    """Median over the timed steps of :func:`~dynabatch.plan.ideal.balanced_efficiency`: the amortised
    whole-model ideal over the plan's predicted work (one cost model: unitless) times the measured mean
    device busy fraction (``measured``: (steps, devices) compute seconds of replica 0, the only one)."""
    model = _plan_cost_model(run, cost_model, getattr(args, "cost_profile", None))
    if model is None:
        return None

    family = check_model(args.model, None).sequence_kind
    values = []
    for p, busy, t in zip(run.planned[warmup:], measured, times):
        ideal, plan = ideal_work(p.batch, model, family), planned_work(p.costs)
        if max(ideal, plan) < UNPRICED:  # a profile cannot price the ideal's batches beyond its grid
            values.append(balanced_efficiency(ideal, plan, busy, t))
    return float(np.median(values)) if values else None


def _predicted_saved_mib(run, warmup: int) -> float | None:
    """Largest simulated peak of stored activation bytes on any stage over the timed steps (replica 0):
    what the measured ``SavedActivationMeter`` peak is compared with; ``None`` for the peer."""
    if run.peer_steps is not None or not run.planned:
        return None
    values = [max(p.predicted_saved_bytes) for p in run.planned[warmup:] if p is not None and p.predicted_saved_bytes]
    return max(values) / 2**20 if values else None


def _fits_measured(measured_saved, method: str, cost_model, memory_gib: float) -> bool | None:
    """Whether the measured activations saved for backward (largest stage) plus the largest stage's model states
    stay within ``--memory-gib`` (``None`` when nothing was measured: the peer)."""
    saved = (measured_saved or {}).get(method)
    if saved is None:
        return None
    return bool(saved + max(cost_model.model_state_bytes) <= memory_gib * 2**30)


PREDICTED_FIELDS = ("bubble_fraction_predicted", "predicted_step_s_median", "predicted_peak_memory_mib",
                    "predicted_saved_activation_mib", "prediction_error_median", "stage_compute_s_predicted",
                    "efficiency_balanced")
"""A method's fields that come from the cost model's prices of its micro-batches."""


def _drop_off_grid_prices(row: dict, timed: list[dict]) -> None:
    """A cost profile prices shapes beyond its grid as ``INFEASIBLE`` (1e30 s and bytes): a method whose timed
    steps hold such a micro-batch gets ``None`` for every predicted field, and ``priced_off_grid`` (a baseline's
    token budget beyond the profiled batch sizes, say), rather than 1e30 seconds in the report."""
    off = any(x["predicted_s"] >= UNPRICED or x["peak"] >= UNPRICED for x in timed)
    row["priced_off_grid"] = off
    if off:
        row.update(dict.fromkeys(PREDICTED_FIELDS))
        for x in row["per_step"]:
            x["predicted_s"] = x["predicted_step_s"] = None


def _spread(values) -> dict:
    v = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(v)), "p10": float(np.percentile(v, 10)), "p90": float(np.percentile(v, 90)),
            "min": float(v.min()), "max": float(v.max())}


def _prediction_error(run, times, warmup: int) -> float | None:
    """Median ``|predicted - measured| / measured`` step time over the timed steps (``None`` for the peer)."""
    if run.peer_steps is not None:
        return None
    predicted = np.array([p.predicted_step_s for p in run.planned[warmup:]])
    return float(np.median(np.abs(predicted - times) / times))


def _planner_preset(cost_model) -> str | None:
    """The analytic hardware preset the planner's base model prices with; ``None`` for a --cost-profile's tables."""
    hardware = getattr(getattr(cost_model, "model", None), "hardware", None)
    return hardware.name if hardware is not None else None


def results(args, methods, runs, times, losses, measured_peak, rss, cost_model, batches, device,
             measured_saved=None, calibrated=(), stage_compute=None, flags=()) -> dict:
    import platform

    import torch

    w = args.untimed_steps
    rows = {}
    for m in methods:
        stats = step_stats(runs[m], cost_model)
        timed = stats[w:]
        real = np.array([x["real"] for x in timed], dtype=np.float64)
        t = np.array(times[m])
        rows[m] = {
            "tokens_per_s": float(real.sum() / t.sum()),
            "tokens_per_s_per_step": _spread(real / t),
            "step_time_s": _spread(t),
            "padding_efficiency": float(sum(x["real"] for x in timed) / sum(x["computed"] for x in timed)),
            "bubble_fraction_predicted": float(np.mean([x["bubble"] for x in timed])),
            "predicted_step_s_median": float(np.median([x["predicted_s"] for x in timed])),
            "predicted_peak_memory_mib": max(x["peak"] for x in timed) / 2**20,
            "measured_peak_memory_mib": measured_peak[m] / 2**20 if measured_peak else None,
            "measured_saved_activation_mib": (measured_saved[m] / 2**20
                                              if measured_saved and measured_saved[m] is not None else None),
            "predicted_saved_activation_mib": _predicted_saved_mib(runs[m], w),
            "fits_memory_measured": _fits_measured(measured_saved, m, cost_model, runs[m].cfg.memory_gib),
            "micro_batches_per_step": float(np.mean([x["mbs"] for x in timed])),
            "sliced_samples_per_step": float(np.mean([x["sliced"] for x in timed])),
            "moved_micro_batches_per_step": float(np.mean([x["moved"] for x in timed])),  # --moving-boundaries
            "recomputed_forwards_per_step": float(np.mean([x["recomputed"] for x in timed])),
            "schedule_policies": dict(Counter(x["order"] for x in timed)),  # linear: the policy; virtual: the order
            "candidates": dict(Counter(x["candidate"] for x in timed if x["candidate"])),  # dynamic: which plan ran
            "plan_ms_median": 1e3 * float(np.median([x["plan_s"] for x in stats])),
            "calibration": runs[m].cfg.calibration_mode if m in calibrated else "off",
            "pack_rows": lower("pack_rows", runs[m].cfg.pack_rows),  # resolved (device: per device), as the planner names it
            "prediction_error_median": _prediction_error(runs[m], t, w),
            "loss_first": losses[m][0],
            "loss_last": losses[m][-1],
            "per_step": [{"time_s": float(ts), "predicted_s": float(x["predicted_s"]),
                          "predicted_step_s": x["predicted_step_s"], "micro_batches": int(x["mbs"]),
                          "real_tokens": int(x["real"]), "computed_tokens": int(x["computed"]),
                          "sliced_samples": int(x["sliced"]), "candidate": x["candidate"]}
                         for ts, x in zip(t, timed)],
        }
        if stage_compute and stage_compute.get(m):  # where the step goes: compute per stage, predicted and measured
            measured = np.array(stage_compute[m])  # (steps, devices)
            predicted = np.array([_device_sums((np.asarray(c.fwd_s) + np.asarray(c.bwd_s)).sum(axis=1), measured.shape[1])
                                  for c in ((p.predicted_costs or p.costs)[0] for p in runs[m].planned[w:])])
            rows[m]["stage_compute_s_measured"] = np.median(measured, axis=0).tolist()
            rows[m]["stage_compute_s_predicted"] = np.median(predicted, axis=0).tolist()
            rows[m]["device_busy_fraction"] = np.median(measured / t[:, None], axis=0).tolist()
            rows[m]["efficiency_balanced"] = _efficiency_balanced(runs[m], measured, t, w, cost_model, args)
            for x, st in zip(rows[m]["per_step"], measured):
                x["stage_compute_s_measured"] = [float(v) for v in st]
        _drop_off_grid_prices(rows[m], timed)
        if runs[m].peer_steps is not None:  # the fixed (rows, E, D) the peer ran
            rows[m]["fixed_shapes"] = sorted({tuple(step[1]) for step in runs[m].peer_steps})
    for m in methods:  # packing_free_split trains another objective: reported, never the best baseline
        if objective_note(m):
            rows[m]["changes_objective"] = objective_note(m)
    baselines = [m for m in methods if m in BASELINES and not objective_note(m)]
    best = max(baselines, key=lambda m: rows[m]["tokens_per_s"]) if baselines else None
    for m in methods:
        for key, ref in (("best_baseline", best), ("pipelining", PEER if PEER in methods else None)):
            if ref is not None:
                rows[m][f"ratio_to_{key}"] = rows[m]["tokens_per_s"] / rows[ref]["tokens_per_s"]
                paired = np.array(times[ref]) / np.array(times[m])  # same global batch, same step: tokens cancel
                rows[m][f"paired_ratio_to_{key}"] = _spread(paired)
    return {
        "config": {k: getattr(args, k) for k in flags if k != "json"},
        "machine": {"device": device, "cpus": os.cpu_count(), "torch": torch.__version__,
                    "platform": platform.platform(), "processor": platform.processor(),
                    "planner_preset": _planner_preset(cost_model)},
        "global_batches": len(batches),
        "samples_per_step": float(np.mean([len(b) for b in batches])),
        "real_tokens_per_step": float(np.mean([b.num_tokens for b in batches])),
        "peak_rss_mib_rank0": rss / 2**20,
        "attention_kernels_rank0": dict(sorted(KERNEL_CALLS.items())),  # calls per kernel, every method and trial
        "best_baseline": best,
        "methods": rows,
    }
