"""What a mixture source is and what a usable row is: :class:`SourceSpec`, its spec-file type checks, and row checks.

A :class:`SourceSpec` is one entry of a mixture spec (a hub dataset or local dataset folder, local data files, a
built-in task, or a dataset handed over in memory), checked when it is built: spec-file values against the kinds
of :data:`SPEC_KINDS`, numbers by :func:`check_finite`. The row rules every loaded source is held to live here
too: :func:`as_text` casts a scalar that is not text (an int, float or bool) to its text, :func:`check_row` says
why a normalised ``{task, inputs, targets}`` row is malformed, and :class:`BadRowError` is the error that names
such a row. Loading a source lives in :mod:`dynabatch.data.sources`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

FIELDS = ("inputs", "targets")
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
BAD_ROW_POLICIES = ("error", "skip")
BAD_ROW_ADVICE = "set bad_rows: skip in the mixture spec (or pass --bad-rows skip) to drop and count such rows"
"""How to skip malformed rows, for error messages: the spec key and the command-line flag both exist."""

SPEC_KINDS: dict[str, Callable[[Any], bool]] = {
    "a string": lambda v: isinstance(v, str),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "a mapping of names to strings": lambda v: isinstance(v, dict) and all(
        isinstance(k, str) and isinstance(x, str) for k, x in v.items()),
    "a file path or a list of file paths": lambda v: isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(x, str) for x in v)),
}
"""What a spec value may be, by the description used in error messages."""


def check_spec_types(raw: dict[str, Any], kinds: dict[str, str], nullable: set[str], where: str = "") -> None:
    """``ValueError`` naming the first key of ``raw`` whose value is not of its kind in ``kinds``.

    ``where`` follows the key in the message (e.g. `` of source 'qa'``); keys in ``nullable`` may be null.
    """
    for key, kind in kinds.items():
        if key not in raw or (raw[key] is None and key in nullable):
            continue
        value = raw[key]
        if not SPEC_KINDS[kind](value):
            raise ValueError(f"{key!r}{where} must be {kind}, got {type(value).__name__} {value!r:.60}")


def check_finite(name: str, value: float | None, minimum: float, inclusive: bool = True) -> None:
    """``ValueError`` unless ``value`` is ``None`` or a finite number ``>= minimum`` (``>`` if not inclusive)."""
    if value is None:
        return
    ok = math.isfinite(value) and (value >= minimum if inclusive else value > minimum)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>=' if inclusive else '>'} {minimum:g}, got {value}")


SOURCE_KINDS = {
    "task": "a string", "hf": "a string", "hf_config": "a string", "data_files": "a file path or a list of file paths",
    "builtin": "a string", "num_examples": "an integer", "seed": "an integer", "split": "a string",
    "columns": "a mapping of names to strings", "template": "a mapping of names to strings", "rate": "a number",
    "max_examples": "an integer", "bad_rows": "a string",
}
"""The kind of every :class:`SourceSpec` key in a spec file."""


@dataclass(frozen=True)
class SourceSpec:
    """One entry of a mixture spec."""

    task: str
    """Task name attached to every row of this source (a ``task`` column, if present, wins)."""
    hf: str | None = None
    """Hub dataset name for ``datasets.load_dataset`` (needs internet, or the local Hugging Face cache of it), or a
    local dataset folder (``save_to_disk`` output, or data files ``load_dataset`` can read)."""
    hf_config: str | None = None
    """Hub dataset configuration name."""
    data_files: tuple[str, ...] = ()
    """Local files; relative paths are resolved against the spec file's folder."""
    builtin: str | None = None
    """Name of a built-in offline task (see :mod:`dynabatch.data.builtin`)."""
    num_examples: int = 2000
    """Examples generated for a built-in task."""
    seed: int = 0
    """Seed of a built-in task's generator."""
    split: str = "train"
    columns: dict[str, str] = field(default_factory=dict)
    """Map from our field (``task``, ``inputs``, ``targets``) to the source's column name."""
    template: dict[str, str] = field(default_factory=dict)
    """Optional ``str.format`` templates for ``inputs``/``targets`` over the row's columns."""
    rate: float | None = None
    """Fixed mixing rate (all sources or none must set it)."""
    max_examples: int | None = None
    """Use at most this many rows of the source."""
    bad_rows: str | None = None
    """Malformed rows of this source: ``error`` or ``skip`` (``None``: the mixture's ``bad_rows``)."""
    in_memory: bool = False
    """The rows are a ``datasets.Dataset`` / ``IterableDataset`` given with the spec (Python only, not in spec
    files): :func:`~dynabatch.data.sources.load_normalised`'s ``dataset``. An ``IterableDataset`` is read up to
    ``max_examples`` rows."""

    def __post_init__(self) -> None:
        kinds = [k for k, v in (("hf", self.hf), ("data_files", self.data_files), ("builtin", self.builtin),
                                ("in_memory", self.in_memory)) if v]
        if len(kinds) != 1:
            raise ValueError(
                f"source {self.task!r}: give exactly one of 'hf', 'data_files' or 'builtin' (got {kinds or 'none'})"
            )
        unknown = set(self.columns) - {"task", *FIELDS}
        if unknown:
            raise ValueError(f"source {self.task!r}: unknown keys in 'columns': {sorted(unknown)}; valid: task, inputs, targets")
        unknown = set(self.template) - set(FIELDS)
        if unknown:
            raise ValueError(f"source {self.task!r}: unknown keys in 'template': {sorted(unknown)}; valid: inputs, targets")
        check_finite(f"source {self.task!r}: rate", self.rate, 0)
        if self.builtin and self.num_examples <= 0:
            raise ValueError(f"source {self.task!r}: num_examples must be > 0, got {self.num_examples}")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"source {self.task!r}: max_examples must be >= 1, got {self.max_examples}")
        if self.seed < 0:
            raise ValueError(f"source {self.task!r}: seed must be >= 0, got {self.seed}")
        if self.bad_rows is not None and self.bad_rows not in BAD_ROW_POLICIES:
            raise ValueError(f"source {self.task!r}: bad_rows must be one of {BAD_ROW_POLICIES}, got {self.bad_rows!r}")

    @staticmethod
    def from_dict(raw: dict[str, Any], base_dir: str = ".") -> "SourceSpec":
        """Build from a spec-file entry; ``data_files`` may be a string or list. Types are checked first."""
        if not isinstance(raw, dict) or not isinstance(raw.get("task"), str) or not raw["task"].strip():
            raise ValueError(f"each mixture source is a mapping with a 'task' name (a non-empty string), got {raw!r:.80}")
        known = set(SourceSpec.__dataclass_fields__) - {"in_memory"}  # in-memory datasets come from Python only
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"source {raw['task']!r}: unknown keys {sorted(unknown)}; valid: {sorted(known)}")
        nullable = {f.name for f in fields(SourceSpec) if f.default is None} | {"data_files"}
        check_spec_types(raw, SOURCE_KINDS, nullable, where=f" of source {raw['task']!r}")
        raw = dict(raw)
        files = raw.get("data_files") or ()
        files = [files] if isinstance(files, str) else list(files)
        raw["data_files"] = tuple(f if os.path.isabs(f) else os.path.normpath(os.path.join(base_dir, f)) for f in files)
        return SourceSpec(**raw)


class BadRowError(ValueError):
    """A row of a source cannot be used."""


def check_row(row: dict[str, Any], source: str, row_index: int) -> str | None:
    """Why a normalised row is malformed, or ``None`` if it is fine."""
    for name in ("task", *FIELDS):
        if name not in row or row[name] is None:
            return f"missing field {name!r}"
        if not isinstance(row[name], str):
            return f"field {name!r} must be text or a number, got {type(row[name]).__name__} {row[name]!r:.40}"
    if not row["targets"].strip():
        return "empty 'targets'"
    if not row["task"].strip():
        return "empty 'task'"
    return None


def as_text(value: Any) -> tuple[Any, bool]:
    """``(value as text, whether it was cast)``: an int, float or bool (a CSV's numeric column) becomes its text
    (cast), NaN (an empty numeric cell) becomes missing; text, ``None``, lists and mappings stay as they are (the
    latter are malformed rows, :func:`check_row`)."""
    if isinstance(value, float) and math.isnan(value):
        return None, False
    if isinstance(value, (int, float)):  # bool included: "True" / "False"
        return str(value), True
    return value, False


CAST_FIELDS = ("task", *FIELDS)
"""Fields whose casts are counted, in the order of :attr:`~dynabatch.data.sources.NormalisedSource.casts`."""
