"""Pipeline policies: GPipe, 1F1B and a memory-aware adaptive list schedule, and the per-step choice.

Every policy is a pure function returning a :class:`ComputeSchedule` (per-stage op orders using the
original micro-batch indices); ``order`` is the permutation in which micro-batches enter stage 0.

* :func:`gpipe`: every stage runs all forwards, then all backwards (same order); no barrier between.
* :func:`one_f_one_b`: stage ``s`` runs ``w = min(S - s, M)`` forwards, then alternates one backward
  and one forward, then the remaining backwards, so it holds at most ``S - s`` micro-batches.
* :func:`adaptive`: a list scheduler that simulates all stages jointly in time. Whenever a stage is
  free it runs, among the ops whose inputs have arrived, the backward of the earliest micro-batch
  (it frees memory and unblocks the stage below), otherwise its next forward in ``order`` if that is
  admitted: the stage's stored activations plus the new micro-batch's, plus the largest transient
  peak among them, must stay within the memory limit (and at most ``S - s + in_flight_slack``
  micro-batches in flight when a slack is given). A stage holding nothing always admits, so the
  schedule cannot deadlock, and it fits memory whenever every micro-batch fits alone. The recorded
  per-stage orders are replayed by the simulator with no barriers and give exactly the times the
  list scheduler saw. With equal micro-batches and slack 0 it reproduces 1F1B; without a slack it
  hides send time that 1F1B exposes in its steady state, lets a fast stage run ahead while a slow
  micro-batch occupies its neighbour, and stays within memory where 1F1B (``S - s`` micro-batches on
  stage ``s``) or GPipe (all ``M``) would not.

:func:`choose_schedule` tries every policy (adaptive with slacks 0, 2 and none) on a few micro-batch
orders (the planner's, slowest first, fastest first, "fill/drain" with the two fastest micro-batches
first and last and the rest slowest first or in planner order, and seeded random permutations), then
improves the best by a seeded local search of swaps and moves; it returns the smallest simulated
makespan that fits memory. Deterministic for a given seed. The adaptive list schedule, the replay and the
memory of every candidate run in numba (:mod:`dynabatch.schedule._kernels`, the same decisions as the
pure-Python loops they replaced). Measured on one CPU core, S = 4: 5.5, 6.6, 9.1, 11.7 and 17.3 ms per call
for M = 10, 20, 40, 60, 100 (about 35 candidates + 24 moves; the pure-Python loops: 27.5, 50.6, 96.9, 143 and
239 ms). On the FLAN-like
benchmark's dynamic plans (4 stages) the adaptive policy wins most steps: choosing among GPipe and 1F1B
only (same orders and search) gives 0.5-1.2% longer steps for GPT, 2-4.5% for T5 at 512-2048 and
9.6% for T5 at 4096, where memory binds (``scripts/bench_schedule.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dynabatch.core.policies import SCHEDULE_POLICIES
from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.chains import backward_order, chain_order, check_links, successors
from dynabatch.schedule.compute import ComputeOp, ComputeSchedule, Phase
from dynabatch.schedule import _kernels
from dynabatch.schedule.simulate import (
    SendTime,
    SimResult,
    check_costs,
    per_stage_values,
    simulate,
    stage_send_times,
)

POLICIES = SCHEDULE_POLICIES
DEFAULT_SLACKS: tuple[int | None, ...] = (0, 2, None)
"""In-flight slacks :func:`choose_schedule` tries for the adaptive policy (``None``: memory only)."""


def gpipe(
    num_micro_batches: int, num_stages: int, order: Sequence[int] | None = None, *, links: Sequence[int] = ()
) -> ComputeSchedule:
    """All forwards, then all backwards, in ``order`` on every stage (a token-slice chain's backwards
    in reverse slice order; ``links``: see :mod:`dynabatch.schedule.chains`)."""
    links = check_links(links, num_micro_batches)
    order = _check_order(order, num_micro_batches, num_stages, links)
    return _schedule(_gpipe_codes(order, num_stages, links), num_micro_batches, "gpipe")


def one_f_one_b(
    num_micro_batches: int, num_stages: int, order: Sequence[int] | None = None, *, links: Sequence[int] = ()
) -> ComputeSchedule:
    """1F1B: stage ``s`` warms up with ``min(S - s, M)`` forwards, then alternates B and F, then drains.

    For ``S = 2, M = 3``: stage 0 ``F0 F1 B0 F2 B1 B2``, stage 1 ``F0 B0 F1 B1 F2 B2``. With token-slice
    chains (``links``) the fixed pattern cannot hold (a chain's first backward needs all its forwards),
    so it is the list schedule with the same in-flight cap of ``S - s`` micro-batches, exceeded only
    by the slices of a chain in flight, on unit op times.
    """
    links = check_links(links, num_micro_batches)
    order = _check_order(order, num_micro_batches, num_stages, links)
    return _schedule(_1f1b_codes(order, num_stages, links), num_micro_batches, "1f1b")


def adaptive(
    costs: StageCosts,
    memory_limit_bytes=None,
    *,
    order: Sequence[int] | None = None,
    send_time: SendTime = None,
    model_state_bytes=0.0,
    in_flight_slack: int | None = None,
    lookahead: int = 1,
    links: Sequence[int] = (),
) -> ComputeSchedule:
    """Memory-aware list schedule (see the module docstring); ``memory_limit_bytes`` is per device,
    model states included, a scalar or one value per stage; ``None`` means unlimited.

    ``lookahead`` > 1 lets stage 0 admit a later micro-batch of ``order`` when the next one does not
    fit (later stages follow stage 0's order). ``links``: token-slice chains
    (:mod:`dynabatch.schedule.chains`); a stage admits a chain's next slice right after the previous
    one (so a chain never waits behind the memory check it was planned under) and runs a chain's
    backwards in reverse slice order.
    """
    num_stages, num_mb = check_costs(costs)
    links = check_links(links, num_mb)
    order = _check_order(order, num_mb, num_stages, links)
    _check_slack(in_flight_slack)
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
        raise ValueError(f"lookahead must be an int >= 1, got {lookahead!r}")
    inputs = _Inputs.make(costs, send_time, model_state_bytes, memory_limit_bytes, links)
    codes = inputs.adaptive_codes(order, in_flight_slack, lookahead)
    return _schedule(codes, num_mb, _adaptive_name(in_flight_slack))


def candidate_orders(costs: StageCosts, *, num_random: int = 2, seed: int = 0) -> list[tuple[int, ...]]:
    """Distinct micro-batch orders worth trying, most promising first (deterministic for ``seed``)."""
    _, num_mb = check_costs(costs)
    t = (np.asarray(costs.fwd_s) + np.asarray(costs.bwd_s)).max(axis=0)  # (M,) bottleneck time
    ident = list(range(num_mb))
    slow_first = [int(i) for i in np.argsort(-t, kind="stable")]
    fast_first = slow_first[::-1]
    orders = [ident, slow_first, fast_first]
    if num_mb >= 3:
        a, z = fast_first[0], fast_first[1]
        middle = [m for m in slow_first if m not in (a, z)]
        orders.append([a] + middle + [z])
        orders.append([a] + [m for m in ident if m not in (a, z)] + [z])
    rng = np.random.default_rng(seed)
    orders += [[int(i) for i in rng.permutation(num_mb)] for _ in range(num_random)]
    seen, out = set(), []
    for o in orders:
        if tuple(o) not in seen:
            seen.add(tuple(o))
            out.append(tuple(o))
    return out


def choose_schedule(
    costs: StageCosts,
    memory_limit_bytes=None,
    *,
    send_time: SendTime = None,
    model_state_bytes=0.0,
    policies: Sequence[str] = POLICIES,
    adaptive_slacks: Sequence[int | None] = DEFAULT_SLACKS,
    orders: Sequence[Sequence[int]] | None = None,
    num_random_orders: int = 2,
    num_search_steps: int = 24,
    seed: int = 0,
    links: Sequence[int] = (),
) -> tuple[ComputeSchedule, SimResult]:
    """The policy and micro-batch order with the smallest simulated makespan that fits memory.

    Candidates: ``policies`` x ``orders`` (default :func:`candidate_orders`), the adaptive policy once
    per slack in ``adaptive_slacks``; then ``num_search_steps`` seeded moves (swap two micro-batches or
    move one to the front or the back) on the best candidate's order, each kept if it lowers the
    makespan and still fits. When nothing fits, the candidate with the smallest memory overflow wins.
    Every order keeps token-slice chains (``links``) together (:func:`~dynabatch.schedule.chains.chain_order`).
    Returns the schedule and its full simulation.
    """
    num_stages, num_mb = check_costs(costs)
    links = check_links(links, num_mb)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"unknown policies {unknown or list(policies)}; valid: {', '.join(POLICIES)}")
    if num_search_steps < 0 or num_random_orders < 0:
        raise ValueError(
            f"num_search_steps and num_random_orders must be >= 0, got {num_search_steps} and {num_random_orders}"
        )
    for slack in adaptive_slacks:
        _check_slack(slack)
    inputs = _Inputs.make(costs, send_time, model_state_bytes, memory_limit_bytes, links)
    variants = [(p, None) for p in policies if p != "adaptive"]
    if "adaptive" in policies:
        variants += [("adaptive", slack) for slack in adaptive_slacks]
    if orders is None:
        orders = candidate_orders(costs, num_random=num_random_orders, seed=seed)
    orders = [_check_order(o, num_mb, num_stages, links) for o in orders]

    best = None  # (score, variant, order, codes)
    for order in orders:
        for variant in variants:
            codes = inputs.codes(variant, order)
            score = inputs.score(codes)
            if best is None or score < best[0]:
                best = (score, variant, order, codes)
    score, variant, order, codes = best
    rng = np.random.default_rng(seed + 1)
    for _ in range(num_search_steps if num_mb >= 2 else 0):
        trial_order = chain_order(_move(list(order), rng), links)
        trial = inputs.codes(variant, trial_order)
        trial_score = inputs.score(trial)
        if trial_score < score:
            score, order, codes = trial_score, trial_order, trial
    name = variant[0] if variant[0] != "adaptive" else _adaptive_name(variant[1])
    schedule = _schedule(codes, num_mb, name)
    result = simulate(schedule, costs, send_time=inputs.send_array, model_state_bytes=model_state_bytes,
                      memory_limit_bytes=memory_limit_bytes)
    return schedule, result


@dataclass(frozen=True)
class _Inputs:
    """Costs as float64 arrays ``(S, M)``, as the numba kernels take them (:mod:`dynabatch.schedule._kernels`)."""

    fwd: np.ndarray
    bwd: np.ndarray
    stored: np.ndarray
    peak: np.ndarray
    send: np.ndarray
    states: np.ndarray
    limit: np.ndarray | None
    links: tuple[int, ...] = ()
    prev: np.ndarray | None = None
    """Each micro-batch's previous token slice (-1: none)."""
    nxt: np.ndarray | None = None
    """Each micro-batch's next token slice (-1: none)."""

    @property
    def send_array(self) -> np.ndarray:
        return self.send

    @staticmethod
    def make(costs: StageCosts, send_time, model_state_bytes, memory_limit_bytes, links=()) -> "_Inputs":
        num_stages, _ = check_costs(costs)
        send = stage_send_times(costs, send_time)
        states = per_stage_values(model_state_bytes, num_stages, "model_state_bytes")
        limit = None if memory_limit_bytes is None else per_stage_values(memory_limit_bytes, num_stages,
                                                                         "memory_limit_bytes")
        fwd, bwd, stored, peak = (np.ascontiguousarray(x, dtype=np.float64)
                                  for x in (costs.fwd_s, costs.bwd_s, costs.stored_bytes, costs.peak_bytes))
        num_mb = fwd.shape[1]
        prev = np.asarray(links if links else (-1,) * num_mb, dtype=np.int64)
        nxt = np.full(num_mb, -1, dtype=np.int64)
        for m, n in (successors(links).items() if links else ()):
            nxt[m] = n
        return _Inputs(fwd, bwd, stored, peak, np.ascontiguousarray(send, dtype=np.float64),
                       np.asarray(states, dtype=np.float64), limit, tuple(links), prev, nxt)

    def codes(self, variant: tuple[str, int | None], order: list[int]) -> np.ndarray:
        policy, slack = variant
        if policy == "gpipe":
            return _gpipe_codes(order, len(self.fwd), self.links)
        if policy == "1f1b":
            return _1f1b_codes(order, len(self.fwd), self.links)
        return self.adaptive_codes(order, slack)

    def adaptive_codes(self, order: list[int], slack: int | None, lookahead: int = 1) -> np.ndarray:
        num_stages = len(self.fwd)
        caps = None if slack is None else [num_stages - s + slack for s in range(num_stages)]
        return _list_schedule(order, self, caps, lookahead)

    def score(self, codes: np.ndarray) -> tuple[float, float]:
        """(memory overflow over the limit, makespan): smaller is better."""
        _, ends, _ = _kernels.replay(codes, self.fwd, self.bwd, self.send)
        makespan = float(ends.max())
        if self.limit is None:
            return 0.0, makespan
        mem, _ = _kernels.op_memory(codes, self.stored, self.peak, self.states)
        over = float((mem.max(axis=1) - self.limit).max())
        return max(over, 0.0), makespan


def _move(order: list[int], rng: np.random.Generator) -> list[int]:
    """A random neighbour: swap two positions, or move one micro-batch to the front or the back."""
    i, j = (int(x) for x in rng.choice(len(order), size=2, replace=False))
    kind = int(rng.integers(3))
    if kind == 0:
        order[i], order[j] = order[j], order[i]
    else:
        m = order.pop(i)
        order.insert(0 if kind == 1 else len(order), m)
    return order


def _list_schedule(order, inputs: _Inputs, caps=None, lookahead: int = 1) -> np.ndarray:
    """Per-stage op codes (``2 m + 1`` for backward) of the adaptive policy, by joint simulation in time.

    Stage 0 may admit any of the next ``lookahead`` micro-batches of ``order`` (the first that fits);
    later stages run forwards in the order stage 0 did. Each stage keeps its next decision (time and
    forward candidate); only the stage that ran an op and the neighbour it sent to are re-evaluated.

    Token-slice chains (``links``): the slice after one just admitted is admitted next, whatever the
    memory check or cap says (the planner sized the chain to fit; refusing it would stall the stage
    holding its earlier slices), and a slice's backward becomes ready only once the backward of the
    slice extending it ran on the same stage.
    """
    num_stages, num_mb = inputs.fwd.shape
    limit = np.full(num_stages, np.inf) if inputs.limit is None else np.asarray(inputs.limit, dtype=np.float64)
    caps = np.full(num_stages, -1, dtype=np.int64) if caps is None else np.asarray(caps, dtype=np.int64)
    out, done = _kernels.adaptive_codes(np.asarray(order, dtype=np.int64), inputs.fwd, inputs.bwd, inputs.stored,
                                        inputs.peak, inputs.send, inputs.states, limit, caps, int(lookahead),
                                        inputs.prev, inputs.nxt)
    assert done.min() == 2 * num_mb, "adaptive list schedule stalled"  # a stage holding nothing always admits
    return out


def _gpipe_codes(order: list[int], num_stages: int, links=()) -> np.ndarray:
    ops = [2 * m for m in order] + [2 * m + 1 for m in backward_order(order, links)]
    return np.tile(np.asarray(ops, dtype=np.int64), (num_stages, 1))


def _1f1b_codes(order: list[int], num_stages: int, links=()) -> np.ndarray:
    num_mb = len(order)
    if any(p >= 0 for p in links):
        unit, zero = np.ones((num_stages, num_mb)), np.zeros((num_stages, num_mb))
        inputs = _Inputs.make(StageCosts(unit, 2 * unit, zero, zero, zero), None, 0.0, None, links)
        return _list_schedule(order, inputs, [num_stages - s for s in range(num_stages)])
    out = []
    for s in range(num_stages):
        warm = min(num_stages - s, num_mb)
        ops = [2 * m for m in order[:warm]]
        for i in range(num_mb - warm):
            ops += [2 * order[i] + 1, 2 * order[warm + i]]
        ops += [2 * m + 1 for m in order[num_mb - warm :]]
        out.append(ops)
    return np.asarray(out, dtype=np.int64).reshape(num_stages, 2 * num_mb)


def _schedule(codes: np.ndarray, num_micro_batches: int, policy: str) -> ComputeSchedule:
    stages = tuple(tuple(ComputeOp(_PHASES[c & 1], c >> 1) for c in ops) for ops in codes.tolist())
    return ComputeSchedule(stages, num_micro_batches, policy=policy)


def _adaptive_name(slack: int | None) -> str:
    return "adaptive" if slack is None else f"adaptive+{slack}"


def _check_slack(slack) -> None:
    if slack is not None and (isinstance(slack, bool) or not isinstance(slack, (int, np.integer)) or slack < 0):
        raise ValueError(f"in_flight_slack must be None or an int >= 0, got {slack!r}")


def _check_order(order, num_micro_batches: int, num_stages: int, links=()) -> list[int]:
    for name, v in (("num_micro_batches", num_micro_batches), ("num_stages", num_stages)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if order is None:
        return chain_order(range(num_micro_batches), links)
    out = [int(m) for m in order]
    if sorted(out) != list(range(num_micro_batches)):
        raise ValueError(f"order must be a permutation of 0..{num_micro_batches - 1}, got {out}")
    return chain_order(out, links)


_PHASES = (Phase.FORWARD, Phase.BACKWARD)
