"""Pricing a planned step by simulating it: the score the step planner's dynamic program and its candidates
are compared by (:func:`simulated_step_time`), the message cost it uses (:func:`send_time_of`), and whether a
plan fits without activation recomputation (:func:`fits_without_recompute`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from dynabatch.cost.stages import StageCostModel, StageCosts
from dynabatch.plan.formula import concatenated_pairs
from dynabatch.plan.costs import evaluate_costs
from dynabatch.plan.boundary_choice import with_moves
from dynabatch.plan.slice_costs import piece_costs
from dynabatch.plan.step import with_pairs
from dynabatch.schedule.policies import adaptive
from dynabatch.schedule.simulate import simulate, with_message_buffers
from dynabatch.schedule.virtual import placed_step


def columns(costs: StageCosts, lo: int, hi: int) -> StageCosts:
    """Micro-batches ``lo:hi`` of per-stage ``costs`` (every array ``(S, M)``; the moves ``(M, S - 1)``)."""
    return StageCosts(*(None if a is None else a[:, lo:hi] for a in (
        costs.fwd_s, costs.bwd_s, costs.stored_bytes, costs.peak_bytes, costs.send_bytes, costs.recompute,
        costs.load_bytes)), moves=None if costs.moves is None else costs.moves[lo:hi])


def replica_columns(stage_model, costs: StageCosts, shapes, pairs, lo: int, hi: int) -> StageCosts:
    """Micro-batches ``lo:hi`` (one replica's) of ``costs`` priced in one call at the layout's cuts, with that replica's
    own boundary moves chosen where ``stage_model`` moves boundaries (:func:`~dynabatch.plan.boundary_choice.with_moves`:
    the moves even out the stages of one replica, not of the call). ``pairs``: the call's, or ``None``."""
    replica = columns(costs, lo, hi)
    if not getattr(stage_model, "moving_boundaries", False):
        return replica
    return with_moves(stage_model, replica, shapes[lo:hi], None if pairs is None else pairs[lo:hi])


def fits_without_recompute(plan, model: StageCostModel) -> bool:
    """Whether every whole-sample piece of ``plan`` fits ``model``'s memory bound without recomputation (the
    planner's maxima over stages, ``S`` in flight); token slices are judged by the slice planner."""

    none = replace(model, recompute="none")
    for r, pieces in enumerate(plan.replicas):
        whole = np.array([not p.is_slice for p in pieces], dtype=bool)
        if not whole.any():
            continue
        shapes = np.array([p.shape for p in pieces], dtype=np.float64)[whole]
        pairs = plan.pairs(r)
        _, stored, peak = evaluate_costs(none, shapes[:, 0], shapes[:, 1], shapes[:, 2],
                                         pairs=None if pairs is None else pairs[whole])
        if np.any(model.num_stages * stored + peak > model.memory_budget_bytes):
            return False
    return True


def send_time_of(stage_model: StageCostModel):
    """Seconds to send a message of ``n`` bytes to a pipeline neighbour, as the layer model prices it
    (the analytic model's intra-node link); ``None`` (free) for a model without link costs."""
    send_time = getattr(stage_model.model, "send_time", None)
    return None if send_time is None else (lambda num_bytes: send_time(num_bytes, "intra"))


def simulated_step_time(stage_model: StageCostModel, slice_model, memory_limit_bytes=None, lengths=None,
                        placement=None):
    """``score(plan)`` for :func:`~dynabatch.plan.step.plan_step`: the simulated makespan of the slowest
    replica under the adaptive schedule (a few ms; the step formula ``sum + (S - 1) max`` misjudges
    token slices, whose chains cannot overlap their own backward). With the step's ``lengths``
    ``(input_lens, target_lens)`` (the padding-free runtime) every piece is priced with the attention
    pairs and calls its rows really compute (:func:`~dynabatch.plan.step.with_pairs`), as the step that
    runs is: the DP prices dense ``b x E^2`` in one call per layer, and with calibrated per-call costs
    (several ms on CPU) a run spanning many lengths costs more than the DP sees. With a ``placement`` of
    virtual stages (``stage_model`` then prices its chunks) the step is ordered on it as the runtime will
    (:func:`~dynabatch.schedule.virtual.placed_step`), not as a pipeline of one chunk per device."""

    states, send = np.array(stage_model.model_state_bytes), send_time_of(stage_model)

    def makespan(costs, links) -> float:
        if placement is not None:
            return placed_step(costs, placement, states, memory_limit_bytes, send, links=links).makespan_s
        costs = with_message_buffers(costs)
        schedule = adaptive(costs, memory_limit_bytes, links=links, model_state_bytes=states, send_time=send)
        return simulate(schedule, costs, model_state_bytes=states, send_time=send).makespan_s

    def score(plan) -> float:
        if lengths is not None:
            plan = with_pairs(plan, *lengths)
        worst = 0.0
        for r in range(len(plan.replicas)):
            links = plan.slice_links(r)
            costs = piece_costs(stage_model, slice_model, [p.shape for p in plan.replicas[r]], plan.contexts(r), links,
                                plan.pairs(r))
            worst = max(worst, makespan(costs, links))
        return worst

    def many(plans) -> list[float]:
        """``score`` of each plan, the whole-sample pieces of all of them priced in one cost-model call (a call is
        milliseconds of Python on the analytic model; the pieces' prices do not depend on one another). Plans with
        token slices are scored one by one."""
        work: dict = {}
        plans = [with_pairs(p, *lengths, work) if lengths is not None else p for p in plans]
        whole = [p for p in plans if not p.sliced_samples]
        pairs = [p.pairs(r) for p in whole for r in range(len(p.replicas))]
        if len(whole) < 2 or len({x is None for x in pairs}) > 1:
            return [score(p) for p in plans]
        shapes = [q.shape for p in whole for pieces in p.replicas for q in pieces]
        joined = None if pairs[0] is None else concatenated_pairs(pairs)
        costs = piece_costs(stage_model, slice_model, shapes, [0] * len(shapes), (), joined, moves=None)
        out, lo = {}, 0
        for p in whole:
            worst = 0.0
            for pieces in p.replicas:
                hi = lo + len(pieces)
                worst = max(worst, makespan(replica_columns(stage_model, costs, shapes, joined, lo, hi), ()))
                lo = hi
            out[id(p)] = worst
        return [out[id(p)] if id(p) in out else score(p) for p in plans]

    score.many = many
    return score
