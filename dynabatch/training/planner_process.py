"""Rank 0's step planner in a child process (``--planner process``): planning never holds the training loop's GIL.

:class:`ProcessPlanAhead` has :class:`~dynabatch.training.plan_ahead.PlanAhead`'s interface. It spawns one child
(``multiprocessing`` spawn context: nothing of the parent's threads or CUDA state is inherited) that rebuilds the
:class:`~dynabatch.training.planner.StepPlanner` from its picklable parts (batcher with its data and position,
config, cost models, tokenizer info; once, at the start) and plans ``num_steps`` steps, at most ``depth`` ahead of the
training loop (the queue's size). Each :class:`~dynabatch.training.planned_step.PlannedStep` comes back pickled as bytes,
plans only (:meth:`~dynabatch.training.planned_step.PlannedStep.without_data`): the global batch as the ``(source, row)``
ids of its samples, each replica's micro-batches as units (rows of sample indices, token-slice bounds), shapes,
costs, schedules and the lowered plans; no token ids and no tensors (:func:`_dumps` refuses them). The parent
rebuilds the batch from its own copy of the data (:meth:`~dynabatch.training.planner.StepPlanner.with_data`) and
collates the micro-batches where they are used (:attr:`~dynabatch.training.planned_step.PlannedStep.replica_micro_batches`).

Online calibration: the child's planner asks :class:`_FedCalibration` for the cost model of step ``k``; a feeder
thread in the parent takes exactly that model from the run's
:class:`~dynabatch.training.calibration.RunCalibration` (``cost_model_for(k)``: the fit as of step
``k - plan_ahead - 1``, waiting until the loop recorded it, as the thread planner waits), the base model scaled to
it (with ``--plan-costs scaled`` only) and the step's overhead, and sends them, step by step, to the child. The fit as of a step is a pure function of the measurements up to it,
so the child plans exactly what the planner thread plans (tested, with online calibration too).

Failures: an exception in the child comes back as its type name and message and :meth:`ProcessPlanAhead.get`
raises the thread planner's one-line error (``the background planner failed: RuntimeError: ...``; a
``ValueError`` stays one); a child that dies without a word is reported with its exit code. Every wait has a
timeout, and :meth:`ProcessPlanAhead.close` terminates a child that does not stop in time.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import pickle
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from dynabatch.data.microbatch import CausalMicroBatch, Seq2SeqMicroBatch
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.core.allocator import keep_freed_memory
from dynabatch.engine.faults import die_with_parent
from dynabatch.training.planner import StepPlanner

_POLL_S = 0.1
"""How often blocked waits look at the stop flag and the child's life."""
PLANNER_NICENESS = 10
"""The child's scheduling niceness: it plans a few steps ahead of training, so on a machine whose cores the ranks
keep busy it runs in what they leave idle (pipeline bubbles, waits on peers) instead of taking time from rank 0."""


@dataclass(frozen=True)
class _Failure:
    """An exception raised in the child, as text (its class need not unpickle in the parent)."""

    kind: str
    message: str
    value_error: bool


class _FedCalibration:
    """The child's stand-in for :class:`~dynabatch.training.calibration.RunCalibration`: the cost model and overhead
    of each step, as the parent's feeder sends them (in step order)."""

    def __init__(self, base, enabled: bool, feed, stop):
        self.base, self._enabled, self._feed, self._stop = base, enabled, feed, stop
        self._models: dict[int, tuple[Any, Any, float]] = {}

    @property
    def enabled(self) -> bool:
        return self._enabled

    def _entry(self, step: int, timeout_s: float = 600.0) -> tuple[Any, Any, float]:
        deadline = time.monotonic() + timeout_s
        while step not in self._models:
            if self._stop.is_set():
                raise RuntimeError(f"stopped while waiting for the cost model of step {step}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"planning step {step}: the training process sent no cost model within {timeout_s:.0f} s")
            try:
                k, *entry = self._feed.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            self._models[k] = tuple(entry)
        return self._models[step]

    def cost_model_for(self, step: int, timeout_s: float = 600.0, scaled: bool = False):
        return self._entry(step, timeout_s)[1 if scaled else 0]

    def overhead_for(self, step: int) -> float:
        return self._entry(step)[2]


class _Pickler(pickle.Pickler):
    """Pickles what the child sends, refusing data: a tensor, a tokenized sample or a collated micro-batch raises
    ``TypeError`` (the planner ships plans; the data stays with the processes that hold it)."""

    def reducer_override(self, obj):
        if isinstance(obj, _REFUSED):
            raise TypeError(f"the planner process sends plans only, not a {type(obj).__name__}")
        return NotImplemented


_REFUSED = (torch.Tensor, TokenizedSample, GlobalBatch, CausalMicroBatch, Seq2SeqMicroBatch)
"""What never crosses from the planner process to the training loop."""


def _dumps(obj) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


def _child(state: dict, calibration: dict | None, num_steps: int, out, feed, stop) -> None:
    """The child process: rebuild the planner, plan ``num_steps`` steps into ``out`` (pickled bytes)."""
    import os

    die_with_parent()  # no planner outlives its rank, holding the rank's inherited output pipes open
    if hasattr(os, "nice"):  # plans ahead of training: on cores the ranks fill, take what they leave idle
        os.nice(PLANNER_NICENESS)
    keep_freed_memory()  # the child only plans: its cost-model temporaries reuse heap pages (core.allocator)
    try:
        planner = StepPlanner.__new__(StepPlanner)
        planner.__dict__.update(state)
        planner.calibration = None if calibration is None else _FedCalibration(feed=feed, stop=stop, **calibration)
        for _ in range(num_steps):
            if stop.is_set() or not _offer(out, _dumps(planner().without_data()), stop):
                return
    except BaseException as e:  # delivered to the parent, never lost in the child
        _offer(out, _dumps(_Failure(type(e).__name__, str(e), isinstance(e, ValueError))), stop)


def _offer(out, item, stop) -> bool:
    """Put ``item`` once there is room; ``False`` when the parent asked to stop first."""
    while not stop.is_set():
        try:
            out.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


class ProcessPlanAhead:
    """Runs a :class:`~dynabatch.training.planner.StepPlanner` in a child process, ``depth`` steps ahead."""

    def __init__(self, planner, num_steps: int, depth: int = 2):
        ctx = mp.get_context("spawn")
        self._out, self._feed, self._stop = ctx.Queue(maxsize=depth), ctx.Queue(), ctx.Event()
        state = {k: v for k, v in planner.__dict__.items() if k != "calibration"}
        self._with_data = planner.with_data  # the parent's planner holds the same data the child plans from
        cal = planner.calibration
        fed = None
        if cal is not None and cal.enabled:
            fed = {"base": cal.base, "enabled": True}
        self._process = ctx.Process(target=_child, args=(state, fed, num_steps, self._out, self._feed, self._stop),
                                    daemon=True, name="dynabatch-planner")
        self._process.start()
        self._feeder = None
        if fed is not None:
            self._feeder = threading.Thread(target=self._feed_fits, args=(cal, planner.step, num_steps,
                                                                          planner.plan_costs == "scaled"), daemon=True,
                                            name="dynabatch-planner-feed")
            self._feeder.start()

    def _feed_fits(self, cal, start: int, num_steps: int, scaled: bool) -> None:
        """Parent thread: send the child each step's cost model (and with ``scaled`` the base model scaled to it) once
        the loop has recorded what it is fitted on."""
        for step in range(start, start + num_steps):
            while not self._stop.is_set():
                try:
                    models = (cal.cost_model_for(step, timeout_s=1.0),
                              cal.cost_model_for(step, scaled=True) if scaled else None)
                    break
                except RuntimeError:  # not recorded yet: the loop is still on an earlier step
                    continue
            if self._stop.is_set():
                return
            self._feed.put((step, *models, cal.overhead_for(step)))

    def get(self, timeout_s: float = 600.0):
        """The next planned step and the seconds the caller waited for it (as :meth:`PlanAhead.get`), its batch
        rebuilt from this process's data (:meth:`~dynabatch.training.planner.StepPlanner.with_data`)."""
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                item = pickle.loads(self._out.get(timeout=_POLL_S))
                break
            except queue.Empty:
                if not self._process.is_alive() and self._out.empty():
                    raise RuntimeError(f"the background planner process died (exit code {self._process.exitcode}) "
                                       "without a planned step or an error") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the background planner produced no step within {timeout_s:.0f} s "
                                       "(its process is still running)") from None
        if isinstance(item, _Failure):
            kind = ValueError if item.value_error else RuntimeError
            raise kind(f"the background planner failed: {item.kind}: {item.message}")
        return self._with_data(item), time.perf_counter() - start

    def close(self, timeout_s: float = 120.0) -> None:
        """Stop planning: the child finishes the step it is on and exits, or is terminated after ``timeout_s``."""
        self._stop.set()
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10.0)
        if self._feeder is not None:
            self._feeder.join(5.0)
        for q in (self._out, self._feed):
            q.cancel_join_thread()  # items nobody will read must not keep this process from exiting
            q.close()
