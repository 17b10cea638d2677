"""Result files the commands write (``--json``, ``profile --out``, ``simulate --trace-dir``): never over a file no
dynabatch command wrote.

A command checks its output path before it does its work (:func:`check_output_file`), so a path it cannot write
(a folder, a path under a file) or must not write (an existing file that is not a dynabatch output: the command's
own input named by mistake, a user's file) is one line at once, not an error after minutes of work or a lost file.
:func:`write_json` marks what it writes (:data:`WRITTEN_BY`), creates missing folders and replaces the file whole.
"""

from __future__ import annotations

import os

WRITTEN_BY = "written_by"
"""The key a command's ``--json`` file carries (``"dynabatch plan"``, ...): a later run may replace that file, and
no other (:func:`check_output_file`)."""


PNG_MARK = b"tEXtSoftware\x00dynabatch"
"""How a PNG a command wrote is known: its ``Software`` text chunk starts with ``dynabatch``
(:func:`dynabatch.schedule.trace.plot_timeline` writes it)."""


def _written_by(path: str) -> str | None:
    """The :data:`WRITTEN_BY` mark of the JSON object at ``path`` (``"dynabatch bench"``, ...); ``None`` if none."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    mark = obj.get(WRITTEN_BY) if isinstance(obj, dict) else None
    return mark if isinstance(mark, str) and mark.startswith("dynabatch") else None


def _is_ours(path: str, ours) -> bool:
    """Whether the existing file at ``path`` is a dynabatch output: a PNG marked :data:`PNG_MARK`, a JSON object with
    :data:`WRITTEN_BY`, or one ``ours(obj)`` accepts (a command's older output, a profile)."""
    import json

    if path.endswith(".png"):
        try:
            with open(path, "rb") as f:
                return PNG_MARK in f.read(1 << 16)  # the text chunks come before the image data
        except OSError:
            return False
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and (str(obj.get(WRITTEN_BY, "")).startswith("dynabatch")
                                      or (ours is not None and bool(ours(obj))))


def check_output_file(path: str | None, flag: str = "--json", ours=None, command: str = "") -> None:
    """Before a command does its work: a one-line ``ValueError`` when its output file ``path`` cannot be written
    or must not be: a folder, a path under a file, an existing file no dynabatch command wrote (the command's own
    input named by mistake, the user's file), or, given the writing ``command`` (``"plan"``, ...), the output of
    another dynabatch command (``dynabatch plan --json`` over a bench result, ``profile --out`` over it), which is
    never replaced. ``-`` (stdout) and ``None`` pass; a missing parent folder is created when the file is written
    (:func:`write_json`)."""
    if not path or path == "-":
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder; pass a file path, e.g. {os.path.join(path, 'result.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path!r}: {parent!r} is a file, not a folder; pass another path")
    if os.path.exists(path) and not _is_ours(path, ours):
        raise ValueError(f"{flag} {path!r} exists and no dynabatch command wrote it, so it is left as it is; pass "
                         "another path (or move that file away)")
    writer = _written_by(path) if command and os.path.exists(path) else None
    if writer is not None and writer != f"dynabatch {command}":
        raise ValueError(f"{flag} {path!r} holds the output of `{writer}`, not of `dynabatch {command}`, so it is left "
                         "as it is; pass another path (or move that file away)")


def write_json(obj, target: str, indent: int = 2, command: str = "") -> bool:
    """``--json`` output; ``True`` when it went to stdout (the command then prints nothing else). A file (checked
    first by :func:`check_output_file`) is written whole or not at all, its folders created, and marked
    :data:`WRITTEN_BY` ``dynabatch COMMAND`` (given a ``command``)."""
    import json

    if target == "-":
        print(json.dumps(obj, indent=indent))
        return True
    if isinstance(obj, dict) and command:  # a command's result (the scripts write theirs unmarked)
        obj = {WRITTEN_BY: f"dynabatch {command}", **obj}
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent)
    os.replace(tmp, target)
    return False


def profile_file_problem(path: str | None, flag: str = "--cost-profile") -> str | None:
    """A ``--cost-profile`` / ``--compare-profile`` file that is not there, said before the ranks start (the file
    system only), in the words :meth:`dynabatch.cost.tables.CostTables.load` uses after they have: a missing file was
    said by every rank after the launch, the model build and the data (10-20 s on 2 cores)."""
    if path and not os.path.isfile(path):
        what = "is a folder" if os.path.isdir(path) else "not found"
        return f"{flag}: cost profile {path!r} {what}; pass a file written by `dynabatch profile`"
    return None
