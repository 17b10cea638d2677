"""The engine's error type, torch-free: the CLI's failure handling (:mod:`dynabatch.engine.faults`) tells a
peer's failure from a bug without importing torch (``dynabatch --help`` stays light);
:mod:`dynabatch.engine.dist` raises it."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """A distributed step failed: a peer died or timed out, or an instruction raised."""
