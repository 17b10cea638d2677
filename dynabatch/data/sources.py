"""Mixture sources: where rows come from and how they become ``{task, inputs, targets}``.

A source is a Hugging Face hub dataset (``hf:``), local files (``data_files:``: json, jsonl,
parquet, arrow, csv) or a built-in offline generator (``builtin:``). Every source is loaded through
``datasets`` so its rows are cached on disk, then normalised: columns renamed by ``columns``
(FLAN names ``inputs``/``targets`` by default), an optional ``template`` applied, and every row
validated. A malformed row (missing field, non-string, empty target) is an error naming the source,
the row and the fix, or - with ``bad_rows: skip`` - is dropped and counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from dynabatch import __version__

FIELDS = ("inputs", "targets")
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
BAD_ROW_POLICIES = ("error", "skip")


@dataclass(frozen=True)
class SourceSpec:
    """One entry of a mixture spec."""

    task: str
    """Task name attached to every row of this source (a ``task`` column, if present, wins)."""
    hf: str | None = None
    """Hub dataset name for ``datasets.load_dataset`` (needs internet, or a local hub cache)."""
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

    def __post_init__(self) -> None:
        kinds = [k for k, v in (("hf", self.hf), ("data_files", self.data_files), ("builtin", self.builtin)) if v]
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
        if self.rate is not None and not self.rate >= 0:
            raise ValueError(f"source {self.task!r}: rate must be >= 0, got {self.rate}")
        if self.builtin and self.num_examples <= 0:
            raise ValueError(f"source {self.task!r}: num_examples must be > 0, got {self.num_examples}")

    @staticmethod
    def from_dict(raw: dict[str, Any], base_dir: str = ".") -> "SourceSpec":
        """Build from a spec-file entry; ``data_files`` may be a string or list."""
        if not isinstance(raw, dict) or "task" not in raw:
            raise ValueError(f"each mixture source needs a 'task' name, got {raw!r}")
        known = set(SourceSpec.__dataclass_fields__)
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"source {raw['task']!r}: unknown keys {sorted(unknown)}; valid: {sorted(known)}")
        raw = dict(raw)
        files = raw.get("data_files") or ()
        files = [files] if isinstance(files, str) else list(files)
        raw["data_files"] = tuple(f if os.path.isabs(f) else os.path.normpath(os.path.join(base_dir, f)) for f in files)
        return SourceSpec(**raw)


def _builtin_rows(task: str, num_examples: int, seed: int, version: str):
    from dynabatch.data.builtin import generate_examples

    yield from generate_examples(task, num_examples, seed)


class BadRowError(ValueError):
    """A row of a source cannot be used."""


def check_row(row: dict[str, Any], source: str, row_index: int) -> str | None:
    """Why a normalised row is malformed, or ``None`` if it is fine."""
    for name in ("task", *FIELDS):
        if name not in row or row[name] is None:
            return f"missing field {name!r}"
        if not isinstance(row[name], str):
            return f"field {name!r} must be a string, got {type(row[name]).__name__} {row[name]!r:.40}"
    if not row["targets"].strip():
        return "empty 'targets'"
    if not row["task"].strip():
        return "empty 'task'"
    return None


def _load_raw(spec: SourceSpec):
    import datasets

    if spec.builtin:
        from dynabatch.data.builtin import BUILTIN_TASKS

        if spec.builtin not in BUILTIN_TASKS:
            raise ValueError(f"source {spec.task!r}: unknown built-in task {spec.builtin!r}; valid: {', '.join(BUILTIN_TASKS)}")
        # The package version is part of the cache key, so an upgrade never reuses stale rows.
        kwargs = {"task": spec.builtin, "num_examples": spec.num_examples, "seed": spec.seed, "version": __version__}
        return datasets.Dataset.from_generator(_builtin_rows, gen_kwargs=kwargs)
    if spec.hf:
        return datasets.load_dataset(spec.hf, spec.hf_config, split=spec.split)
    missing = [f for f in spec.data_files if not os.path.exists(f)]
    if missing:
        raise FileNotFoundError(f"source {spec.task!r}: data file(s) not found: {missing}")
    if spec.data_files and all(os.path.getsize(f) == 0 for f in spec.data_files):
        raise ValueError(
            f"source {spec.task!r} has no rows: {list(spec.data_files)} is empty; "
            "remove the source from the mixture or fix its files"
        )
    exts = {os.path.splitext(f)[1].lower() for f in spec.data_files}
    builders = {FILE_BUILDERS.get(e) for e in exts}
    if None in builders or len(builders) != 1:
        raise ValueError(
            f"source {spec.task!r}: cannot load files with extensions {sorted(exts)}; "
            f"use one kind of {sorted(FILE_BUILDERS)}"
        )
    try:
        return datasets.load_dataset(builders.pop(), data_files=list(spec.data_files), split="train")
    except Exception as e:  # datasets wraps parse and decode errors several levels deep
        raise BadRowError(
            f"source {spec.task!r}: could not read {list(spec.data_files)}: {type(e).__name__}: {e}. "
            "Check that the file is valid UTF-8 and well-formed (one JSON object per line for .jsonl)."
        ) from e


def load_source(spec: SourceSpec, bad_rows: str = "error", num_proc: int | None = None):
    """Load one source as a ``datasets.Dataset`` with string columns ``task``, ``inputs``, ``targets``.

    Returns ``(dataset, num_skipped)``. Rows are validated after renaming and templating; with
    ``bad_rows="error"`` the first malformed row raises :class:`BadRowError` naming it.
    """
    if bad_rows not in BAD_ROW_POLICIES:
        raise ValueError(f"bad_rows must be one of {BAD_ROW_POLICIES}, got {bad_rows!r}")
    ds = _load_raw(spec)
    if spec.max_examples is not None:
        ds = ds.select(range(min(spec.max_examples, len(ds))))
    if len(ds) == 0:
        raise ValueError(f"source {spec.task!r} has no rows; remove it from the mixture or fix its files")
    names = {"task": spec.columns.get("task", "task"), **{f: spec.columns.get(f, f) for f in FIELDS}}
    for f in FIELDS:
        if names[f] not in ds.column_names and f not in spec.template:
            raise BadRowError(
                f"source {spec.task!r}: column {names[f]!r} (for {f!r}) not found; columns are {ds.column_names}. "
                f"Map it with columns: {{{f}: <column>}}."
            )

    def normalise(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"task": [], "inputs": [], "targets": [], "_bad": []}
        for k, idx in enumerate(indices):
            row = {c: batch[c][k] for c in batch}
            new = {"task": row.get(names["task"]) or spec.task}
            for f in FIELDS:
                new[f] = spec.template[f].format_map(_Missing(row)) if f in spec.template else row.get(names[f])
            problem = check_row(new, spec.task, idx)
            if problem is not None and bad_rows == "error":
                raise BadRowError(
                    f"source {spec.task!r}, row {idx}: {problem}. Fix the row, map the right column with "
                    f"'columns', or set bad_rows: skip to drop and count such rows."
                )
            for f in ("task", *FIELDS):
                out[f].append(new[f] if isinstance(new[f], str) else "")
            out["_bad"].append(problem is not None)
        return out

    try:
        ds = ds.map(normalise, batched=True, with_indices=True, remove_columns=ds.column_names,
                    desc=f"validate {spec.task}")
    except UnicodeDecodeError as e:  # a value that is not UTF-8 surfaces only when rows are read
        where = list(spec.data_files) or spec.hf or spec.builtin
        raise BadRowError(
            f"source {spec.task!r}: {where} has text that is not valid UTF-8 ({e}); re-encode the file as UTF-8"
        ) from e
    num_bad = int(sum(ds["_bad"]))
    if num_bad:
        ds = ds.filter(lambda b: [not x for x in b], input_columns="_bad", batched=True)
    ds = ds.remove_columns("_bad")
    if len(ds) == 0:
        raise ValueError(f"source {spec.task!r}: all {num_bad} rows are malformed")
    return ds, num_bad


class _Missing(dict):
    """format_map mapping that reports a missing template column clearly."""

    def __missing__(self, key: str) -> str:
        raise BadRowError(f"template refers to column {key!r} which the row does not have; columns: {sorted(self)}")
