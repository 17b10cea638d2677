"""The files a run reads, recorded so that the record works from any folder.

A run records its configuration twice: in ``OUTPUT/config.yaml`` (``dynabatch train --config`` runs it again) and in
every checkpoint's manifest (``--resume-from-checkpoint`` compares the new settings with it). Paths as typed are
relative to the folder the run was started from, so the record was only good from there: ``--config`` from another
folder named a model folder that was not there, and a resume that spelled the same files otherwise
(``./t5`` against ``/home/me/t5``, ``targets=a, inputs=q`` against ``inputs=q,targets=a``) was refused as a changed
setting. :func:`run_paths` writes each local path a run reads as an absolute path and ``--columns`` in one spelling;
names that are not local paths (a model preset, ``builtin``, a cached hub dataset) stay as they are.
"""

from __future__ import annotations

import os
from typing import Any

from dynabatch.data.inputs import parse_columns
from dynabatch.data.source_spec import CAST_FIELDS
from dynabatch.data.tokenize import AUTO, TOKENIZER_NAMES

PATH_FIELDS = ("model", "tokenizer", "mixture", "eval_mixture", "data", "cost_profile", "calibration_file")
"""Configuration fields that may name a local file or folder the run reads."""


def local_path(field: str, value: Any) -> Any:
    """``value`` of ``field`` as an absolute path when the run reads it as a local path (a model folder, a
    tokenizer folder that is none of the tokenizer names, an existing file or folder for the others), else as it is."""
    if not isinstance(value, str) or not value:
        return value
    if field == "tokenizer" and value in (AUTO, *TOKENIZER_NAMES):
        return value
    found = os.path.isdir(value) if field in ("model", "tokenizer") else os.path.exists(value)
    return os.path.abspath(value) if found else value


def canonical_columns(text: str | None) -> str | None:
    """``--columns`` in one spelling (``inputs=question,targets=answer``: no spaces, the fields in
    :data:`~dynabatch.data.source_spec.CAST_FIELDS` order, whatever order they were given in); malformed text as it is
    (refused where it is read)."""
    try:
        columns = parse_columns(text)
    except ValueError:
        return text
    return ",".join(f"{k}={columns[k]}" for k in CAST_FIELDS if k in columns) if columns else text


def run_paths(values: dict[str, Any]) -> dict[str, Any]:
    """A configuration's fields (``TrainConfig.to_dict()``, or a checkpoint's record of one) with every local path
    absolute (:func:`local_path`, relative paths taken from the current folder) and ``columns`` canonical."""
    out = dict(values)
    for name in PATH_FIELDS:
        if name in out:
            out[name] = local_path(name, out[name])
    if out.get("columns"):
        out["columns"] = canonical_columns(out["columns"])
    return out
