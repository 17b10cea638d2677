"""The step formula: a plan's predicted step ``sum(t) + (S - 1) max(t)`` on its slowest replica, every whole-sample
piece priced by the cost model, ``inf`` where a piece breaks the partition DP's memory rule: the price ``dynabatch
plan`` compares plans by (it has no schedule simulator), and the price of the baseline candidates
(:mod:`dynabatch.plan.candidates`). Also a lower bound of any schedule's makespan (:func:`step_lower_bound`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dynabatch.cost.pairs import AttentionPairs, fill_work, stacked_pairs
from dynabatch.plan.costs import evaluate_costs
from dynabatch.plan.step import with_pairs
from dynabatch.plan.step_plan import StepPlan


def step_lower_bound(fwd_s, bwd_s) -> float:
    """A lower bound of any pipeline schedule's makespan of micro-batches with per-stage forward and backward
    times ``(S, M)`` (messages free): stage ``s`` computes all its work, its first op starts no earlier than some
    micro-batch's forwards on the stages before it end, and after its last op (a backward) that micro-batch's
    backwards on the stages before it still run."""
    fwd, bwd = np.asarray(fwd_s, dtype=np.float64), np.asarray(bwd_s, dtype=np.float64)
    if fwd.size == 0:
        return 0.0
    work = (fwd + bwd).sum(axis=1)  # (S,)
    head = np.cumsum(fwd, axis=0) - fwd  # (S, M): forwards on the stages before s
    tail = np.cumsum(bwd, axis=0) - bwd  # (S, M): backwards on the stages before s, after s's
    return float((work + head.min(axis=1) + tail.min(axis=1)).max())


def step_formula(replicas, num_stages: int, held: int, budget: float) -> float:
    """The step formula ``sum(t) + (S - 1) max(t)`` of a plan's slowest replica, ``replicas`` giving each non-empty
    replica's piece times and its whole-sample pieces' ``stored`` and ``peak`` (``None`` when it has none); ``inf``
    when a piece breaks ``held * stored + peak <= budget``."""
    worst = 0.0
    for times, stored, peak in replicas:
        if stored is not None and np.any(held * stored + peak > budget):
            return float("inf")
        worst = max(worst, float(times.sum() + (num_stages - 1) * times.max()))
    return worst


def price_micro_batches(cost_model, keys: Sequence, input_lens, target_lens, family: str, work: dict,
                        priced: dict) -> None:
    """Add to ``priced`` the ``(time, stored, peak)`` (floats, :func:`~dynabatch.plan.costs.evaluate_costs`) of each
    micro-batch of ``keys`` (``(rows, shape)``: rows of sample indices, padded shape ``(b, E, D)``) it lacks, with
    the attention pairs, calls and longest segments its rows compute (``work``, filled as needed), all in one
    cost-model call. The cost model prices entries independently, so these are the values any call holding the
    same micro-batch gives: the candidates' pieces and :func:`formula_prices` share them within one global batch."""
    missing = list(dict.fromkeys(k for k in keys if k not in priced))
    if not missing:
        return
    fill_work(work, [rows for rows, _ in missing], input_lens, target_lens, family)
    arr = np.asarray([shape for _, shape in missing], dtype=np.float64).reshape(-1, 3)
    t, stored, peak = evaluate_costs(cost_model, arr[:, 0], arr[:, 1], arr[:, 2],
                                     pairs=stacked_pairs([work[rows] for rows, _ in missing]))
    priced.update(zip(missing, zip(np.asarray(t, dtype=np.float64).tolist(), np.asarray(stored, dtype=np.float64).tolist(),
                                   np.asarray(peak, dtype=np.float64).tolist())))


def formula_price(cost_model, input_lens, target_lens, padding_free: bool = True,
                  in_flight: int | None = None) -> Callable[[StepPlan], float]:
    """The step formula ``sum(t) + (S - 1) max(t)`` of the slowest replica, every whole-sample piece priced by
    ``cost_model`` (with the attention pairs its rows compute when ``padding_free``; dense otherwise): the
    price of ``dynabatch plan``, which has no schedule simulator. ``inf`` when a piece breaks the partition DP's
    own memory rule ``in_flight * stored + peak <= memory_budget_bytes`` (``in_flight`` default ``S``), so a
    baseline's plan is held to the memory the DP's plans fit."""

    def price(plan: StepPlan) -> float:
        return formula_prices(cost_model, input_lens, target_lens, [plan], padding_free, in_flight)[0]

    return price


def formula_prices(cost_model, input_lens, target_lens, plans: Sequence[StepPlan], padding_free: bool = True,
                   in_flight: int | None = None, work: dict | None = None, priced: dict | None = None) -> list[float]:
    """:func:`formula_price` of each of ``plans``, every whole-sample piece of every plan priced in one cost-model
    call (one for the pieces priced with attention pairs, one for those priced dense): the same prices. ``work``:
    as :func:`~dynabatch.plan.candidates.baseline_candidates`'. ``priced`` (padding-free): the micro-batches' prices already known (as
    :func:`~dynabatch.plan.candidates.baseline_candidates` leaves them, :func:`price_micro_batches`); the others are priced in one call and
    added."""
    e, d = np.asarray(input_lens), np.asarray(target_lens)
    budget = float(getattr(cost_model, "memory_budget_bytes", np.inf))
    parts = []  # per plan, per replica: (times, whole, held, pairs or None, rows into the calls' entries)
    queries: dict[bool, list] = {False: [], True: []}  # dense / with pairs: [(shapes (k, 3), pairs or None)]
    counts = {False: 0, True: 0}
    memo = padding_free and priced is not None
    family = plans[0].family if plans else "t5"
    for plan in plans:
        plan = with_pairs(plan, e, d, work) if padding_free and not memo else plan
        held, replicas = in_flight or plan.num_stages, []
        for r, pieces in enumerate(plan.replicas):
            if not pieces:
                continue
            times = np.array([p.time_s for p in pieces])
            whole = np.array([not p.is_slice for p in pieces])
            entry = None
            if memo and whole.any():  # looked up below, by rows and shape
                entry = ("memo", [(p.row_samples, tuple(p.shape)) for p in pieces if not p.is_slice])
            elif whole.any():
                shapes = np.array([p.shape for p in pieces], dtype=np.float64)[whole]
                pairs = plan.pairs(r)
                kind = pairs is not None
                queries[kind].append((shapes, None if pairs is None else pairs[whole]))
                entry = (kind, counts[kind], counts[kind] + len(shapes))
                counts[kind] += len(shapes)
            replicas.append((times, whole, entry))
        parts.append((plan.num_stages, held, replicas))
    results = {}
    for kind, batch in queries.items():
        if not batch:
            continue
        shapes = np.concatenate([s for s, _ in batch])
        pairs = concatenated_pairs([p for _, p in batch]) if kind else None
        results[kind] = evaluate_costs(cost_model, shapes[:, 0], shapes[:, 1], shapes[:, 2], pairs=pairs)
    if memo:
        keys = [k for *_, replicas in parts for *_, entry in replicas if entry is not None for k in entry[1]]
        price_micro_batches(cost_model, keys, e, d, family, {} if work is None else work, priced)
    out = []
    for num_stages, held, replicas in parts:
        priced_replicas = []
        for times, whole, entry in replicas:
            stored = peak = None
            if entry is not None and entry[0] == "memo":
                t, stored, peak = (np.array(a, dtype=np.float64) for a in zip(*(priced[k] for k in entry[1])))
            elif entry is not None:
                kind, lo, hi = entry
                t, stored, peak = (a[lo:hi] for a in results[kind])
            if entry is not None:
                times[whole] = t
            priced_replicas.append((times, stored, peak))
        out.append(step_formula(priced_replicas, num_stages, held, budget))
    return out


def concatenated_pairs(pairs: list):
    """One :class:`~dynabatch.cost.pairs.AttentionPairs` of several (1-D, each with calls and longest segments)."""
    def cat(get):
        return np.concatenate([get(p) for p in pairs])

    return AttentionPairs(cat(lambda p: p.encoder), cat(lambda p: p.decoder), cat(lambda p: p.cross),
                          tuple(cat(lambda p, k=k: p.calls[k]) for k in range(3)),
                          tuple(cat(lambda p, k=k: p.longest[k]) for k in range(2)))


__all__ = ["concatenated_pairs", "formula_price", "formula_prices", "price_micro_batches", "step_formula",
           "step_lower_bound"]
