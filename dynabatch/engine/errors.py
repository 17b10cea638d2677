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


class InterruptLatch:
    """Ctrl-C that is never lost: while entered (in the main thread, where Python's own SIGINT handler is installed),
    SIGINT is recorded before ``KeyboardInterrupt`` is raised as usual. Python drops a ``KeyboardInterrupt`` raised
    inside a destructor or a callback ("Exception ignored in ..."), and a run interrupted at that moment went on
    training; a loop that calls :meth:`check` at each step raises it there instead."""

    def __init__(self) -> None:
        self.pending = False
        self._previous = None

    def __enter__(self) -> "InterruptLatch":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum, frame) -> None:
        self.pending = True
        if frame is not None and frame.f_code.co_name == "__del__":
            return  # raised in a destructor it would be dropped, its traceback printed: check() raises it
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if Ctrl-C came and was swallowed on its way."""
        if self.pending:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            import signal

            signal.signal(signal.SIGINT, self._previous)
