"""One forward kernel of the analytic model (:mod:`dynabatch.cost.analytic`): its FLOPs and bytes, which efficiency
applies and its backward multiplier; the model times it as ``max(flops / (peak eff), bytes / (bandwidth mem_eff)) +
launches x launch``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Op:
    """One forward kernel: FLOPs, bytes moved, which efficiency applies and its backward multiplier."""

    flops: np.ndarray | float
    """0.0 for a memory-bound kernel."""
    bytes: np.ndarray
    unit: str  # "matmul", "attention" or "memory"
    bwd_factor: float = 2.0
    launches: object = 1.0
    """Kernel launches (the attention core of per-segment attention: one per call)."""


def gemm(m, n, k, p: int, batch=1.0, unit: str = "matmul") -> Op:
    """``batch`` GEMMs of ``(m, k) @ (k, n)``."""
    return Op(2.0 * batch * m * n * k, p * batch * (m * k + k * n + m * n), unit)


def memory_op(num_bytes) -> Op:
    return Op(0.0, num_bytes, "memory")  # no FLOPs: a scalar zero (adds nothing to a sum, allocates nothing)
