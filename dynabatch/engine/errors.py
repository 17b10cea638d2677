"""The engine's error type, torch-free: the CLI's failure handling (:mod:`dynabatch.engine.faults`) tells a
peer's failure from a bug without importing torch (``dynabatch --help`` stays light);
:mod:`dynabatch.engine.dist` raises it."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """A distributed step failed: a peer died or timed out, or an instruction raised."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, carrying the one line the command ends with (``str()``): where the run stopped and what to do
    next (the newest checkpoint to resume from). The CLI prints it and exits 130."""

    def __init__(self, message: str = "interrupted", step: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        """The training step the run was on (``None``: before the first, or not a training run)."""
