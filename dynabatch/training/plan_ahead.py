"""Planning ahead of training: rank 0's :class:`~dynabatch.training.planner.StepPlanner` runs ``depth`` steps ahead
of the training loop, so the loop never waits on planning in the steady state; ``get()`` reports how long it did
wait.

:class:`PlanAhead` runs the planner in a background thread of rank 0. numba kernels and numpy release the GIL only
inside their kernels: measured (``scripts/probe_planner_gil.py``), the thread holds the GIL for nearly all of its
planning time, which rank 0's loop then waits for, so :func:`plan_ahead` can run the planner in a child process
instead (:mod:`dynabatch.training.planner_process`, ``--planner``; the resolver's rule decides ``auto``).
"""

from __future__ import annotations

import queue
import threading
import time

from dynabatch.training.planned_step import PlannedStep
from dynabatch.training.planner import StepPlanner
from dynabatch.training.planner_process import ProcessPlanAhead


def plan_ahead(planner: StepPlanner, num_steps: int, depth: int, where: str = "thread"):
    """The background planner of a run: :class:`PlanAhead` (``where="thread"``) or
    :class:`~dynabatch.training.planner_process.ProcessPlanAhead` (``"process"``); ``--planner auto`` is decided
    before, by the resolver's rule (:mod:`dynabatch.training.config.resolve`)."""
    if where == "process":
        return ProcessPlanAhead(planner, num_steps, depth)
    if where != "thread":
        raise ValueError(f"unknown planner {where!r}; valid: process, thread (auto is the resolver's to decide)")
    return PlanAhead(planner, num_steps, depth)


class PlanAhead:
    """Runs a :class:`StepPlanner` in a background thread, ``depth`` steps ahead."""

    def __init__(self, planner: StepPlanner, num_steps: int, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(planner, num_steps), daemon=True, name="dynabatch-planner")
        self._thread.start()

    def _run(self, planner: StepPlanner, num_steps: int) -> None:
        try:
            for _ in range(num_steps):
                if self._stop.is_set() or not self._offer(planner()):
                    return
        except BaseException as e:  # delivered to the consumer, never lost in the thread
            self._offer(e)

    def _offer(self, item) -> bool:
        """Queue ``item`` as soon as there is room; ``False`` when :meth:`close` stopped the planner first."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self, timeout_s: float = 600.0) -> tuple[PlannedStep, float]:
        """The next planned step and the seconds the caller waited for it."""
        start = time.perf_counter()
        try:
            item = self._queue.get(timeout=timeout_s)
        except queue.Empty:
            alive = self._thread.is_alive()
            raise RuntimeError(
                f"the background planner produced no step within {timeout_s:.0f} s "
                f"({'still running' if alive else 'its thread died'})"
            ) from None
        if isinstance(item, BaseException):
            # Bad user input (ValueError: an over-long sample with overlong=error, a sample that does not
            # fit memory) stays a ValueError, so the CLI prints it as a one-line error with exit code 2.
            kind = ValueError if isinstance(item, ValueError) else RuntimeError
            raise kind(f"the background planner failed: {type(item).__name__}: {item}") from item
        return item, time.perf_counter() - start

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop planning and wait for the thread to finish the step it is on: a process must not exit
        while the thread is inside torch or numba (seen as ``terminate called without an active exception``
        when a run stopped early on an error while the planner was still ahead)."""
        self._stop.set()
        self._thread.join(timeout_s)
