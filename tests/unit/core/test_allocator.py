"""dynabatch.core.allocator: the planning commands keep freed heap memory (glibc M_TOP_PAD)."""

from __future__ import annotations

import platform
import subprocess
import sys


def test_keep_freed_memory_takes_effect_on_glibc_once():
    """On glibc the setting is made (mallopt accepts it) and a second call keeps the first; elsewhere it says it
    did nothing. Run in a fresh interpreter, so the test's own process keeps its allocator as it is."""
    code = ("from dynabatch.core import allocator as a; first = a.keep_freed_memory(32 << 20); "
            "second = a.keep_freed_memory(); print(first, second, a._applied)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        assert out == ["True", "True", f"[{32 << 20}]"]
    else:
        assert out[:2] == ["False", "False"]


def test_the_planning_commands_keep_freed_memory():
    """dynabatch plan and simulate set it before planning (their run functions call keep_freed_memory)."""
    import inspect

    from dynabatch.commands import plan, simulate

    for command in (plan, simulate):
        assert "keep_freed_memory()" in inspect.getsource(command.run)


def test_freed_tensors_kept_reuses_pages_and_gives_the_defaults_back():
    """Inside ``freed_tensors_kept`` a 64 MiB array allocated and freed again and again stays in the process (its
    free gives nothing back) and faults its pages in once, then reuses them; after the block each free gives its
    64 MiB back to the system again, as before it. In a fresh interpreter."""
    code = """
import os, resource, numpy as np
from dynabatch.core.allocator import freed_tensors_kept
def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
def cycle():  # (MiB the free gives back, page faults of the allocation)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = np.ones(8 << 20)  # 64 MiB: above glibc's largest mmap threshold
    faults, held = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, rss_mib()
    del x
    return held - rss_mib(), faults
before = [cycle() for _ in range(3)]
with freed_tensors_kept() as applied:
    inside = [cycle() for _ in range(3)]
after = [cycle() for _ in range(3)]
print(applied, *before[-1], *inside[-1], *after[-1])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        applied, (given_before, _, given_inside, faults_inside, given_after, _) = out[0], map(int, out[1:])
        assert applied == "True"
        assert given_before >= 60 and given_after >= 60  # the C library's defaults: a free gives the memory back
        assert given_inside == 0  # kept for the next allocation ...
        assert faults_inside < (64 << 20) // 4096 // 100  # ... which reuses its pages
    else:
        assert out[0] == "False"
