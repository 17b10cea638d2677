"""Keep freed memory in the process: glibc's ``mallopt`` settings for planning and for CPU training.

Planning (:func:`keep_freed_memory`). The planner's cost model works on numpy arrays of thousands to tens of
thousands of entries (the partition DP prices every candidate run of a global batch), so each cost-model call
allocates and frees hundreds of temporaries of 50 KB to 1 MB. glibc hands the top of its heap back to the operating
system as soon as more than 128 KiB is free there, and grows it again page by page for the next temporaries: the
pages are faulted in anew on every call. On the 2-core VM of ``docs/benchmarks/planner/plan_time_2cpu_20261206.md``
those page faults were about 45% of the DP's pricing time (the five cost-model calls of a 226-sample T5 batch: 47
ms, 24 ms with the heap kept). :func:`keep_freed_memory` sets ``M_TOP_PAD`` so that the heap grows and shrinks in
steps of :data:`TOP_PAD_BYTES`: the temporaries reuse pages already mapped. The cost is that much more resident
memory at most; values computed are unchanged.

A process-wide setting, so it is made where a process plans and owns its memory: ``dynabatch plan``,
``dynabatch simulate`` and the training run's planner process (``--planner process``) call it. Elsewhere than
glibc (macOS, musl) it does nothing and says so.

CPU training (:func:`freed_tensors_kept`, ``--cpu-allocator keep``). On CPU, torch takes every tensor from
``malloc``; glibc serves a request above its mmap threshold (at most 32 MiB) with a fresh ``mmap`` and unmaps it when
the tensor is freed, so each step's large tensors (activations, and the ``b h T^2`` attention scores of T5's eager
attention) are new pages that the kernel faults in and zeroes on first touch. With ``M_MMAP_MAX = 0`` every
allocation comes from the heap, and with ``M_TRIM_THRESHOLD`` at its largest the heap keeps what is freed: the next
step reuses the pages. Measured on one CPU thread (docs/benchmarks/cpu_allocator/): a T5-d256 sample's forward and
backward 1.13x faster at 1,024 tokens, 1.40x at 2,048, 1.54x at 4,096, with 1.04x, 1.39x and 1.83x the resident
set (the heap cannot give back memory under live blocks); GPT-2 (SDPA, no score tensors) unchanged at 2,048.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

M_TOP_PAD = -2
"""glibc's ``mallopt`` parameter number of ``M_TOP_PAD`` (``malloc.h``)."""
TOP_PAD_BYTES = 64 << 20
"""Extra bytes the heap grows by and keeps when it shrinks (measured: 16 MiB already removes the page faults of
a 65,536-token T5 batch's DP; 64 MiB leaves room for larger batches)."""

M_MMAP_MAX = -4
"""``mallopt`` parameter: how many chunks ``mmap`` may serve (glibc's default 65,536; 0: none, all from the heap)."""
M_TRIM_THRESHOLD = -1
"""``mallopt`` parameter: free bytes at the top of the heap above which glibc gives them back (default 128 KiB)."""
DEFAULTS = {M_MMAP_MAX: 65536, M_TRIM_THRESHOLD: 128 * 1024}
"""glibc's defaults of the parameters :func:`freed_tensors_kept` sets, restored after it."""
KEPT = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}
"""Every allocation from the heap, and the heap trimmed only when 2 GiB are free at its top (``mallopt`` takes an
int)."""
KEPT_RESIDENT_FACTOR = 2.0
"""How much larger a process's resident set may grow with freed memory kept (measured up to 1.83x: the benchmark
above); ``--cpu-allocator auto`` keeps only where the ranks' budgets times this fit the host's memory."""
CPU_ALLOCATORS = ("auto", "keep", "system")
"""``--cpu-allocator``: ``keep`` (:func:`freed_tensors_kept`), ``system`` (the C library's defaults), or ``auto``
(the resolver's rule: :mod:`dynabatch.training.config.resolve`)."""

_applied: list[int] = []


def keep_freed_memory(pad_bytes: int = TOP_PAD_BYTES) -> bool:
    """Set glibc's ``M_TOP_PAD`` to ``pad_bytes`` for this process (once; later calls do nothing). Returns whether
    the setting is in effect (``False`` where the C library is not glibc)."""
    if _applied:
        return True
    mallopt = _mallopt()
    if mallopt is None or mallopt(M_TOP_PAD, int(pad_bytes)) != 1:  # glibc returns 1 on success
        return False
    _applied.append(int(pad_bytes))
    return True


def host_memory_gib() -> float | None:
    """This machine's physical memory in GiB (``None`` where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def _mallopt():
    """glibc's ``mallopt`` (argument types set), or ``None`` where the C library has none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


@contextlib.contextmanager
def freed_tensors_kept(enabled: bool = True):
    """While the block runs (a training run on CPU), every allocation comes from the heap and freed memory stays in
    the process (module docstring); after it, glibc's default values are back and each free gives memory back as
    before (the thresholds then stay at those values: glibc stops adjusting its mmap threshold once one is set).
    Yields whether the setting was in effect (``False`` when not ``enabled``, or not glibc)."""
    mallopt = _mallopt() if enabled else None
    applied = mallopt is not None and all(mallopt(param, value) == 1 for param, value in KEPT.items())
    try:
        yield applied
    finally:
        if mallopt is not None:
            for param, value in DEFAULTS.items():
                mallopt(param, value)


__all__ = ["CPU_ALLOCATORS", "KEPT_RESIDENT_FACTOR", "M_TOP_PAD", "TOP_PAD_BYTES", "freed_tensors_kept", "host_memory_gib",
           "keep_freed_memory"]
