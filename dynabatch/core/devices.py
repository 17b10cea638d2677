"""Device names (``--device``), torch-free: the forms a run accepts and their check.

:mod:`dynabatch.engine.dist` resolves a name to a backend and a torch device; the configuration checks the name
with :func:`check_device_name` before anything imports torch.
"""

from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
"""``--device`` forms."""


def check_device_name(name: str) -> None:
    """``ValueError`` unless ``name`` is one of :data:`DEVICES` (``N`` a device number)."""
    index = name[5:] if name.startswith("cuda:") else None
    if name not in ("auto", "cpu", "cuda") and not (index is not None and index.isdigit()):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N (N a device number), got {name!r}")
