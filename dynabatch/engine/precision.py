"""Compute precision (``--dtype``): fp32, or bf16 / fp16 autocast over fp32 master weights, and fp16 loss scaling.

The weights, gradients and AdamW states stay fp32; under ``bf16`` / ``fp16`` each stage forward runs inside
``torch.autocast`` (CUDA, and CPU: ``torch.autocast("cpu", dtype=torch.bfloat16)``; torch's CPU autocast also
takes fp16), so matrix products and attention run in the 16-bit type and the backward follows through autograd.
Activations travel between stages in fp32 (the plan's tensor dtype: what a stage's residual stream is under
autocast), so every receive buffer matches what its peer sends and an N-stage run computes what one stage does.

fp16's narrow range needs loss scaling. :class:`LossScaler` follows ``torch.amp.GradScaler``'s rule (scale 2^16,
halved on an overflow, the step skipped; doubled after 2000 good steps in a row) but decides from the gradient
norm the executor already all-reduces over the world, so every rank of a pipeline skips the same steps and keeps
the same scale (``GradScaler`` checks each rank's own gradients, and the ranks' scales could drift apart).
The scale is part of the checkpoint, so a resumed fp16 run goes on with the interrupted run's scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dynabatch.core.dtypes import DTYPE_TORCH_NAMES  # the --dtype registry
from dynabatch.schedule.ir import DTYPE_BYTES as TENSOR_BYTES  # element sizes of the IR's dtype names

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {
    name: None if torch_name == "float32" else getattr(torch, torch_name) for name, torch_name in DTYPE_TORCH_NAMES.items()}
"""``--dtype`` -> the autocast dtype (``None``: no autocast)."""
DTYPE_BYTES = {name: TENSOR_BYTES[torch_name] for name, torch_name in DTYPE_TORCH_NAMES.items()}
"""``--dtype`` -> bytes per activation element, for the cost model's memory planning."""


def autocast_dtype(name: str) -> torch.dtype | None:
    """The autocast dtype of ``--dtype name``; ``ValueError`` naming the valid ones otherwise."""
    if name not in AUTOCAST_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(AUTOCAST_DTYPES)}, got {name!r}")
    return AUTOCAST_DTYPES[name]


@dataclass
class LossScaler:
    """Dynamic loss scale of fp16 training (see the module docstring)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 1.0
    """An overflow at a scale below this is not blamed on the scale: the step counts as a bad step."""
    good_steps: int = 0

    def overflowed(self, loss: float, grad_norm: float) -> bool:
        """A finite loss with non-finite gradients at a scale worth lowering: fp16 overflowed."""
        return math.isfinite(loss) and not math.isfinite(grad_norm) and self.scale >= self.min_scale

    def update(self, overflow: bool) -> None:
        """After a step: halve the scale on an overflow, double it after ``growth_interval`` good steps."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the scale and the good steps since it last changed (every rank holds the
        same, so rank 0's manifest stores it)."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
