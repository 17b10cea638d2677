"""What a stage boundary's move does to a micro-batch's per-stage costs (:mod:`dynabatch.cost.boundary_moves`).

With moving boundaries a micro-batch may run the unit beside a cut on either stage, so each stage's time and
memory for it depend on its moves at the boundaries below and above that stage. The layer model prices that
directly: stage ``s`` runs :func:`~dynabatch.cost.boundary_moves.run_kinds` ``(layout, s, lower, upper)``.

A stage model's costs need not be the layer model's own (the online fit, :class:`~dynabatch.cost.online.
CalibratedStageCostModel`, predicts a stage's time from measurements), so a move is priced as a *ratio* of the
layer model's numbers, per stage, per micro-batch and per (lower, upper) pair of moves::

    ratio[s, lower, upper] = stage_cost(run_kinds(layout, s, lower, upper)) / stage_cost(layout.stages[s])

for the forward and backward times, the stored bytes and the peak bytes (:func:`move_ratios`). The moved costs
are the stage model's costs times the ratio of each micro-batch's moves (:func:`moved_costs`): for the layer
model itself exactly ``stage_cost(run_kinds(...))``; for the online fit, the fitted stage time scaled by the share
the unit takes or adds. The peak keeps the safe side (the larger of the laid-out and the moved one) and the bytes
sent downstream are unchanged (the hand-off is the same hidden state whichever side runs the unit). Under
activation recomputation the ratio is the layer model's without it (an approximation: the recomputed share of a
unit is about its share of the stage).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dynabatch.cost.boundary_moves import STAY, BoundaryUnits, boundary_units, run_kinds, stage_columns

RATIO_FIELDS = ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes")
"""The :class:`~dynabatch.cost.stages.StageCosts` fields a move scales."""


def allowed_moves(units: BoundaryUnits, boundary: int) -> tuple[int, ...]:
    """The moves a micro-batch may make at ``boundary`` (``0`` always; ``-1`` / ``+1`` where the layout allows)."""
    return tuple(m for m, ok in ((-1, units.down[boundary]), (STAY, True), (1, units.up[boundary])) if ok)


def stage_move_pairs(units: BoundaryUnits, stage: int) -> tuple[tuple[int, int], ...]:
    """Every ``(lower, upper)`` pair of moves stage ``stage`` may see (``0`` at a boundary it lacks)."""
    num_stages = units.num_boundaries + 1
    lowers = allowed_moves(units, stage - 1) if stage > 0 else (STAY,)
    uppers = allowed_moves(units, stage) if stage < num_stages - 1 else (STAY,)
    return tuple((lo, up) for lo in lowers for up in uppers)


@dataclass(frozen=True)
class MoveRatios:
    """Per stage and ``(lower, upper)`` pair of moves, the layer model's cost of the stage with those moves over its
    cost as laid out, per micro-batch (module docstring)."""

    units: BoundaryUnits
    ratios: dict[tuple[int, int, int], dict[str, np.ndarray]]
    """``(stage, lower, upper) -> {field: (M,) ratio}`` for each field of :data:`RATIO_FIELDS`; ``(s, 0, 0)`` is 1."""
    num_micro_batches: int

    @property
    def num_stages(self) -> int:
        return self.units.num_boundaries + 1

    def of(self, moves: np.ndarray) -> dict[str, np.ndarray]:
        """``{field: (S, M) ratio}`` of each micro-batch's moves (``moves``: ``(M, S - 1)``)."""
        moves = np.asarray(moves, dtype=np.int8).reshape(self.num_micro_batches, self.num_stages - 1)
        out = {f: np.ones((self.num_stages, self.num_micro_batches)) for f in RATIO_FIELDS}
        for (s, lower, upper), r in self.ratios.items():
            lo, up = stage_columns(moves, s, self.num_stages)
            where = (lo == lower) & (up == upper)
            for f in RATIO_FIELDS:
                out[f][s, where] = r[f][where]
        return out


def move_ratios(stage_model, b, E, D, pairs=None) -> MoveRatios:  # noqa: N803
    """:class:`MoveRatios` of micro-batches ``(b, E, D)`` (1-D, ``pairs`` as in :meth:`StageCostModel.per_stage
    <dynabatch.cost.stages.StageCostModel.per_stage>`) under ``stage_model``'s layer model and layout: one
    ``stage_cost`` per stage and pair of moves the layout allows, every layer kind priced once (a model that shares
    its layer costs, the analytic model)."""
    layout, model = stage_model.layout, stage_model.model
    units = boundary_units(layout)
    bb, EE, DD = stage_model._inputs(b, E, D)
    shape = np.shape(bb)
    extra = {} if pairs is None else {"pairs": pairs}
    if getattr(model, "shares_layer_costs", False):
        extra.update(layers={}, flops=False)

    def priced(kinds) -> dict[str, np.ndarray]:
        c = model.stage_cost(list(kinds), bb, EE, DD, **extra)
        values = (c.fwd_time_s, c.bwd_time_s, c.stored_activation_bytes, c.peak_extra_bytes)
        return {f: np.broadcast_to(np.asarray(v, dtype=np.float64), shape) for f, v in zip(RATIO_FIELDS, values)}

    out: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
    for s in range(layout.num_stages):
        pairs_s = stage_move_pairs(units, s)
        if len(pairs_s) == 1:
            continue
        laid = priced(layout.stages[s])
        for lower, upper in pairs_s:
            if (lower, upper) == (STAY, STAY):
                continue
            moved = priced(run_kinds(layout, s, lower, upper))
            out[(s, lower, upper)] = {f: np.where(laid[f] > 0, moved[f] / np.maximum(laid[f], 1e-30), 1.0)
                                      for f in RATIO_FIELDS}
    return MoveRatios(units, out, int(np.prod(shape)) if shape else 1)


def moved_costs(costs, ratios: MoveRatios, moves: np.ndarray):
    """``costs`` (:class:`~dynabatch.cost.stages.StageCosts` of ``(S, M)`` arrays) of micro-batches that run with
    ``moves`` (``(M, S - 1)``, checked against the layout): times and stored bytes scaled by the moves' ratios, the
    peak the larger of the laid-out and the moved one, the bytes sent unchanged; :attr:`StageCosts.moves` set."""
    moves = ratios.units.check(moves)
    r = ratios.of(moves)
    return dataclasses.replace(
        costs, fwd_s=costs.fwd_s * r["fwd_s"], bwd_s=costs.bwd_s * r["bwd_s"],
        stored_bytes=costs.stored_bytes * r["stored_bytes"],
        peak_bytes=np.maximum(costs.peak_bytes, costs.peak_bytes * r["peak_bytes"]), moves=moves)


def move_times(costs, ratios: MoveRatios) -> dict[tuple[int, int, int], np.ndarray]:
    """``(stage, lower, upper) -> (M,)`` forward + backward seconds of each micro-batch on ``stage`` with those
    moves, every pair the layout allows (laid out: ``(s, 0, 0)``), from ``costs`` as laid out: what
    :func:`~dynabatch.plan.boundary_choice.choose_moves` chooses between."""
    out = {}
    for s in range(ratios.num_stages):
        for lower, upper in stage_move_pairs(ratios.units, s):
            r = ratios.ratios.get((s, lower, upper))
            fwd, bwd = np.asarray(costs.fwd_s[s], dtype=np.float64), np.asarray(costs.bwd_s[s], dtype=np.float64)
            out[(s, lower, upper)] = fwd + bwd if r is None else fwd * r["fwd_s"] + bwd * r["bwd_s"]
    return out


def time_ratios(ratios: MoveRatios, moves: np.ndarray) -> np.ndarray:
    """``(S, 2, M)`` forward and backward time ratios of each micro-batch's ``moves`` on every stage: what scales a
    laid-out time to the moved one (the online fit's features of a moved micro-batch, :func:`moved_features`)."""
    r = ratios.of(moves)
    return np.stack([r["fwd_s"], r["bwd_s"]], axis=1)


def moved_features(features: np.ndarray, ratios: MoveRatios, moves: np.ndarray) -> np.ndarray:
    """The online fit's ``(S, 2, M, F)`` ``features`` of micro-batches that ran with ``moves``: each row times its
    stage's and direction's time ratio. A moved micro-batch's predicted time is ``ratio * theta . x`` (the layout's
    prediction scaled, :func:`moved_costs`), so its measurement ``t`` enters the fit as ``(ratio x, t)``; in the
    fit's relative error ``(t - theta . ratio x) / t = (t / ratio - theta . x) / (t / ratio)``, which is the
    measured time divided by the ratio against the layout's features: the fit learns the layout's times."""
    return np.asarray(features) * time_ratios(ratios, moves)[:, :, :, None]


__all__ = ["RATIO_FIELDS", "MoveRatios", "allowed_moves", "move_ratios", "move_times", "moved_costs",
           "moved_features", "stage_move_pairs", "time_ratios"]
