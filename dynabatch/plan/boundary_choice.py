"""Choosing each micro-batch's side of every movable stage boundary (:mod:`dynabatch.cost.boundary_moves`).

Two choosers (:data:`MOVE_CHOOSERS`), each a different reading of what makes a pipeline step short; the planner
prices the step with each one's moves and with none, and runs the one its schedule simulates shortest.

**Stage sums** (:func:`choose_moves`). A replica's step is about as long as its busiest stage's summed forward +
backward time (the bottleneck the pipeline's other stages wait on); the moves lower that maximum, greedily:

* Start with every micro-batch at the layout's cut (all zeros).
* Visit the boundaries in order, a few passes (:data:`PASSES`, until a pass changes nothing). At boundary ``s``
  the moves at the other boundaries stay fixed, so only stages ``s`` and ``s + 1`` change: while one of them is
  busier, the micro-batches (a token-slice chain counts as one, its slices share a move row) that may step one
  notch towards the other side (``+1 -> 0 -> -1`` sends work down, the other way up) are tried biggest unit time
  first (ties by index), and a step is kept only where it lowers the larger of the two stages' sums.
* Every kept step lowers the larger of two stages and leaves the others, so the bottleneck never rises; the
  result is compared with all zeros at the end all the same, and all zeros is returned where it is not better.

Each stage's sum carries a *lead* (:func:`pipeline_leads`): the time it waits however the work is split, for the
first micro-batch's forwards on the stages before it and, at the end of the step, for their backwards of the last
one. Even sums would leave the later stages idle for that long; the lead keeps them lighter by it (measured on 2
CPU stages, balancing the sums alone turned 3% of balance into 2% more idle time).

**Each micro-batch** (:func:`balance_each`). Even sums still leave waits when the micro-batches differ: on 2
CPU stages, the moves that evened the sums left each stage waiting on the other in turn (a long sample's
attention heavy on the first stage, then a short one's output head on the second), and the step was no shorter
(``docs/benchmarks/long_tail/``). A pipeline flows without waits where every micro-batch takes as long on one
stage as on the next, so this chooser gives each micro-batch (a token-slice chain as one) the moves that lower its
own slowest stage's time, boundary by boundary (the other boundaries' moves fixed, a few passes); ties keep the
smaller move. The sums even out as a consequence, not as the target.

Deterministic: the order of visits and ties depends on indices only.
"""

from __future__ import annotations

import numpy as np

from dynabatch.cost.boundary_moves import BoundaryUnits, stage_columns
from dynabatch.cost.boundary_prices import allowed_moves, move_ratios, move_times, moved_costs

PASSES = 3
"""Passes over the boundaries at most."""
TOLERANCE = 1e-12
"""A step is kept where it lowers the pair's larger sum by more than this fraction of it (no float churn)."""


def chain_groups(num_micro_batches: int, links=()) -> np.ndarray:
    """``(M,)`` group of each micro-batch: the first slice of its token-slice chain (``links``, ``-1``: no
    predecessor, :mod:`dynabatch.schedule.chains`), or itself."""
    if links is None or len(links) == 0:
        return np.arange(num_micro_batches)
    return np.array([_head(links, m) for m in range(num_micro_batches)])


def _head(links, m: int) -> int:
    while links[m] >= 0:
        m = links[m]
    return m


def bottleneck(times: dict[tuple[int, int, int], np.ndarray], moves: np.ndarray, num_stages: int,
               lead: np.ndarray | None = None) -> float:
    """The largest stage's summed time of micro-batches with ``moves`` (``times``: :func:`~dynabatch.cost.
    boundary_prices.move_times`), each stage's ``lead`` (:func:`pipeline_leads`) added."""
    sums = stage_sums(times, moves, num_stages)
    return float((sums if lead is None else sums + lead).max())


def pipeline_leads(costs) -> np.ndarray:
    """``(S,)`` the time each stage waits whatever the split (module docstring): the forwards of the first
    micro-batch on the stages before it and the backwards of the last one there (execution order, at the cuts)."""
    fwd, bwd = np.asarray(costs.fwd_s, dtype=np.float64), np.asarray(costs.bwd_s, dtype=np.float64)
    if fwd.ndim != 2 or fwd.shape[1] == 0:
        return np.zeros(fwd.shape[0] if fwd.ndim else 0)
    edge = fwd[:, 0] + bwd[:, -1]  # (S,)
    return np.concatenate([[0.0], np.cumsum(edge)[:-1]])


def stage_sums(times, moves: np.ndarray, num_stages: int) -> np.ndarray:
    """``(S,)`` each stage's summed time of micro-batches with ``moves`` ``(M, S - 1)``."""
    moves = np.asarray(moves)
    out = np.zeros(num_stages)
    for s in range(num_stages):
        lo, up = stage_columns(moves, s, num_stages)
        for (stage, lower, upper), t in times.items():
            if stage == s:
                out[s] += float(t[(lo == lower) & (up == upper)].sum())
    return out


def choose_moves(times: dict[tuple[int, int, int], np.ndarray], units: BoundaryUnits, num_micro_batches: int,
                 links=(), lead: np.ndarray | None = None) -> np.ndarray:
    """``(M, S - 1)`` ``int8`` moves of one replica's micro-batches lowering its bottleneck stage's summed time
    (module docstring). ``times``: ``(stage, lower, upper) -> (M,)`` fwd + bwd seconds for every pair of moves
    ``units`` allows (:func:`~dynabatch.cost.boundary_prices.move_times`); ``links``: token-slice links (the
    slices of a chain get one move row); ``lead``: ``(S,)`` seconds each stage waits whatever the split
    (:func:`pipeline_leads`; ``None``: none)."""
    num_stages = units.num_boundaries + 1
    lead = np.zeros(num_stages) if lead is None else np.asarray(lead, dtype=np.float64)
    zeros = np.zeros((num_micro_batches, num_stages - 1), dtype=np.int8)
    if not units.any or num_micro_batches == 0:
        return zeros
    index, gtimes = _grouped(times, num_micro_batches, links)
    gmoves = np.zeros((int(index.max()) + 1, num_stages - 1), dtype=np.int8)
    for _ in range(PASSES):
        changed = False
        for s in range(num_stages - 1):
            changed |= _balance(gtimes, gmoves, units, s, num_stages, lead)
        if not changed:
            break
    moves = gmoves[index]
    if bottleneck(times, moves, num_stages, lead) > bottleneck(times, zeros, num_stages, lead):
        return zeros
    return moves


def balance_each(times: dict[tuple[int, int, int], np.ndarray], units: BoundaryUnits, num_micro_batches: int,
                 links=(), lead: np.ndarray | None = None) -> np.ndarray:
    """``(M, S - 1)`` ``int8`` moves giving each micro-batch (a token-slice chain as one, ``links``) the sides that
    lower its own slowest stage's time (module docstring); ``times`` as :func:`choose_moves` takes them; ``lead``
    is not used (the waits it stands for are the same whatever each micro-batch's sides)."""
    num_stages = units.num_boundaries + 1
    moves = np.zeros((num_micro_batches, num_stages - 1), dtype=np.int8)
    if not units.any or num_micro_batches == 0:
        return moves
    index, gtimes = _grouped(times, num_micro_batches, links)
    n = int(index.max()) + 1
    gmoves = np.zeros((n, num_stages - 1), dtype=np.int8)
    rows = np.arange(n)
    for _ in range(PASSES):
        changed = False
        for s in range(num_stages - 1):
            allowed = allowed_moves(units, s)
            if len(allowed) == 1:
                continue
            upper_t, lower_t = _pair_times(gtimes, gmoves, allowed, s, num_stages)
            slowest = np.where(np.isnan(upper_t) | np.isnan(lower_t), np.inf, np.fmax(upper_t, lower_t))  # (n, 3)
            order = np.array([1, 0, 2])  # ties: stay, then down, then up
            best = order[np.argmin(slowest[:, order], axis=1)] - 1
            cur = gmoves[:, s].astype(np.int64)
            better = slowest[rows, best + 1] < slowest[rows, cur + 1] * (1 - TOLERANCE)
            if better.any():
                gmoves[better, s] = best[better]
                changed = True
        if not changed:
            break
    return gmoves[index]


def _grouped(times, num_micro_batches: int, links) -> tuple[np.ndarray, dict]:
    """``(M,)`` group index of each micro-batch (its token-slice chain) and ``times`` summed per group."""
    group = chain_groups(num_micro_batches, links)
    heads = np.unique(group)
    index = np.searchsorted(heads, group)
    return index, {key: np.bincount(index, weights=np.asarray(t, dtype=np.float64), minlength=len(heads))
                   for key, t in times.items()}


def _pair_times(gtimes, gmoves: np.ndarray, allowed, s: int, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """``(n, 3)`` each group's time on stage ``s`` and on stage ``s + 1`` for every move ``v`` at boundary ``s``
    (column ``v + 1``; NaN where not allowed), the groups' moves at the other boundaries fixed."""
    n = len(gmoves)
    lo = gmoves[:, s - 1] if s > 0 else np.zeros(n, np.int8)
    up = gmoves[:, s + 1] if s + 1 < num_stages - 1 else np.zeros(n, np.int8)
    upper_t = np.full((n, 3), np.nan)
    lower_t = np.full((n, 3), np.nan)
    for v in allowed:
        upper_t[:, v + 1] = _pick(gtimes, s, lo, np.full(n, v), n)
        lower_t[:, v + 1] = _pick(gtimes, s + 1, np.full(n, v), up, n)
    return upper_t, lower_t


def _balance(gtimes, gmoves: np.ndarray, units: BoundaryUnits, s: int, num_stages: int, lead: np.ndarray) -> bool:
    """Steps at boundary ``s`` (groups' moves ``gmoves``, changed in place) that lower the larger of stages ``s``
    and ``s + 1`` (module docstring); whether any was kept."""
    n = len(gmoves)
    allowed = allowed_moves(units, s)
    if len(allowed) == 1:
        return False
    # per group and move v at s: its time on stage s (lower fixed, upper v) and on stage s + 1 (lower v, upper fixed)
    upper_t, lower_t = _pair_times(gtimes, gmoves, allowed, s, num_stages)
    rows = np.arange(n)
    cur = gmoves[:, s].astype(np.int64)
    a = float(upper_t[rows, cur + 1].sum()) + float(lead[s])
    b = float(lower_t[rows, cur + 1].sum()) + float(lead[s + 1])
    changed = False
    for _ in range(2 * len(allowed)):  # each round steps every group at most one notch, one direction
        step = -1 if a > b else 1  # towards the lighter side: down sends stage s's work to s + 1
        target = cur + step
        ok = (target >= -1) & (target <= 1)
        ok[ok] = ~np.isnan(upper_t[rows[ok], target[ok] + 1])
        cand = np.flatnonzero(ok)
        if not len(cand):
            break
        da = upper_t[cand, target[cand] + 1] - upper_t[cand, cur[cand] + 1]
        db = lower_t[cand, target[cand] + 1] - lower_t[cand, cur[cand] + 1]
        size = np.abs(da if step < 0 else db)  # the unit time leaving the busier side
        kept = False
        for i in np.lexsort((cand, -size)):  # biggest first, ties by index
            g = cand[i]
            if cur[g] + step != target[g]:
                continue
            worst = max(a, b)
            na, nb = a + da[i], b + db[i]
            if max(na, nb) < worst * (1 - TOLERANCE):
                a, b, cur[g] = na, nb, target[g]
                kept = changed = True
                if (na > nb) != (step < 0):  # the busier side flipped: steps this way only make it worse
                    break
        if not kept:
            break
    gmoves[:, s] = cur
    return changed


def _pick(gtimes, stage: int, lower: np.ndarray, upper: np.ndarray, n: int) -> np.ndarray:
    """``(n,)`` each group's time on ``stage`` with its own ``(lower, upper)``; NaN where that pair is not priced."""
    out = np.full(n, np.nan)
    for (st, lo, up), t in gtimes.items():
        if st == stage:
            where = (lower == lo) & (upper == up)
            out[where] = t[where]
    return out


MOVE_CHOOSERS = {"stage_sums": choose_moves, "each_micro_batch": balance_each}
"""The choosers by name (module docstring): what :func:`with_moves` and
:func:`~dynabatch.plan.slice_costs.piece_costs` take as ``moves``; the planner prices each."""


def with_moves(stage_model, costs, shapes, pairs=None, links=(), moves: np.ndarray | str = "stage_sums"):
    """One replica's ``costs`` (:class:`~dynabatch.cost.stages.StageCosts` as laid out, of micro-batches of padded
    ``shapes`` ``(M, 3)``, ``pairs`` as they were priced with) with each micro-batch's moves (``moves``, or chosen
    with ``links`` by the chooser of that name in :data:`MOVE_CHOOSERS`) and the costs they run at
    (:func:`~dynabatch.cost.boundary_prices.moved_costs`). ``costs`` unchanged where the layout allows no move."""
    arr = np.asarray(shapes, dtype=np.float64).reshape(-1, 3)
    ratios = move_ratios(stage_model, arr[:, 0], arr[:, 1], arr[:, 2], pairs)
    if not ratios.units.any:
        return costs
    if isinstance(moves, str):
        if moves not in MOVE_CHOOSERS:
            raise ValueError(f"unknown boundary move chooser {moves!r}; valid: {', '.join(MOVE_CHOOSERS)}")
        moves = MOVE_CHOOSERS[moves](move_times(costs, ratios), ratios.units, len(arr), links, pipeline_leads(costs))
    return moved_costs(costs, ratios, moves)


__all__ = ["MOVE_CHOOSERS", "PASSES", "balance_each", "bottleneck", "chain_groups", "choose_moves", "pipeline_leads",
           "stage_sums", "with_moves"]
