"""Replay a compute schedule against per-stage costs: op start/end times, busy time, bubbles, memory.

Semantics (event-driven, one compute stream per stage, communication overlapped with compute):

* a stage runs its ops strictly in its list order, each as soon as the stage is free and its input
  has arrived: ``start = max(stage free, ready)``, ``end = start + duration``;
* ``F_m`` on stage ``s > 0`` is ready when ``F_m`` on ``s - 1`` has ended plus the send time of
  ``s - 1``'s activations; ``B_m`` on ``s < S - 1`` is ready when ``B_m`` on ``s + 1`` has ended plus
  the same send time (the gradient has the size of the activation); ``B_m`` on the last stage is
  ready when its own ``F_m`` has ended. Messages do not contend for links (each neighbour pair has a
  link per direction and sends overlap compute);
* memory of stage ``s`` = model states + stored activations of every micro-batch whose ``F`` has
  started and whose ``B`` has not ended + the transient peak of the running op. Memory therefore
  depends only on each stage's op order, not on timing. Message buffers count only when folded into
  the stored bytes by :func:`with_message_buffers` (an upper bound of the lowering's buffer slots, so
  a schedule that fits here also passes the validator's memory check).

Busy time of a stage is the sum of its op durations; bubble fraction is
``1 - sum(busy) / (S * makespan)``. With ``M`` equal micro-batches of forward ``f`` and backward ``b``
per stage and zero send time, GPipe and 1F1B both take ``(M + S - 1)(f + b)`` and their bubble
fraction is ``(S - 1) / (M + S - 1)`` (tests check this exactly).

Stages may order micro-batches differently; orders whose waits form a cycle (stage 0 ``F0 B0 F1 B1``,
stage 1 ``F1 F0 B0 B1``) raise ``ValueError`` naming the op each stage is blocked on. Pure Python over
lists: about 0.3 ms for ``S = 4, M = 30`` and 0.7 ms for ``M = 100`` (800 ops) on one CPU core, fast
enough to try dozens of candidates per step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Union

import numpy as np

from dynabatch.cost.stages import StageCosts, in_flight_buffer_bytes
from dynabatch.schedule._kernels import op_memory, replay
from dynabatch.schedule.compute import ComputeSchedule

SendTime = Union[None, float, np.ndarray, Callable[[np.ndarray], np.ndarray]]
"""Send time: ``None`` (free), seconds per message, an ``(S, M)`` array of seconds (message from stage
``s`` to ``s + 1`` for micro-batch ``m``; the gradient back takes the same), or a function of bytes."""


@dataclass(frozen=True, eq=False)
class SimResult:
    """Simulated timeline and memory of one training step."""

    schedule: ComputeSchedule
    """The compute schedule that was replayed."""
    makespan_s: float
    """Time from the first op's start (0) to the last op's end."""
    busy_s: np.ndarray
    """(S,) float64 seconds each stage spends computing."""
    bubble_fraction: float
    """``1 - sum(busy_s) / (S * makespan_s)``: idle share of all stages over the step."""
    start_s: np.ndarray
    """(S, 2M) float64 start time of each op, aligned with ``schedule.stages[s]``."""
    end_s: np.ndarray
    """(S, 2M) float64 end time of each op, aligned with ``schedule.stages[s]``."""
    op_memory_bytes: np.ndarray
    """(S, 2M) float64 memory of the stage while each op runs (model states + live stored + op peak)."""
    after_memory_bytes: np.ndarray
    """(S, 2M) float64 memory of the stage after each op ends (model states + live stored)."""
    peak_memory_bytes: np.ndarray
    """(S,) float64 largest memory of each stage over the step, model states included."""
    memory_limit_bytes: np.ndarray | None
    """(S,) float64 per-device limit the step was checked against, or ``None`` (no limit)."""
    fits_memory: bool
    """Every stage stays within ``memory_limit_bytes`` (``True`` without a limit)."""

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def num_micro_batches(self) -> int:
        return self.schedule.num_micro_batches


def with_message_buffers(costs: StageCosts) -> StageCosts:
    """``costs`` whose stored bytes also count each micro-batch's message buffers on the stage while it
    is in flight: the activation received from ``s - 1`` and the gradient sent back to it
    (``2 send_bytes[s - 1]``), the activation sent to ``s + 1`` and the gradient received from it
    (``2 send_bytes[s]``). An upper bound of what the lowering keeps in a micro-batch's buffer slot
    and the loaded inputs, when the costs price them: ``load_bytes``), so a schedule that fits with these
    costs also fits the validator's memory check."""
    check_costs(costs)
    return replace(costs, stored_bytes=np.asarray(costs.stored_bytes, dtype=np.float64)
                   + in_flight_buffer_bytes(costs))


def stage_send_times(costs: StageCosts, send_time: SendTime) -> np.ndarray:
    """(S, M) seconds of the message stage ``s`` sends to ``s + 1`` for each micro-batch."""
    shape = np.shape(costs.fwd_s)
    if send_time is None:
        return np.zeros(shape)
    if callable(send_time):
        out = np.asarray(send_time(np.asarray(costs.send_bytes, dtype=np.float64)), dtype=np.float64)
    else:
        out = np.asarray(send_time, dtype=np.float64)
    out = np.broadcast_to(out, shape) if out.ndim == 0 else out
    if out.shape != shape:
        raise ValueError(f"send times have shape {out.shape}, expected (S, M) = {shape}")
    if not np.all(np.isfinite(out) & (out >= 0)):
        raise ValueError(f"send times must be finite and >= 0, got min {out.min()} max {out.max()}")
    return out


def per_stage_values(value, num_stages: int, name: str) -> np.ndarray:
    """A scalar or ``(S,)`` sequence as an ``(S,)`` float64 array, checked finite and >= 0."""
    arr = np.asarray(value, dtype=np.float64)
    arr = np.full(num_stages, float(arr)) if arr.ndim == 0 else arr
    if arr.shape != (num_stages,):
        raise ValueError(f"{name} must be a scalar or have {num_stages} entries (one per stage), got shape {arr.shape}")
    if not np.all(np.isfinite(arr) & (arr >= 0)):
        raise ValueError(f"{name} must be finite and >= 0, got {arr.tolist()}")
    return arr


def check_costs(
    costs: StageCosts, num_stages: int | None = None, num_micro_batches: int | None = None
) -> tuple[int, int]:
    """``(S, M)`` of ``costs``; ``ValueError`` when arrays disagree, are negative or do not match the schedule."""
    shape = np.shape(costs.fwd_s)
    if len(shape) != 2:
        raise ValueError(f"stage costs must be (S, M) arrays, got fwd_s of shape {shape}")
    for name in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes", "send_bytes"):
        a = np.asarray(getattr(costs, name))
        if a.shape != shape:
            raise ValueError(f"stage costs {name} has shape {a.shape}, expected {shape} like fwd_s")
        if not np.all(np.isfinite(a) & (a >= 0)):
            raise ValueError(f"stage costs {name} must be finite and >= 0, got min {a.min()}")
    if num_stages is not None and (num_stages, num_micro_batches) != shape:
        raise ValueError(
            f"schedule has {num_stages} stages x {num_micro_batches} micro-batches "
            f"but costs are {shape[0]} x {shape[1]}"
        )
    return shape


def simulate(
    schedule: ComputeSchedule,
    costs: StageCosts,
    *,
    send_time: SendTime = None,
    model_state_bytes=0.0,
    memory_limit_bytes=None,
) -> SimResult:
    """Replay ``schedule`` with ``costs`` (arrays ``(S, M)``) and return its timeline and memory.

    ``model_state_bytes`` and ``memory_limit_bytes`` are scalars or one value per stage; the limit is
    the whole device (model states included). Raises ``ValueError`` on mismatched shapes and when the
    per-stage orders deadlock.
    """
    num_stages, num_mb = schedule.num_stages, schedule.num_micro_batches
    check_costs(costs, num_stages, num_mb)
    send = stage_send_times(costs, send_time)
    states = per_stage_values(model_state_bytes, num_stages, "model_state_bytes")
    limit = None
    if memory_limit_bytes is not None:
        limit = per_stage_values(memory_limit_bytes, num_stages, "memory_limit_bytes")
    codes = schedule.op_codes()
    fwd, bwd, stored, peak = (np.asarray(x, dtype=np.float64) for x in
                              (costs.fwd_s, costs.bwd_s, costs.stored_bytes, costs.peak_bytes))
    start_a, end_a = replay_codes(codes, fwd, bwd, send)
    mem_a, after_a = op_memory(codes, stored, peak, np.asarray(states, dtype=np.float64))
    makespan = float(end_a.max()) if end_a.size else 0.0
    busy = (end_a - start_a).sum(axis=1)
    bubble = max(0.0, 1.0 - float(busy.sum()) / (num_stages * makespan)) if makespan > 0 else 0.0  # not -2e-16
    peak = mem_a.max(axis=1) if num_mb else states.copy()
    fits = True if limit is None else bool(np.all(peak <= limit))
    return SimResult(schedule, makespan, busy, bubble, start_a, end_a, mem_a, after_a, peak, limit, fits)


def replay_codes(codes: np.ndarray, fwd, bwd, send) -> tuple[np.ndarray, np.ndarray]:
    """Start/end times ``(S, 2M)`` of every op; ``codes[s, k] = 2 m + (1 if backward)`` (the numba kernel
    :func:`dynabatch.schedule._kernels.replay`). Raises ``ValueError`` naming where the orders deadlock."""
    starts, ends, ptr = replay(codes, fwd, bwd, send)
    n = codes.shape[1]
    if np.any(ptr < n):
        blocked = [f"stage {s} waits at {'FB'[codes[s, ptr[s]] & 1]}{codes[s, ptr[s]] >> 1}"
                   for s in range(codes.shape[0]) if ptr[s] < n]
        raise ValueError(f"schedule deadlocks: {'; '.join(blocked)}")
    return starts, ends
