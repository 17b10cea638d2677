"""``dynabatch simulate --trace-dir``: which methods' first step it draws, the files it writes (a Chrome trace and a
timeline each), and the checks made before anything is simulated."""

from __future__ import annotations

import os

from dynabatch.commands.common import check_output_file, write_json
from dynabatch.schedule.trace import plot_timeline, to_chrome_trace


TRACED_METHODS = ("dynamic", "packing")
"""The methods whose first step ``--trace-dir`` writes."""


def trace_paths(trace_dir: str, method: str) -> tuple[str, str]:
    """The Chrome trace (.json) and the timeline (.png) ``--trace-dir`` writes for ``method``."""
    base = os.path.join(trace_dir, f"{method}_step0")
    return base + ".json", base + ".png"


def check_trace_dir(trace_dir: str | None, methods, placement: str = "linear") -> None:
    """Before anything is simulated: ``--trace-dir`` is a folder (or none yet), ``--placement`` runs the linear
    placement, the one a trace draws (or may pick it: ``auto``), and every file it would write is new or one a
    dynabatch command wrote (:func:`~dynabatch.commands.output_files.check_output_file`)."""
    if not trace_dir:
        return
    if placement not in ("linear", "auto"):  # a virtual placement's steps are not drawn: nothing would be written
        raise ValueError(f"--trace-dir draws steps on the linear placement (one chunk per device), and --placement "
                         f"{placement} runs none; drop --trace-dir, or pass --placement linear (or auto)")
    if os.path.exists(trace_dir) and not os.path.isdir(trace_dir):
        raise ValueError(f"--trace-dir {trace_dir!r} is a file, not a folder; pass a folder path")
    if not any(method in TRACED_METHODS for method in methods):  # else nothing is written, without a word
        raise ValueError(f"--trace-dir writes the first step of {' and '.join(TRACED_METHODS)}, and --methods "
                         f"{','.join(methods)} runs neither; add {' or '.join(TRACED_METHODS)} to --methods, or drop "
                         "--trace-dir")
    for method in methods:
        if method in TRACED_METHODS:
            for path in trace_paths(trace_dir, method):
                check_output_file(path, "--trace-dir", command="simulate")


def write_traces(trace_dir: str, method: str, result, shapes) -> None:
    """The Chrome trace and the timeline of ``method``'s first step, both marked as ``dynabatch simulate``'s."""
    trace, png = trace_paths(trace_dir, method)
    write_json(to_chrome_trace(result, shapes=shapes, process_name=f"{method} (simulated)"), trace, indent=None,
               command="simulate")
    plot_timeline(result, png, title=f"{method}: simulated step 0 ({result.schedule.policy})",
                  software="dynabatch simulate")
