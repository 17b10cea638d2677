"""Compute schedules: for each pipeline stage, the order in which it runs forward and backward ops.

This is what a policy (GPipe, 1F1B, adaptive) produces and what the simulator and the lowering
pass consume. Communication is not part of it: the lowering pass adds sends and receives.

Text form, one line per stage, ops separated by spaces: ``F3`` is the forward of micro-batch 3,
``B3`` its backward. ``ComputeSchedule.from_str(str(s)) == s``::

    F0 F1 B0 F2 B1 B2
    F0 B0 F1 B1 F2 B2
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class Phase(str, Enum):
    """Forward or backward; the value is the letter of the text form (stable, never reordered)."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True, slots=True)
class ComputeOp:
    """One forward or backward of one micro-batch on the stage whose list holds it."""

    phase: Phase
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.phase.value}{self.micro_batch}"

    @staticmethod
    def from_str(text: str) -> "ComputeOp":
        if len(text) < 2 or text[0] not in "FB" or not text[1:].isdigit():
            raise ValueError(f"cannot parse compute op {text!r}; expected F<n> or B<n>")
        return ComputeOp(Phase(text[0]), int(text[1:]))


@dataclass(frozen=True)
class ComputeSchedule:
    """Per-stage op orders of one training step."""

    stages: tuple[tuple[ComputeOp, ...], ...]
    num_micro_batches: int
    policy: str = "custom"
    """Name of the policy that produced it."""
    device_orders: tuple = ()
    """Virtual stages only (several chunks per device, :mod:`dynabatch.schedule.virtual`): per device, its ops in
    the order they run, ``(phase, stage, micro-batch, start s, end s)``; ``stages`` then holds each chunk's order."""

    def __post_init__(self) -> None:
        expected = sorted((p, m) for p in ("B", "F") for m in range(self.num_micro_batches))
        for s, ops in enumerate(self.stages):
            got = sorted((op.phase.value, op.micro_batch) for op in ops)
            if got != expected:
                raise ValueError(
                    f"stage {s} must run F and B of each of {self.num_micro_batches} micro-batches exactly once; "
                    f"got {' '.join(map(str, ops))}"
                )
            seen_f: set[int] = set()
            for op in ops:
                if op.phase is Phase.FORWARD:
                    seen_f.add(op.micro_batch)
                elif op.micro_batch not in seen_f:
                    raise ValueError(f"stage {s}: B{op.micro_batch} comes before F{op.micro_batch}")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def op_codes(self) -> np.ndarray:
        """``(S, 2M)`` int64 codes of the numba kernels: ``2 m`` for the forward of micro-batch ``m``,
        ``2 m + 1`` for its backward, in each stage's order."""
        return np.array([[2 * op.micro_batch + (op.phase is Phase.BACKWARD) for op in ops] for ops in self.stages],
                        dtype=np.int64).reshape(self.num_stages, 2 * self.num_micro_batches)

    def __str__(self) -> str:
        return "\n".join(" ".join(str(op) for op in ops) for ops in self.stages)

    @staticmethod
    def from_str(text: str, policy: str = "custom") -> "ComputeSchedule":
        lines = [line.split() for line in text.strip().splitlines() if line.strip()]
        stages = tuple(tuple(ComputeOp.from_str(t) for t in line) for line in lines)
        num = len(stages[0]) // 2 if stages else 0
        return ComputeSchedule(stages=stages, num_micro_batches=num, policy=policy)
