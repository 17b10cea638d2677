"""The shape grid of ``dynabatch profile`` (torch-free, so the command's flags can show its defaults)."""

from __future__ import annotations

from dataclasses import dataclass


AXIS_RULE = "at least two strictly increasing values >= 1"
"""What each axis of the grid must hold (the error lines and ``profile --help`` say it)."""


def check_axis(axis: tuple[int, ...], name: str) -> None:
    """``ValueError`` naming ``name`` (a field, or the flag that gave it) unless ``axis`` holds :data:`AXIS_RULE`."""
    if len(axis) < 2 or axis[0] < 1 or list(axis) != sorted(set(axis)):
        values = ",".join(map(str, axis)) or "nothing"
        raise ValueError(f"{name} needs {AXIS_RULE} (e.g. 16,32,64), got {values}")


@dataclass(frozen=True)
class ProfileGrid:
    """The shapes to profile."""

    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Micro-batch sizes (samples per micro-batch)."""
    enc_lengths: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    """Sequence lengths (GPT-2) or encoder lengths (T5)."""
    dec_lengths: tuple[int, ...] = (4, 16, 64, 256)
    """T5 decoder lengths (unused for GPT-2)."""
    max_tokens: int = 2048
    """Profile a point only if its lower grid neighbour has ``b * max(E, D) <= max_tokens``."""

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "enc_lengths", "dec_lengths"):
            check_axis(getattr(self, name), name)
        if self.max_tokens < self.batch_sizes[0] * self.enc_lengths[0]:
            raise ValueError(f"max_tokens={self.max_tokens} is below the smallest grid point "
                             f"({self.batch_sizes[0]} x {self.enc_lengths[0]} tokens)")

    def axis(self, dim: str) -> tuple[int, ...]:
        return {"b": self.batch_sizes, "E": self.enc_lengths, "D": self.dec_lengths}[dim]

    def included(self, dims: tuple[str, ...], index: tuple[int, ...]) -> bool:
        """Whether the point at ``index`` (per dim) is profiled: its lower neighbour is within the cap."""
        lower = {d: self.axis(d)[max(i - 1, 0)] for d, i in zip(dims, index)}
        return lower["b"] * max(lower.get("E", 0), lower.get("D", 0)) <= self.max_tokens
