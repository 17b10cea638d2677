"""Keep freed heap memory in the process while planning: glibc's ``M_TOP_PAD`` through ``mallopt``.

The planner's cost model works on numpy arrays of thousands to tens of thousands of entries (the partition DP
prices every candidate run of a global batch), so each cost-model call allocates and frees hundreds of
temporaries of 50 KB to 1 MB. glibc hands the top of its heap back to the operating system as soon as more than
128 KiB is free there, and grows it again page by page for the next temporaries: the pages are faulted in anew on
every call. On the 2-core VM of ``docs/benchmarks/planner/plan_time_2cpu_20261206.md`` those page faults were
about 45% of the DP's pricing time (the five cost-model calls of a 226-sample T5 batch: 47 ms, 24 ms with the
heap kept). :func:`keep_freed_memory` sets ``M_TOP_PAD`` so that the heap grows and shrinks in steps of
:data:`TOP_PAD_BYTES`: the temporaries reuse pages already mapped. The cost is that much more resident memory
at most; values computed are unchanged.

A process-wide setting, so it is made where a process plans and owns its memory: ``dynabatch plan``,
``dynabatch simulate`` and the training run's planner process (``--planner process``) call it. Elsewhere than glibc (macOS, musl) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import sys

M_TOP_PAD = -2
"""glibc's ``mallopt`` parameter number of ``M_TOP_PAD`` (``malloc.h``)."""
TOP_PAD_BYTES = 64 << 20
"""Extra bytes the heap grows by and keeps when it shrinks (measured: 16 MiB already removes the page faults of
a 65,536-token T5 batch's DP; 64 MiB leaves room for larger batches)."""

_applied: list[int] = []


def keep_freed_memory(pad_bytes: int = TOP_PAD_BYTES) -> bool:
    """Set glibc's ``M_TOP_PAD`` to ``pad_bytes`` for this process (once; later calls do nothing). Returns whether
    the setting is in effect (``False`` where the C library is not glibc)."""
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_TOP_PAD, int(pad_bytes)) != 1:  # glibc returns 1 on success
        return False
    _applied.append(int(pad_bytes))
    return True


__all__ = ["M_TOP_PAD", "TOP_PAD_BYTES", "keep_freed_memory"]
