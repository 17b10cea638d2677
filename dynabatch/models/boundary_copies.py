"""The copies of neighbouring layer units a stage holds under moving boundaries, and which units it runs per move.

With moving boundaries (:mod:`dynabatch.cost.boundary_moves`) the unit on either side of a cut is held by both
stages and each micro-batch says where it runs. A stage built with ``moving_boundaries=True``
(:func:`dynabatch.models.split.build_stage`) therefore also holds, as submodules:

* ``moved_down``: a copy of the previous stage's last unit, where that may move down to it (run first, before the
  stage's own units, for a micro-batch whose move at the boundary below is ``DOWN``);
* ``moved_up``: a copy of the next stage's first unit, where that may move up to it (run last, after its own units,
  for a micro-batch whose move at the boundary above is ``UP``).

A unit is what the stage's family runs for one layer kind of the stack (a whole HF block, or the half of one,
:mod:`~dynabatch.models.block_parts`, T5's encoder halves): the copy is the neighbour's very module, referenced
from the model and deep-copied with the rest of the stage, so ``parameter_map`` maps its parameters to the
original names. Because a unit runs on exactly one side per micro-batch, summing the two copies' gradients gives
the unsplit model's gradient; both copies are reported by ``tied_parameters()`` under the original parameter name
(the same on both stages), so the runtime sums them like any tied parameter and both take the same optimizer
step. A copy no micro-batch of a step ran has no gradient; the runtime's tied sum counts it as zeros.

The stage runs a copy like its own units, through :func:`~dynabatch.models.recompute.run_block` (activation
recomputation applies to it alike). Attention layers keep their ``layer_idx`` in the copy, so a token slice's
key/value cache, keyed by the ``layer_idx`` of the units the stage runs for the slice, finds the unit whichever side
runs it (a sample's slices share one row of moves, so a chain's context stays on one stage).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from dynabatch.cost.boundary_moves import DOWN, STAY, UP, BoundaryUnits, boundary_units


@dataclass(frozen=True)
class BoundarySides:
    """What one stage holds and lends at its two boundaries (module docstring)."""

    moved_down: bool
    """Holds a copy of the previous stage's last unit (its move at the boundary below may be ``DOWN``)."""
    moved_up: bool
    """Holds a copy of the next stage's first unit (its move at the boundary above may be ``UP``)."""
    lends_first: bool
    """Its own first unit may run on the previous stage (move ``UP`` below)."""
    lends_last: bool
    """Its own last unit may run on the next stage (move ``DOWN`` above)."""


NO_SIDES = BoundarySides(False, False, False, False)
"""A stage built without moving boundaries: it holds no copies and lends nothing."""


def boundary_sides(layout, stage: int, units: BoundaryUnits | None = None) -> BoundarySides:
    """Stage ``stage``'s :class:`BoundarySides` in ``layout`` (from
    :func:`~dynabatch.cost.boundary_moves.boundary_units`)."""
    units = units or boundary_units(layout)
    below, above = stage > 0, stage < layout.num_stages - 1
    return BoundarySides(
        moved_down=below and units.down[stage - 1],
        moved_up=above and units.up[stage],
        lends_first=below and units.up[stage - 1],
        lends_last=above and units.down[stage],
    )


def hold_copies(stage: nn.Module, parts_of: Callable[[int], Sequence[nn.Module]]) -> None:
    """Register ``stage.moved_down`` / ``stage.moved_up`` where its :attr:`boundary_sides` says it holds them.

    ``parts_of(i)``: the unit modules stage ``i`` runs for its own units of the movable stack, referencing the
    model's submodules (the deep copy in :func:`~dynabatch.models.split.build_stage` makes them the stage's own).
    """
    sides, s = stage.boundary_sides, stage.stage_index
    if sides.moved_down:
        stage.moved_down = parts_of(s - 1)[-1]
    if sides.moved_up:
        stage.moved_up = parts_of(s + 1)[0]


def units_to_run(stage: nn.Module, moves: tuple[int, int]) -> Sequence[nn.Module]:
    """The unit modules ``stage`` runs, in order, for a micro-batch with ``moves = (lower, upper)``: exactly
    :func:`~dynabatch.cost.boundary_moves.run_kinds` for its units of the movable stack (its own are
    ``stage.movable_units()``).

    ``lower == DOWN`` runs ``moved_down`` first, ``lower == UP`` skips the first own unit (the previous stage ran
    it), ``upper == DOWN`` skips the last own unit (the next stage runs it), ``upper == UP`` runs ``moved_up``
    last. A move the stage holds no copy for, or lends no unit for, is a ``ValueError``.
    """
    lower, upper = moves
    own = stage.movable_units()
    if lower == STAY and upper == STAY:
        return own
    sides, s = stage.boundary_sides, stage.stage_index
    for move, where, exists in ((lower, "below", s > 0), (upper, "above", s < stage.num_stages - 1)):
        if move not in (DOWN, STAY, UP):
            raise ValueError(f"stage {s}: the move at the boundary {where} must be -1, 0 or 1, got {move!r}")
        if move != STAY and not exists:
            raise ValueError(f"stage {s} has no boundary {where}: its move there must be 0, got {move}")
    checks = (
        (lower == DOWN, sides.moved_down, f"holds no copy of stage {s - 1}'s last unit (move DOWN below)"),
        (lower == UP, sides.lends_first, f"may not lend its first unit to stage {s - 1} (move UP below)"),
        (upper == DOWN, sides.lends_last, f"may not lend its last unit to stage {s + 1} (move DOWN above)"),
        (upper == UP, sides.moved_up, f"holds no copy of stage {s + 1}'s first unit (move UP above)"),
    )
    for asked, held, what in checks:
        if asked and not held:
            built = "" if stage.moving_boundaries else "; it was built without moving_boundaries"
            raise ValueError(f"stage {s} {what}: the layout does not allow that move{built}")
    units = list(own)[1 if lower == UP else 0: len(own) - (1 if upper == DOWN else 0)]
    head = [stage.moved_down] if lower == DOWN else []
    tail = [stage.moved_up] if upper == UP else []
    return head + units + tail


def moving_parameters(stage: nn.Module) -> dict[str, nn.Parameter]:
    """Stage-local name -> parameter of every unit that may run on either side of a boundary of ``stage``: its
    own lent first/last unit and its copies."""
    sides, own = stage.boundary_sides, stage.movable_units()
    modules = [own[0]] if sides.lends_first else []
    modules += [own[-1]] if sides.lends_last else []
    modules += [stage.moved_down] if sides.moved_down else []
    modules += [stage.moved_up] if sides.moved_up else []
    ids = {id(p) for m in modules for p in m.parameters()}
    return {name: p for name, p in stage.named_parameters() if id(p) in ids}


def boundary_tied_parameters(stage: nn.Module) -> dict[str, nn.Parameter]:
    """:func:`moving_parameters` keyed by the original parameter name (``stage.parameter_map``), the tied group
    name both stages holding the unit report."""
    return {stage.parameter_map[name]: p for name, p in moving_parameters(stage).items()}


__all__ = ["BoundarySides", "NO_SIDES", "boundary_sides", "hold_copies", "units_to_run", "moving_parameters",
           "boundary_tied_parameters"]
