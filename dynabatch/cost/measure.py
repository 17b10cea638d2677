"""Measure one layer step: forward/backward time, bytes saved for backward, peak activation bytes.

Time: one untimed memory pass doubles as warm-up (oneDNN primitive creation, lazy init), then timed
iterations until ``min_repeats`` are done and ``min_time_s`` has passed (at most ``max_repeats``);
the reported forward and backward times are the medians. Python's garbage collector is off while
timing and CUDA is synchronised around each phase. On a CPU with one intra-op thread the clock is the
thread's CPU time: on a shared 2-core box, wall time of the same layer swung by 2-100x while other
processes ran (two OpenMP threads waiting on a descheduled peer), thread CPU time by ~5-15%.
Parameter gradients exist before measuring, so backward accumulates in place as in training (their
bytes belong to the model state, not here).

Stored bytes (any device): every tensor the autograd graph saves goes through
``torch.autograd.graph.saved_tensors_hooks``; storages are counted once (views dedup), parameters and
stage-shared inputs (``Step.shared``) are skipped. Exact: e.g. ``nn.Linear`` on an (n, k) fp32 input
saves 4nk bytes (its weight is a parameter).

Peak bytes: the high-water mark of bytes allocated above the memory live before the forward, over
forward and backward, with the incoming output gradient not counted (it belongs to the next stage).
On CUDA it is ``max_memory_allocated`` after ``reset_peak_memory_stats``. On CPU the profiler's
allocator events (``profile_memory=True``) are replayed in time order: the running sum of allocated and
freed bytes gives the exact live-bytes curve of the CPU allocator, including transients inside ops.
So ``peak >= stored`` and ``peak - stored`` is the layer's transient working set.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from dynabatch.cost.layers import Step


@dataclass(frozen=True)
class MeasureSettings:
    """How hard to try per grid point."""

    min_repeats: int = 3
    """Timed iterations at least."""
    max_repeats: int = 30
    """Timed iterations at most."""
    min_time_s: float = 0.03
    """Keep timing (up to ``max_repeats``) until this much time has been spent."""
    clock: str = "auto"
    """``wall`` (``perf_counter``, CUDA synchronised), ``thread_cpu`` (``time.thread_time``: CPU time of the
    calling thread, immune to being descheduled by other processes; only valid with one intra-op thread on
    CPU) or ``auto`` (``thread_cpu`` on CPU with ``torch.get_num_threads() == 1``, else ``wall``)."""

    def __post_init__(self) -> None:
        if self.clock not in ("auto", "wall", "thread_cpu"):
            raise ValueError(f"unknown clock {self.clock!r}; valid: auto, wall, thread_cpu")
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise ValueError(f"need 1 <= min_repeats <= max_repeats, got {self.min_repeats}, {self.max_repeats}")
        if self.min_time_s < 0:
            raise ValueError(f"min_time_s must be >= 0, got {self.min_time_s}")


@dataclass(frozen=True)
class Measurement:
    """Result of measuring one step."""

    fwd_s: float
    """Median forward time in seconds."""
    bwd_s: float
    """Median backward time in seconds (0 when nothing needs a gradient)."""
    stored_bytes: int
    """Bytes saved for backward, deduplicated by storage, without parameters and shared inputs."""
    peak_bytes: int
    """High-water mark of activation bytes over forward + backward (>= stored_bytes)."""
    shared_saved_bytes: int = 0
    """Context kinds: bytes of their outputs that a consuming block saves (already in ``stored_bytes``)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _diff(outs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [t for t in outs if t.requires_grad and t.grad_fn is not None]


def _make_grads(step: Step, outs: tuple[torch.Tensor, ...]) -> None:
    if not step.grads:
        step.grads.extend(torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in _diff(outs))


def _backward(step: Step, outs: tuple[torch.Tensor, ...]) -> None:
    diff = _diff(outs)
    if diff:
        _make_grads(step, outs)
        torch.autograd.backward(diff, step.grads)


def _reset(step: Step) -> None:
    for t in step.leaves:
        t.grad = None


class _SavedBytes:
    """``saved_tensors_hooks`` that sums the storages the graph saves (deduplicated)."""

    def __init__(self, skip: frozenset[int]):
        self.skip = skip
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in self.skip:
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def saved_bytes(fn, skip: frozenset[int] = frozenset()) -> tuple[int, object]:
    """Bytes of distinct storages saved for backward while running ``fn()``; returns (bytes, fn's result)."""
    with _SavedBytes(skip) as rec:
        out = fn()
    return rec.total, out


@contextlib.contextmanager
def _quiet_stderr():
    """Silence fd 2: kineto prints a line on every profiler start and stop, and no setting turns it off."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class _PeakCPU:
    """Live CPU-allocator bytes over a region, from the profiler's memory events."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        events = [e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        live = peak = 0
        for e in events:
            live += e.nbytes()
            peak = max(peak, live)
        self.peak, self.end = peak, live
        return False


class _PeakCUDA:
    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
        self.end = torch.cuda.memory_allocated(self.device) - self._start
        return False


def _peak_meter(device: torch.device):
    return _PeakCUDA(device) if device.type == "cuda" else _PeakCPU()


def measure_memory(step: Step, param_ptrs: frozenset[int], device: torch.device) -> tuple[int, int, int]:
    """One forward + backward with memory instrumentation: (stored, peak, shared_saved) bytes."""
    _reset(step)
    skip = param_ptrs | {t.untyped_storage().data_ptr() for t in step.shared}
    with _peak_meter(device) as fwd_meter, _SavedBytes(skip) as rec:
        diff, aux = step.run()
    stored = rec.total
    shared_saved = passthrough_saved = 0
    if step.consumer is not None:
        # Which context outputs does a consuming block keep for backward? Those count here, once.
        outs = tuple(t for t in (*diff, *aux) if isinstance(t, torch.Tensor))
        mine = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in outs}
        with _SavedBytes(param_ptrs) as consumer_rec:
            step.consumer(outs)
        shared = {p: n for p, n in consumer_rec.storages.items() if p in mine and p not in rec.storages}
        shared_saved = sum(shared.values())
        passthrough = {t.untyped_storage().data_ptr() for t in step.passthrough}
        passthrough_saved = sum(n for p, n in shared.items() if p in passthrough)
        del consumer_rec
    _make_grads(step, diff)  # outside the meters: the output gradient belongs to the next stage
    with _peak_meter(device) as bwd_meter:
        _backward(step, diff)
    del diff, aux
    # Outputs that blocks save were allocated here, so the meters already saw them; pass-through inputs
    # were not, and are added.
    peak = max(fwd_meter.peak, fwd_meter.end + bwd_meter.peak) + passthrough_saved
    stored += shared_saved
    return stored, max(peak, stored), shared_saved


def resolve_clock(clock: str, device: torch.device) -> str:
    """The clock ``auto`` stands for on this device and thread setting; checks ``thread_cpu`` is valid."""
    single = device.type == "cpu" and torch.get_num_threads() == 1
    if clock == "auto":
        return "thread_cpu" if single else "wall"
    if clock == "thread_cpu" and not single:
        raise ValueError("clock 'thread_cpu' needs a CPU device and torch.get_num_threads() == 1 "
                         f"(got {device.type}, {torch.get_num_threads()} threads)")
    return clock


def measure_time(step: Step, device: torch.device, settings: MeasureSettings) -> tuple[float, float]:
    """Median forward and backward seconds."""
    now = time.thread_time if resolve_clock(settings.clock, device) == "thread_cpu" else time.perf_counter
    fwd, bwd = [], []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = now()
        while len(fwd) < settings.max_repeats:
            _reset(step)
            _sync(device)
            t0 = now()
            diff, aux = step.run()
            _sync(device)
            t1 = now()
            _backward(step, diff)
            _sync(device)
            t2 = now()
            del diff, aux
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            if len(fwd) >= settings.min_repeats and now() - start >= settings.min_time_s:
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return statistics.median(fwd), statistics.median(bwd)


def settle_cpu_allocator() -> None:
    """Put glibc malloc in the state of a long-running training process before measuring.

    glibc starts with a 128 KiB mmap threshold and raises it (up to 32 MiB) the first time an mmapped
    chunk is freed. Until then every tensor over 128 KiB is a fresh mmap that page-faults on first use:
    the first layer kinds profiled (embeddings, a few ms) measured 2-4x slower than the same shapes later.
    Allocating and freeing one 31 MiB block raises the threshold at once, as training soon does.
    """
    block = torch.empty(31 * 2**20, dtype=torch.uint8)
    block.fill_(0)
    del block


def prepare_params(model: torch.nn.Module) -> None:
    """Give every parameter a zero gradient so backward accumulates in place, as in training."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def measure_step(step: Step, param_ptrs: frozenset[int], device: torch.device,
                 settings: MeasureSettings = MeasureSettings()) -> Measurement:
    """Memory pass (also the warm-up), then timed iterations."""
    stored, peak, shared = measure_memory(step, param_ptrs, device)
    fwd_s, bwd_s = measure_time(step, device, settings)
    return Measurement(fwd_s, bwd_s, stored, peak, shared)
