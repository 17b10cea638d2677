"""Placements of pipeline stages on devices (virtual stages), and a list scheduler over them.

A model is cut into ``V = S x v`` contiguous chunks (pipeline *stages*); device ``d`` of ``S`` holds the
chunks ``d, d + S, d + 2S, ...`` (:class:`Placement`):

* ``linear`` (``v = 1``): today's layout, one chunk per device;
* ``cyclic`` (T5, ``v = 2``): the encoder cut into ``S`` chunks, then the decoder (``cyclic_layout`` in
  :mod:`dynabatch.cost.stages`), so device ``d`` holds encoder chunk ``d`` and decoder chunk ``d``: every
  device does about ``1/S`` of each micro-batch's encoder and decoder work (DynaPipe's cyclic schedules);
* ``interleaved:V`` (decoder-only, ``v = V``): the layers cut into ``S x V`` chunks dealt round-robin
  (Megatron-LM's interleaved 1F1B, ``torch.distributed.pipelining.ScheduleInterleaved1F1B``).

:func:`list_schedule` orders the ``2 V M`` forward and backward ops of a step's micro-batches on the
devices and replays them in one pass (the simulator of a placement; :func:`dynabatch.schedule.simulate.
simulate` replays one-chunk-per-device schedules). Event-driven list scheduling: whenever a device is
free it starts, among its ops whose inputs have arrived, a backward first (lowest micro-batch; it frees
memory), else the deepest forward (lowest micro-batch), so micro-batches in flight finish before new ones
enter; a new micro-batch enters the first chunk in plan order only while every device keeps its stored
activations, message buffers and the op's peak within its memory (admission, like the adaptive policy's).
Dependencies: ``F(v, m)`` after ``F(v - 1, m)``, ``B(v, m)`` after ``B(v + 1, m)`` (the last chunk's
after its own forward), each plus the send time when the two chunks sit on different devices (a hand-off
on one device is free). A device runs one op at a time: two chunks of one device never compute at once.
Token-slice chains (``links``, :mod:`dynabatch.schedule.chains`) add, on every chunk, ``F(v, m)`` after
``F(v, links[m])`` and ``B(v, links[m])`` after ``B(v, m)``: same-device constraints (:func:`chain_ready`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from dynabatch.core.placements import PLACEMENTS  # ``--placement`` kinds; ``interleaved`` takes ``:V``
from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.chains import successors
from dynabatch.schedule.compute import Phase
from dynabatch.schedule.trace import TimelineOp


@dataclass(frozen=True)
class Placement:
    """Which device holds each of the ``num_devices x chunks_per_device`` pipeline stages (chunk ``c`` is on
    device ``c % num_devices``)."""

    kind: str
    num_devices: int
    chunks_per_device: int = 1

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.kind!r}; valid: {', '.join(PLACEMENTS[:-1])}, interleaved:V")
        if self.num_devices < 1 or self.chunks_per_device < 1:
            raise ValueError(f"a placement needs >= 1 device and chunk per device, got {self.num_devices}, "
                             f"{self.chunks_per_device}")

    @property
    def num_stages(self) -> int:
        return self.num_devices * self.chunks_per_device

    def device(self, stage: int) -> int:
        return stage % self.num_devices

    def describe(self) -> str:
        return self.kind if self.kind != "interleaved" else f"interleaved:{self.chunks_per_device}"

    @staticmethod
    def parse(text: str, num_devices: int) -> "Placement":
        """``linear``, ``cyclic`` (2 chunks per device) or ``interleaved:V``; ``ValueError`` otherwise."""
        kind, _, count = text.partition(":")
        if kind == "interleaved":
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"--placement interleaved:V needs a chunk count V >= 1, got {text!r}")
            return Placement(kind, num_devices, int(count))
        if count:
            raise ValueError(f"--placement {kind} takes no ':V', got {text!r}")
        return Placement(kind, num_devices, 2 if kind == "cyclic" else 1)


@dataclass(frozen=True, eq=False)
class PlacedResult:
    """Timeline of one step on a placement."""

    placement: Placement
    order: tuple[tuple[tuple[str, int, int, float, float], ...], ...]
    """Per device, its ops in the order they ran: ``(phase "F"/"B", stage, micro-batch, start s, end s)``."""
    makespan_s: float
    busy_s: np.ndarray
    """(devices,) seconds each device computes."""
    bubble_fraction: float
    peak_memory_bytes: np.ndarray
    """(devices,) largest memory of each device (model states of its chunks included)."""
    fits_memory: bool
    policy: str = "list"
    """What ordered the ops: ``list`` (:func:`list_schedule`), ``interleaved_1f1b``
    (:mod:`dynabatch.schedule.interleaved`) or ``wait_free_cyclic`` (:mod:`dynabatch.schedule.wait_free_cyclic`)."""

    def timeline_ops(self) -> list:
        """The ops as :class:`~dynabatch.schedule.trace.TimelineOp` (traces and plots, like a measured timeline)."""
        return timeline_ops(self.order)


def timeline_ops(order) -> list:
    """Per-device orders ``(phase, stage, micro-batch, start s, end s)`` as
    :class:`~dynabatch.schedule.trace.TimelineOp`."""
    return [TimelineOp(v, Phase(phase), m, start, end) for ops in order for phase, v, m, start, end in ops]


def chain_ready(phase: str, v: int, m: int, links, successor: dict, done) -> bool:
    """Whether op ``(phase, v, m)``'s token-slice predecessor on chunk ``v`` has run (``done``: a container of
    ``(phase, chunk, micro-batch)``): a slice's forward after its previous slice's, a slice's backward after its
    next slice's (:mod:`dynabatch.schedule.chains`). Always true without slices."""
    if phase == "F":
        return not links or links[m] < 0 or ("F", v, links[m]) in done
    return m not in successor or ("B", v, successor[m]) in done


class Admission:
    """Which micro-batch may enter a placed step (the list scheduler's and the wait-free cyclic order's rule): a
    micro-batch enters chunk 0 only while every device keeps its reserved bytes (model states plus the stored
    activations of every admitted, unfinished micro-batch on all its chunks) and the op's peak within its limit.
    With nothing in flight a micro-batch always enters, and so does a token slice whose chain has begun (its
    earlier slices' backwards wait for it; the slicing planner sized the chain to fit)."""

    def __init__(self, stored: np.ndarray, peak: np.ndarray, dev: list[int], device_states: np.ndarray,
                 limit: float, links: tuple[int, ...]):
        self.footprint = np.zeros((len(device_states), stored.shape[1]))  # a micro-batch's bytes on each device
        np.add.at(self.footprint, dev, stored)
        self.peak, self.limit, self.links = peak, limit, links
        self.reserved = np.asarray(device_states, dtype=np.float64).copy()
        self.in_flight = 0

    def fits(self, m: int) -> bool:
        return bool(np.all(self.reserved + self.footprint[:, m] + self.peak[:, m].max() <= self.limit))

    def admits(self, m: int) -> bool:
        return self.in_flight == 0 or (bool(self.links) and self.links[m] >= 0) or self.fits(m)

    def enter(self, m: int) -> None:
        self.reserved += self.footprint[:, m]
        self.in_flight += 1

    def leave(self, m: int) -> None:
        self.reserved -= self.footprint[:, m]
        self.in_flight -= 1


def list_schedule(costs: StageCosts, placement: Placement, send_s: np.ndarray, model_state_bytes,
                  memory_limit_bytes: float | None = None, links=()) -> PlacedResult:
    """Order and replay one step's ops on ``placement`` (see the module docstring). ``costs`` are ``(V, M)``
    per chunk (stored bytes with their message buffers, :func:`~dynabatch.schedule.simulate.with_message_buffers`),
    ``send_s`` the ``(V, M)`` seconds of chunk ``v``'s message to ``v + 1`` (0 is used on one device),
    ``model_state_bytes`` the ``(V,)`` states of each chunk, ``links`` the token-slice chains (slices of a sample
    consecutive in plan order)."""
    fwd, bwd = np.asarray(costs.fwd_s, dtype=np.float64), np.asarray(costs.bwd_s, dtype=np.float64)
    stored, peak = np.asarray(costs.stored_bytes, dtype=np.float64), np.asarray(costs.peak_bytes, dtype=np.float64)
    num_stages, num_mb = fwd.shape
    if num_stages != placement.num_stages:
        raise ValueError(f"costs have {num_stages} stages but placement {placement.describe()} has "
                         f"{placement.num_stages} chunks")
    S = placement.num_devices
    dev = [placement.device(v) for v in range(num_stages)]
    states = np.asarray(model_state_bytes, dtype=np.float64).reshape(num_stages)
    live = np.zeros(S)
    np.add.at(live, dev, states)
    peak_mem = live.copy()
    limit = np.inf if memory_limit_bytes is None else float(memory_limit_bytes)
    send = np.asarray(send_s, dtype=np.float64)
    free = [0.0] * S
    ready: list[list] = [[] for _ in range(S)]  # heaps of (priority, ready time, phase, stage, mb)
    order: list[list] = [[] for _ in range(S)]
    busy = np.zeros(S)
    next_mb, done_b0, fits = 0, 0, True
    makespan = 0.0
    links, successor, done = tuple(links), successors(links), set()
    admission = Admission(stored, peak, dev, live, limit, links)

    def push(phase: str, v: int, m: int, t: float) -> None:
        key = (0, m, 0) if phase == "B" else (1, -v, m)
        heapq.heappush(ready[dev[v]], (key, t, phase, v, m))

    while done_b0 < num_mb:
        if next_mb < num_mb and admission.admits(next_mb):
            if admission.in_flight == 0 and not admission.fits(next_mb):
                fits = False  # alone it does not fit: run it anyway, reported
            admission.enter(next_mb)
            push("F", 0, next_mb, 0.0)
            next_mb += 1
        # The device that can start an op soonest; on it, the best op ready by then (its slice chain allowing).
        best = None
        for d in range(S):
            eligible = [item[1] for item in ready[d] if chain_ready(*item[2:], links, successor, done)]
            if not eligible:
                continue
            t = max(free[d], min(eligible))
            if best is None or t < best[0]:
                best = (t, d)
        if best is None:
            raise AssertionError("list schedule stalled")  # pragma: no cover (every op has a path back)
        t, d = best
        candidates = [item for item in ready[d] if item[1] <= t and chain_ready(*item[2:], links, successor, done)]
        key, r, phase, v, m = min(candidates)
        ready[d].remove((key, r, phase, v, m))
        heapq.heapify(ready[d])
        start = max(free[d], r)
        dur = fwd[v, m] if phase == "F" else bwd[v, m]
        end = start + dur
        free[d], busy[d] = end, busy[d] + dur
        makespan = max(makespan, end)
        order[d].append((phase, v, m, start, end))
        done.add((phase, v, m))
        if phase == "F":
            live[d] += stored[v, m]
            peak_mem[d] = max(peak_mem[d], live[d] + peak[v, m])
            if v + 1 < num_stages:
                push("F", v + 1, m, end + (send[v, m] if dev[v + 1] != d else 0.0))
            else:
                push("B", v, m, end)
        else:
            peak_mem[d] = max(peak_mem[d], live[d] + peak[v, m])
            live[d] -= stored[v, m]
            if v > 0:
                push("B", v - 1, m, end + (send[v - 1, m] if dev[v - 1] != d else 0.0))
            else:
                done_b0 += 1
                admission.leave(m)
    fits = fits and bool(np.all(peak_mem <= limit))
    bubble = 1.0 - float(busy.sum()) / (S * makespan) if makespan > 0 else 0.0
    return PlacedResult(placement, tuple(tuple(o) for o in order), makespan, busy, bubble, peak_mem, fits)
