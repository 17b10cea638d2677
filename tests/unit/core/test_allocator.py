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
