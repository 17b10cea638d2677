"""Log messages of dynabatch's commands, with rank-0 filtering (``--log-level``).

Every module logs through ``logging.getLogger(__name__)``, under the ``dynabatch`` logger.
:func:`setup_logging` gives that logger one handler, on standard error:

* rank 0 logs at the run's level (``--log-level``, default ``info``); every other rank logs warnings
  and errors only, prefixed ``[rank N]`` like :mod:`dynabatch.engine.faults`' lines, so a pipeline's
  ranks do not repeat rank 0's lines;
* info lines are the message alone (a step's metrics stay one JSON object per line), warnings and
  errors start ``warning:`` / ``error:``;
* a run's result (the end-of-run summary and speed-up lines, :func:`log_result`) is logged at the
  :data:`RESULT` level, above every ``--log-level``, so it is printed at each of them, as a plain line;
* lines go through ``tqdm.write``, which clears the training progress bar, writes the line and draws
  the bar again, so log lines never break the bar;
* the stream is looked up at each line (``sys.stderr`` then), so a redirected stream gets the line;
* a Python warning raised in dynabatch's own code becomes such a ``warning:`` line (no file path, no
  ``UserWarning:``), each text once per process; an
  :class:`~dynabatch.core.rank_warnings.EveryRankWarning` (the same on every rank) is said by rank 0 only.

:func:`quiet_third_party` silences the progress bars of ``datasets`` (its ``map`` / ``filter`` bars put
one line per update into a run's log) on every rank, and sets ``transformers``' logging to warnings
on the ranks other than 0. A user's own ``HF_DATASETS_DISABLE_PROGRESS_BARS`` wins.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from dynabatch.core.rank_warnings import EveryRankWarning

LOGGER_NAME = "dynabatch"
RESULT = logging.CRITICAL + 5
"""The level of a run's result lines: above ``--log-level error``, so every level prints them."""
logging.addLevelName(RESULT, "RESULT")


def log_result(logger: logging.Logger, message: str) -> None:
    """Log ``message`` as a result line: printed at every ``--log-level``, without a ``warning:`` prefix."""
    logger.log(RESULT, message)


def process_rank() -> int:
    """This process's rank under torchrun (``RANK``), 0 when launched directly."""
    return int(os.environ.get("RANK", "0") or 0)


class _Formatter(logging.Formatter):
    """``message`` for info, debug and results, ``warning: message`` / ``error: message`` for those; ``[rank N] ``
    first on ranks other than 0."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if logging.WARNING <= record.levelno < RESULT:
            text = f"{record.levelname.lower()}: {text}"
        return f"[rank {self.rank}] {text}" if self.rank else text


class _TqdmHandler(logging.Handler):
    """Writes each line with ``tqdm.write`` to the current ``sys.stderr`` (active bars are redrawn below it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging's contract: a failing handler reports through handleError, never raises
            self.handleError(record)


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The ``dynabatch`` package's folder: warnings raised from files under it are dynabatch's own."""


class _WarningsToLog:
    """A ``warnings.showwarning`` that logs dynabatch's own warnings as one ``warning:`` line each, every text once
    (a check that runs at start-up and again per method would otherwise repeat it, and Python's own once-per-place
    record is cleared whenever a filter changes); other packages' warnings go to Python's usual printer."""

    def __init__(self, fallback):
        self.fallback = fallback
        self.said: set[tuple[type, str]] = set()

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        if not os.path.abspath(filename).startswith(PACKAGE_DIR + os.sep):
            self.fallback(message, category, filename, lineno, file, line)
            return
        key = (category, str(message))
        if key not in self.said:
            self.said.add(key)
            logging.getLogger(LOGGER_NAME).warning(str(message))


def _log_warnings(rank: int) -> None:
    """Route dynabatch's warnings through its logger (:class:`_WarningsToLog`, installed once per process), and
    on ranks other than 0 drop the :class:`EveryRankWarning` ones, which rank 0 says for the run."""
    if not isinstance(warnings.showwarning, _WarningsToLog):
        warnings.showwarning = _WarningsToLog(warnings.showwarning)
    if rank != 0:
        warnings.filterwarnings("ignore", category=EveryRankWarning)


def setup_logging(level: str = "info", rank: int | None = None) -> logging.Logger:
    """Configure the ``dynabatch`` logger for this process (idempotent: a second call replaces the first's
    handler): ``level`` on rank 0, warnings on other ranks (``rank``: :func:`process_rank` by default), and
    dynabatch's Python warnings as its log lines (:func:`_log_warnings`)."""
    rank = process_rank() if rank is None else rank
    _log_warnings(rank)
    logger = logging.getLogger(LOGGER_NAME)
    for old in [h for h in logger.handlers if isinstance(h, _TqdmHandler)]:
        logger.removeHandler(old)
    handler = _TqdmHandler()
    handler.setFormatter(_Formatter(rank))
    logger.addHandler(handler)
    logger.setLevel(level.upper() if rank == 0 else logging.WARNING)
    logger.propagate = False  # one line per message, even where the application configured the root logger
    return logger


def quiet_third_party(rank: int | None = None) -> None:
    """No ``datasets`` progress bars (on every rank: the ``Map`` / ``Filter`` bars of loading a mixture), and
    ``transformers`` at warnings on ranks other than 0. ``datasets`` is not imported for this: when it is not
    loaded yet, ``HF_DATASETS_DISABLE_PROGRESS_BARS=1`` makes it start quiet."""
    rank = process_rank() if rank is None else rank
    if os.environ.get("HF_DATASETS_DISABLE_PROGRESS_BARS") is None:
        if "datasets" in sys.modules:
            import datasets

            datasets.disable_progress_bars()
        else:
            os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    if rank != 0:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_warning()
        hf_logging.disable_progress_bar()
