"""Ideal step times and the balanced efficiency of a step, simulated or measured.

:func:`ideal_step_time` prices a global batch as if every sample ran without padding and without a bubble
(``dynabatch simulate``'s ``efficiency``, ``efficiency_amortised`` and ``efficiency_balanced``).

:func:`balanced_efficiency` is ``efficiency_balanced`` for a step whose compute was *measured* (``dynabatch
bench``, the train metrics), in units that do not depend on the cost model's absolute scale (on CPU the
analytic preset is 8-50x optimistic, so a measured step time cannot be compared with an analytic ideal):

    efficiency_balanced = (W_ideal / W_plan) x busy,

    W_ideal = :func:`ideal_work`: each sample's amortised whole-model fwd + bwd time (every stage's, summed),
    W_plan  = :func:`planned_work`: the predicted fwd + bwd time of the plan's micro-batches, summed over all
              stages (chunks) and replicas, both priced with the same cost model (a unitless ratio: the work the
              plan adds over the ideal by padding, small micro-batches and recomputation),
    busy    = sum over devices of their measured compute seconds / devices / measured step time (the mean
              device busy fraction: what the schedule, the stage balance and the hand-offs leave idle).

In a simulated step the devices' busy time is exactly the plan's predicted work (``busy = W_plan / devices /
step``), so the product is ``W_ideal / devices / step``: ``ideal_step_time(..., balanced=True)`` over the
step time, the simulator's ``efficiency_balanced``. The same quantity, with the measured busy time in place of
the simulated one.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dynabatch.plan.order import padded_lengths

AMORTISED_TOKENS = 8192
"""Tokens of the batch of identical copies that prices a sample in ``efficiency_amortised``."""


def _per_sample(batch, family: str, amortise_tokens: int | None):
    """``(k, per-stage costs of k copies of each sample)``: each sample ``i`` as a micro-batch of shape
    ``(k_i, e_i, d_i)``, ``k_i = 1`` or, with ``amortise_tokens``, ``ceil(amortise_tokens / (e_i + d_i))``."""
    e, d = padded_lengths(batch.input_lens, batch.target_lens, family)
    k = np.ones_like(e) if amortise_tokens is None else np.maximum(1, -(-amortise_tokens // np.maximum(e + d, 1)))
    return k, e, d


def _whole_model_s(cost_model, k, e, d) -> np.ndarray:
    """Per sample, fwd + bwd seconds of the ``(k, e, d)`` micro-batch summed over every stage."""
    c = cost_model.per_stage(k, e, d)
    return (np.asarray(c.fwd_s) + np.asarray(c.bwd_s)).sum(axis=0)


def ideal_step_time(batch, cost_model, family: str, amortise_tokens: int | None = None, balanced: bool = False) -> float:
    """Sum over samples of the unpadded fwd + bwd time of each sample on its slowest stage, or with
    ``balanced`` its whole-model time (every stage's, summed) divided by the number of stages: the step
    of a perfectly balanced pipeline with no bubble.

    Each sample is priced alone, shape ``(1, e_i, d_i)`` (the issue's definition), or with
    ``amortise_tokens`` as ``1/k`` of a micro-batch of ``k = ceil(amortise_tokens / (e_i + d_i))``
    identical copies, which removes the per-sample kernel-launch and weight-read costs batching hides.
    """
    k, e, d = _per_sample(batch, family, amortise_tokens)
    if balanced:
        t = _whole_model_s(cost_model, k, e, d) / cost_model.num_stages
    else:
        t, _, _ = cost_model.evaluate(k, e, d)
    return float(np.sum(t / k))


def without_recompute(cost_model):
    """``cost_model`` without activation recomputation: the ideal never recomputes."""
    if getattr(cost_model, "recompute", "none") == "none":
        return cost_model
    return dataclasses.replace(cost_model, recompute="none")


def ideal_work(batch, cost_model, family: str, amortise_tokens: int = AMORTISED_TOKENS) -> float:
    """``W_ideal``: sum over samples of the amortised whole-model fwd + bwd seconds (each sample as ``1/k`` of
    ``k`` identical copies, every stage's time summed, no recomputation) under ``cost_model``. Divided by
    the number of devices it is the step of a perfectly balanced pipeline without a bubble."""
    cost_model = without_recompute(cost_model)
    k, e, d = _per_sample(batch, family, amortise_tokens)
    return float(np.sum(_whole_model_s(cost_model, k, e, d) / k))


def planned_work(costs: Sequence) -> float:
    """``W_plan``: predicted fwd + bwd seconds of a plan's micro-batches, summed over every stage (chunk) of
    every replica (``costs``: one :class:`~dynabatch.cost.stages.StageCosts` per replica)."""
    return float(sum((np.asarray(c.fwd_s) + np.asarray(c.bwd_s)).sum() for c in costs))


def busy_fractions(device_compute_s: Sequence[float], step_s: float) -> list[float]:
    """Per device, its compute seconds / the step time."""
    return [float(x) / step_s for x in device_compute_s]


def measured_efficiency(ideal_s: float, plan_s: float, device_compute_s: Sequence[float], step_s: float) -> float:
    """An ideal step time priced by the cost model (``ideal_s``), converted to measured seconds and divided by
    the measured step: ``ideal_s x (sum(device_compute_s) / plan_s) / step_s``. The factor is the measured
    compute seconds per predicted second of the same micro-batches (``plan_s``: :func:`planned_work`), so the
    cost model's absolute scale cancels; in a simulated step it is 1."""
    return ideal_s * float(np.sum(device_compute_s)) / plan_s / step_s


def balanced_efficiency(ideal_s: float, plan_s: float, device_compute_s: Sequence[float], step_s: float) -> float:
    """``efficiency_balanced = (W_ideal / W_plan) x`` the mean busy fraction of the devices (module docstring):
    ``ideal_s`` from :func:`ideal_work`, ``plan_s`` from :func:`planned_work` under the same cost model,
    ``device_compute_s`` the compute seconds of every device the plan ran on (simulated or measured) and
    ``step_s`` the step time. :func:`measured_efficiency` of the balanced ideal ``W_ideal / devices``."""
    return measured_efficiency(ideal_s / len(device_compute_s), plan_s, device_compute_s, step_s)
