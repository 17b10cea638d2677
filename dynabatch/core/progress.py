"""Progress display that suits where the output goes: a tqdm bar on a terminal, plain periodic lines elsewhere.

A tqdm bar redraws itself with carriage returns. On a terminal that is one live line; in a file (``run.sh > log``,
a job scheduler's log) every redraw stays, and a 30-step run's log became a few long lines of hundreds of joined
redraws. :func:`progress` therefore returns a tqdm bar only when the stream is a terminal, and otherwise a
:class:`PlainProgress` that logs one ordinary line (``desc: 12/30 steps, loss=7.84, 2s``) every tenth of the total
or every ``every_s`` seconds, whichever comes first, and one at the end. ``DYNABATCH_PROGRESS=bar|plain|off``
overrides the choice. Both share the subset of tqdm's interface the commands use: iteration, ``update``,
``set_postfix``, ``set_postfix_str``, ``close`` and ``with``. Torch-free, so every layer may use it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Iterable

logger = logging.getLogger("dynabatch.core.progress")
MODES = ("bar", "plain", "off")


def progress_mode(stream=None) -> str:
    """``bar`` on a terminal, else ``plain`` (``DYNABATCH_PROGRESS`` overrides; an unknown value is a ValueError)."""
    forced = os.environ.get("DYNABATCH_PROGRESS", "").strip().lower()
    if forced:
        if forced not in MODES:
            raise ValueError(f"DYNABATCH_PROGRESS={forced!r} is not one of {', '.join(MODES)}")
        return forced
    stream = sys.stderr if stream is None else stream
    try:
        return "bar" if stream.isatty() else "plain"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return "plain"


class PlainProgress:
    """tqdm's interface, printing plain lines through logging instead of redrawing a bar (module docstring)."""

    def __init__(self, iterable: Iterable | None = None, total: int | None = None, desc: str = "", unit: str = "it",
                 initial: int = 0, disable: bool = False, every_s: float = 30.0, **_: Any):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = self._last_n = initial
        self.disable, self.every_s = disable, every_s
        self.postfix = ""
        self._start = self._last_t = time.monotonic()
        self._closed = False
        self.lines = 0  # how many lines were written (tests read it)

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self.total or 0

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    def refresh(self) -> None:
        """tqdm's redraw: plain lines are written only when due (:meth:`_due`), never on request."""

    def _due(self) -> bool:
        if self.total:
            step = max(1, self.total // 10)
            if self.n // step > self._last_n // step or self.n >= self.total:
                return True
        return time.monotonic() - self._last_t >= self.every_s

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self.disable and not self._closed and self.n != self._last_n and self._due():
            self._write()

    def _write(self) -> None:
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        text = f"{self.desc}: {count} {self.unit}" + (f", {self.postfix}" if self.postfix else "")
        logger.info(f"{text}, {time.monotonic() - self._start:.0f}s")
        self._last_n, self._last_t = self.n, time.monotonic()
        self.lines += 1

    def close(self) -> None:
        if not self._closed and not self.disable and self.n != self._last_n:
            self._write()
        self._closed = True


def progress(iterable: Iterable | None = None, *, disable: bool = False, stream=None, **kwargs: Any):
    """A tqdm bar on a terminal, a :class:`PlainProgress` elsewhere (same arguments as ``tqdm``)."""
    mode = "off" if disable else progress_mode(stream)
    if mode == "bar":
        from tqdm import tqdm

        kwargs.pop("every_s", None)
        return tqdm(iterable, **kwargs)
    return PlainProgress(iterable, disable=mode == "off", **kwargs)
