"""Stage boundaries that move per micro-batch: which layer unit may cross each boundary of a linear layout.

One layer split serves every step of a run, and micro-batches differ: a long sample loads the stages that hold
more attention, a batch of short samples the stage with the output head. A split that suits the step's sum can
still leave one device busier than the other on every step (measured on 2 CPU stages: the busier device's compute
5-6% above the mean, ``docs/benchmarks/long_tail/``). With *moving boundaries* the unit on either side of a cut
(a transformer block, or the block half the cut falls beside) is held by both stages, and each micro-batch says on
which side it runs: the planner then evens out the stages' work within every step.

Boundary ``s`` lies between stages ``s`` and ``s + 1``. A micro-batch's move at boundary ``s`` is

* ``0``: the layout's cut;
* ``-1`` (:data:`DOWN`): stage ``s``'s last unit runs on stage ``s + 1`` (before its own first unit);
* ``+1`` (:data:`UP`): stage ``s + 1``'s first unit runs on stage ``s`` (after its own last unit).

A unit may cross a boundary only inside one stack of blocks (a decoder-only model's blocks, or T5's encoder: the
hand-off is the same hidden state either way), and every stage keeps at least one unit of its own: a stage with two
block units lends only its first (up) unless it is the first stage; one with a single block lends nothing. The
gradients of a unit's two copies are summed like any tied parameter, so both take the same optimizer step.

Moves are an ``int8`` array ``(M, S - 1)`` per replica: one row per micro-batch, one column per boundary. The
slices of one sample keep one row of moves (their context's keys and values live on the stage that ran the unit).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynabatch.cost.model_specs import BLOCK_HALVES, BLOCK_KINDS

DOWN, STAY, UP = -1, 0, 1
"""A micro-batch's move at one boundary (module docstring)."""

STACKS: tuple[frozenset[str], ...] = tuple(
    frozenset((block, *BLOCK_HALVES[block])) for block in ("gpt", "t5_encoder"))
"""Layer kinds a unit may cross a boundary within: the blocks (and halves) of one stack, whose hand-off between
stages is the same hidden state whichever side runs the unit."""


def _stack(kind: str) -> frozenset[str] | None:
    return next((s for s in STACKS if kind in s), None)


@dataclass(frozen=True)
class BoundaryUnits:
    """Per boundary ``s`` of a linear layout, whether a unit may cross it each way."""

    down: tuple[bool, ...]
    """Stage ``s``'s last unit may run on stage ``s + 1``."""
    up: tuple[bool, ...]
    """Stage ``s + 1``'s first unit may run on stage ``s``."""

    @property
    def num_boundaries(self) -> int:
        return len(self.down)

    @property
    def any(self) -> bool:
        return any(self.down) or any(self.up)

    def check(self, moves: np.ndarray) -> np.ndarray:
        """``moves`` as an ``int8`` ``(M, S - 1)`` array; ``ValueError`` where one asks for a move the layout does
        not allow."""
        out = np.asarray(moves, dtype=np.int8).reshape(-1, self.num_boundaries)
        for s in range(self.num_boundaries):
            col = out[:, s]
            if not set(np.unique(col).tolist()) <= {DOWN, STAY, UP}:
                raise ValueError(f"boundary {s}: moves must be -1, 0 or 1, got {sorted(set(col.tolist()))}")
            if (col == DOWN).any() and not self.down[s]:
                raise ValueError(f"boundary {s}: stage {s}'s last unit may not run on stage {s + 1}")
            if (col == UP).any() and not self.up[s]:
                raise ValueError(f"boundary {s}: stage {s + 1}'s first unit may not run on stage {s}")
        return out


def boundary_units(layout) -> BoundaryUnits:
    """Which units of ``layout`` (a :class:`~dynabatch.cost.stages.StageLayout`, linear) may cross each boundary
    (module docstring)."""
    stages = [tuple(s) for s in layout.stages]
    blocks = [sum(k in BLOCK_KINDS for k in s) for s in stages]
    down, up = [], []
    for s in range(len(stages) - 1):
        last, first = stages[s][-1], stages[s + 1][0]
        same = _stack(last) is not None and _stack(last) is _stack(first)
        lends_last = blocks[s] >= 3 or (blocks[s] == 2 and s == 0)
        lends_first = blocks[s + 1] >= 2
        down.append(bool(same and lends_last))
        up.append(bool(same and lends_first))
    return BoundaryUnits(tuple(down), tuple(up))


def held_kinds(layout, stage: int, units: BoundaryUnits | None = None) -> tuple[str, ...]:
    """The layer kinds stage ``stage`` holds: its own, with a copy of the previous stage's last unit before them
    where that unit may move down to it, and a copy of the next stage's first unit after them where that may move up."""
    units = units or boundary_units(layout)
    own = tuple(layout.stages[stage])
    before = (layout.stages[stage - 1][-1],) if stage > 0 and units.down[stage - 1] else ()
    after = (layout.stages[stage + 1][0],) if stage < layout.num_stages - 1 and units.up[stage] else ()
    return before + own + after


def run_kinds(layout, stage: int, lower: int = STAY, upper: int = STAY) -> tuple[str, ...]:
    """The layer kinds stage ``stage`` runs for a micro-batch whose move is ``lower`` at the boundary below it
    (``stage - 1``) and ``upper`` at the one above it (``stage``)."""
    kinds = list(layout.stages[stage])
    head = [layout.stages[stage - 1][-1]] if lower == DOWN else []
    tail = [layout.stages[stage + 1][0]] if upper == UP else []
    if lower == UP:
        kinds = kinds[1:]
    if upper == DOWN:
        kinds = kinds[:-1]
    return tuple(head + kinds + tail)


def stage_columns(moves: np.ndarray, stage: int, num_stages: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lower, upper)``: every micro-batch's move at the boundaries below and above ``stage``, two ``(M,)`` arrays
    of the ``(M, S - 1)`` ``moves`` (zeros where the stage has no such boundary)."""
    moves = np.asarray(moves).reshape(-1, num_stages - 1)
    zeros = np.zeros(len(moves), dtype=moves.dtype)
    lower = moves[:, stage - 1] if stage > 0 else zeros
    upper = moves[:, stage] if stage < num_stages - 1 else zeros
    return lower, upper


def stage_moves(moves: np.ndarray, stage: int, num_stages: int) -> tuple[int, int]:
    """``(lower, upper)``: a micro-batch's moves (one row of the ``(M, S - 1)`` array) at the boundaries below and
    above ``stage`` (``0`` where the stage has none)."""
    lower, upper = stage_columns(np.asarray(moves).reshape(1, -1), stage, num_stages)
    return int(lower[0]), int(upper[0])


__all__ = ["DOWN", "STAY", "UP", "STACKS", "BoundaryUnits", "boundary_units", "held_kinds", "run_kinds", "stage_columns", "stage_moves"]
