"""Compute precisions (``--dtype``), torch-free: names, their torch dtype names and element sizes.

bf16 / fp16 train fp32 weights under autocast (:mod:`dynabatch.engine.precision` maps these names to torch).
"""

from __future__ import annotations

from dynabatch.core.registry import Registry

DTYPES = Registry("dtype", [
    ("fp32", "float32"),
    ("bf16", "bfloat16 autocast over fp32 weights"),
    ("fp16", "float16 autocast over fp32 weights"),
])
"""``--dtype``: the compute precision."""

DTYPE_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``--dtype`` -> the torch dtype's name."""

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""``--dtype`` -> bytes per element of activations."""

assert tuple(DTYPE_TORCH_NAMES) == DTYPES == tuple(DTYPE_BYTES)


def autocasts(name: str) -> bool:
    """Whether ``--dtype name`` runs under autocast (a half precision over fp32 weights); ``ValueError`` if unknown."""
    return DTYPE_TORCH_NAMES[DTYPES.check(name)] != "float32"
