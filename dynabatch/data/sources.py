"""Mixture sources: where rows come from and how they become ``{task, inputs, targets}``.

A source is a Hugging Face hub dataset (``hf:``: a hub name, read from the local cache when offline, or a local
dataset folder: one written by ``save_to_disk`` or a folder of data files), local files (``data_files:``: json,
jsonl, parquet, arrow, csv), a built-in offline generator (``builtin:``) or, from Python only, a
``datasets.Dataset`` / ``IterableDataset`` handed over in memory (``in_memory``; see
:meth:`dynabatch.data.pipeline.MixtureData.from_datasets`). Every source is loaded through ``datasets``, then
normalised: columns renamed by ``columns`` (FLAN names ``inputs``/``targets`` by default), an optional
``template`` applied, and every row validated. Scalars that are not text (ints, floats, bools: a CSV's numeric
column) are cast to their text and counted per field (:attr:`NormalisedSource.casts`). A malformed row (missing
field, ``None``, a list or a mapping, empty target) is an error naming the source, the row and the fix, or -
with ``bad_rows: skip`` - is dropped and counted.

What a source spec holds and the row rules are in :mod:`dynabatch.data.source_spec`; the JSON files re-read row
by row (mixed-type columns, lines that are not JSON objects) in :mod:`dynabatch.data.json_rows`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynabatch import __version__
from dynabatch.data.builtin import BUILTIN_TASKS, generate_examples
from dynabatch.data.json_rows import exact_mixed_columns, json_lines
from dynabatch.data.source_spec import (BAD_ROW_ADVICE, BAD_ROW_POLICIES, CAST_FIELDS, FIELDS, FILE_BUILDERS,
                                        BadRowError, SourceSpec, as_text, check_row)

logger = logging.getLogger(__name__)


def _builtin_rows(task: str, num_examples: int, seed: int, version: str):
    yield from generate_examples(task, num_examples, seed)


@dataclass(frozen=True)
class NormalisedSource:
    """One source, loaded and normalised (:func:`load_normalised`)."""

    dataset: Any
    """``datasets.Dataset`` with string columns ``task``, ``inputs``, ``targets`` (and ``source_row`` when rows
    were skipped: the kept rows' original row numbers)."""
    num_skipped: int = 0
    """Malformed rows dropped under ``bad_rows: skip``."""
    casts: dict[str, int] = field(default_factory=dict)
    """Field -> values of kept rows that were numbers or bools, cast to text (only fields with casts)."""


def _is_saved_dataset(folder: str) -> bool:
    """A folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``load_dataset`` refuses those)."""
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("state.json", "dataset_dict.json"))


FOLDER_FORMATS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".csv": "csv", ".parquet": "parquet",
                  ".arrow": "arrow"}
"""The format ``datasets`` reads each data file extension of a folder as (the extensions a source documents)."""
FOLDER_METADATA = ("dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json")
"""JSON files of a dataset folder that describe it and are not rows."""


def _check_one_format(spec: SourceSpec) -> None:
    """A ``ValueError`` when the ``hf:`` folder of data files holds files of several formats: ``datasets`` reads a
    folder in the format most of its files have and skips the others without a word (hidden and ``_`` names, as
    ``datasets`` skips them, and the folder's metadata files, :data:`FOLDER_METADATA`, are not counted)."""
    found: dict[str, list[str]] = {}
    for root, dirs, files in os.walk(spec.hf):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        for name in files:
            kind = FOLDER_FORMATS.get(os.path.splitext(name)[1].lower())
            if kind is not None and not name.startswith((".", "_")) and name not in FOLDER_METADATA:
                found.setdefault(kind, []).append(os.path.relpath(os.path.join(root, name), spec.hf))
    if len(found) > 1:
        listed = _listed(found)
        raise ValueError(f"source {spec.task!r}: folder {spec.hf} holds data files of {len(found)} formats ({listed}); "
                         "datasets reads one format of a folder and would skip the other files: put each format in a "
                         "folder of its own (a source each in a mixture spec), or convert the files to one format")


def _listed(groups: dict[str, list[str]]) -> str:
    """``"csv: a.csv; json: b.jsonl, c.jsonl, d.jsonl ..."``: each group's first three files, groups by name."""
    return "; ".join(f"{name}: {', '.join(sorted(files)[:3])}{' ...' if len(files) > 3 else ''}"
                     for name, files in sorted(groups.items()))


def _check_splits(spec: SourceSpec) -> None:
    """Log when ``datasets`` sorts some files of the ``hf:`` folder into splits other than the source's (a
    ``test.jsonl`` next to ``train.jsonl`` is split ``test``): those files are not read, and nothing else says so.
    A ``ValueError`` when it sorts none into the source's split (``a.jsonl`` next to ``test.jsonl``: ``a.jsonl``
    matches no split's name and is not read at all)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        files = DataFilesDict.from_patterns(get_data_patterns(spec.hf), base_path=spec.hf)
    except Exception:  # no data files, or a layout datasets itself refuses: load_dataset says what is wrong
        return
    others = {str(name): [os.path.relpath(f, spec.hf) for f in found] for name, found in files.items()
              if str(name) != spec.split and found}
    if not others:
        return
    listed = _listed(others)
    if not any(str(name) == spec.split for name in files):
        raise ValueError(f"source {spec.task!r}: datasets sorts the files of folder {spec.hf} into splits by their "
                         f"names ({listed}) and none into split {spec.split!r}, the one read; name the training files "
                         "train*.jsonl (or .csv, ...), or pass a file as its own source (--data FILE, or data_files: in "
                         "a mixture spec)")
    logger.info(f"source {spec.task!r}: folder {spec.hf} reads split {spec.split!r}; datasets sorts its other files "
                f"into other splits by their names, and they are not read ({listed}); pass such a file as its own "
                "source (--data FILE, or data_files: in a mixture spec) to read it")


def _load_hub(spec: SourceSpec):
    """``datasets.load_dataset`` of an ``hf:`` source (``load_from_disk`` for a ``save_to_disk`` folder); offline,
    uncached or unknown datasets are one-line errors."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    name = spec.hf + (f" (config {spec.hf_config!r})" if spec.hf_config else "")
    if os.path.isdir(spec.hf) and _is_saved_dataset(spec.hf):
        saved = datasets.load_from_disk(spec.hf)
        if isinstance(saved, datasets.DatasetDict):
            if spec.split not in saved:
                one = os.path.join(spec.hf, sorted(saved)[0])
                raise ValueError(f"source {spec.task!r}: saved dataset {spec.hf} has no split {spec.split!r}; "
                                 f"its splits are {sorted(saved)}: pass a split's folder (--data {one}), or set "
                                 f"split: in the mixture spec's source")
            saved = saved[spec.split]
        return saved
    if os.path.isdir(spec.hf):
        _check_one_format(spec)
        _check_splits(spec)
    try:
        return datasets.load_dataset(spec.hf, spec.hf_config, split=spec.split)
    except ConnectionError as e:  # offline mode, or the hub unreachable, with no local cache of the dataset
        raise ValueError(
            f"source {spec.task!r}: hub dataset {name} cannot be loaded: it needs internet access or a local "
            f"Hugging Face cache of it ({e}); download it once online, or give the source data_files: with local copies"
        ) from e
    except (DatasetNotFoundError, FileNotFoundError) as e:
        raise FileNotFoundError(
            f"source {spec.task!r}: hub dataset {name} not found ({' '.join(str(e).split())[:300]}); check the name, "
            "or give the source data_files: with local copies"
        ) from e


def _load_raw(spec: SourceSpec, dataset=None, bad_rows: str = "error"):
    """The source's rows as loaded, and how many lines could not be read as rows (skipped under
    ``bad_rows="skip"``: lines of a .jsonl file that are not JSON objects)."""
    import datasets

    if spec.in_memory:
        return _in_memory_rows(spec, dataset), 0
    if dataset is not None:
        raise ValueError(f"source {spec.task!r} loads its own rows; a dataset is given only with in_memory=True")
    if spec.builtin:
        if spec.builtin not in BUILTIN_TASKS:
            raise ValueError(f"source {spec.task!r}: unknown built-in task {spec.builtin!r}; valid: {', '.join(BUILTIN_TASKS)}")
        # The package version is part of the cache key, so an upgrade never reuses stale rows.
        kwargs = {"task": spec.builtin, "num_examples": spec.num_examples, "seed": spec.seed, "version": __version__}
        return datasets.Dataset.from_generator(_builtin_rows, gen_kwargs=kwargs), 0
    if spec.hf:
        return _load_hub(spec), 0
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
    builder = builders.pop()
    try:
        with _builder_log_quiet(builder):
            ds = datasets.load_dataset(builder, data_files=list(spec.data_files), split="train")
        return (exact_mixed_columns(ds, spec.data_files) if builder == "json" else ds), 0
    except Exception as e:  # datasets wraps parse and decode errors several levels deep
        lines = json_lines(spec.data_files) if exts == {".jsonl"} else None
        if lines is not None and lines.bad:
            path, line, why = lines.bad[0]
            if bad_rows == "skip" and lines.rows:
                warnings.warn(f"source {spec.task!r}: {len(lines.bad)} line(s) that are not JSON objects skipped "
                              f"(first: {path}, line {line}: {why})", stacklevel=2)
                return datasets.Dataset.from_list(lines.rows), len(lines.bad)
            raise BadRowError(
                f"source {spec.task!r}: could not read {path}, line {line}: not a JSON object ({why}); fix that line "
                f"(one JSON object per line), or {BAD_ROW_ADVICE}") from None
        raise BadRowError(
            f"source {spec.task!r}: could not read {list(spec.data_files)}: {type(e).__name__}: {e}. "
            "Check that the file is valid UTF-8 and well-formed (one JSON object per line for .jsonl)."
        ) from e


@contextlib.contextmanager
def _builder_log_quiet(builder: str):
    """``datasets``' file builder ``builder`` (``json``, ``csv``, ...) logs a parse error ("Failed to load JSON
    from file ...") before it raises it; the error raised from it here names the file and line, so that log would
    be a second line. Its logger is silenced for this load only, then set back."""
    builder_logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    level = builder_logger.level
    builder_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        builder_logger.setLevel(level)


def _in_memory_rows(spec: SourceSpec, dataset):
    """The rows of an in-memory source as a ``datasets.Dataset``: a ``Dataset`` as it is, an ``IterableDataset``
    (streaming) read up to ``spec.max_examples`` rows into memory, so the sampler can draw rows by index and a
    checkpoint's data position (row cursors) resumes exactly when the stream yields the same rows again."""
    import itertools

    import datasets

    if isinstance(dataset, datasets.Dataset):
        return dataset
    if not isinstance(dataset, datasets.IterableDataset):
        raise ValueError(f"source {spec.task!r}: expected a datasets.Dataset or IterableDataset, got "
                         f"{type(dataset).__name__}")
    if spec.max_examples is None:
        raise ValueError(f"source {spec.task!r}: a streaming IterableDataset needs max_examples (the rows read into "
                         "memory)")
    rows = list(itertools.islice(iter(dataset), spec.max_examples + 1))
    if not rows:
        raise ValueError(f"source {spec.task!r} has no rows: the IterableDataset yielded none")
    if len(rows) > spec.max_examples:
        warnings.warn(f"source {spec.task!r}: the IterableDataset has more than {spec.max_examples} rows; the first "
                      f"{spec.max_examples} are used (raise max_stream_rows= of DynaBatchDataLoader or "
                      "MixtureData.from_datasets, or its max_examples, to use more)", stacklevel=2)
        rows.pop()
    return datasets.Dataset.from_list(rows)


def load_source(spec: SourceSpec, bad_rows: str | None = None, num_proc: int | None = None):
    """``(dataset, num_skipped)`` of :func:`load_normalised` (the casts left out)."""
    out = load_normalised(spec, bad_rows)
    return out.dataset, out.num_skipped


def load_normalised(spec: SourceSpec, bad_rows: str | None = None, dataset=None) -> NormalisedSource:
    """Load one source as a ``datasets.Dataset`` with string columns ``task``, ``inputs``, ``targets``.

    Rows are validated after renaming, templating and casting scalars to text; with ``bad_rows="error"`` the
    first malformed row raises :class:`BadRowError` naming it, with ``skip`` malformed rows are dropped,
    counted, and the kept rows' original row numbers are in an int64 column ``source_row`` (absent when
    nothing was skipped: row ``i`` is then source row ``i``). ``bad_rows=None`` uses the source's own
    ``bad_rows`` (default ``error``). ``dataset``: the rows of an ``in_memory`` source.
    """
    if bad_rows is None:
        bad_rows = spec.bad_rows or "error"
    if bad_rows not in BAD_ROW_POLICIES:
        raise ValueError(f"bad_rows must be one of {BAD_ROW_POLICIES}, got {bad_rows!r}")
    ds, unreadable = _load_raw(spec, dataset, bad_rows)  # rows are numbered among the readable lines
    if spec.max_examples is not None:
        ds = ds.select(range(min(spec.max_examples, len(ds))))
    if len(ds) == 0:
        if spec.in_memory:  # a dataset passed in Python: DynaBatchDataLoader's data, or train's datasets=
            raise ValueError(f"dataset {spec.task!r} passed in memory (DynaBatchDataLoader data= or datasets=) has "
                             "no rows; pass a dataset with rows, or leave this one out")
        raise ValueError(f"source {spec.task!r} has no rows; remove it from the mixture or fix its files")
    names = {"task": spec.columns.get("task", "task"), **{f: spec.columns.get(f, f) for f in FIELDS}}
    for f in CAST_FIELDS:
        if names[f] not in ds.column_names and f not in spec.template and (f != "task" or "task" in spec.columns):
            raise BadRowError(
                f"source {spec.task!r}: column {names[f]!r} (for {f!r}) not found; columns are {ds.column_names}. "
                f"Map it with columns: {{{f}: <column>}} in a mixture spec, or --columns {f}=<column> with --data."
            )

    def normalise(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"task": [], "inputs": [], "targets": [], "_bad": [], "_cast": [], "source_row": []}
        for k, idx in enumerate(indices):
            row = {c: batch[c][k] for c in batch}
            new, cast = {}, 0
            for bit, f in enumerate(CAST_FIELDS):
                if f in spec.template:
                    new[f] = _apply_template(spec, f, row)
                    continue
                new[f], was_cast = as_text(row.get(names[f]))
                cast |= was_cast << bit
            new["task"] = new["task"] or spec.task  # no task column (or an empty cell): the source's task
            problem = check_row(new, spec.task, idx)
            if problem is not None and bad_rows == "error":
                raise BadRowError(
                    f"source {spec.task!r}, row {idx}: {problem}. Fix the row, map the right column with "
                    f"'columns', or {BAD_ROW_ADVICE}."
                )
            for f in CAST_FIELDS:
                out[f].append(new[f] if isinstance(new[f], str) else "")
            out["_bad"].append(problem is not None)
            out["_cast"].append(cast)
            out["source_row"].append(idx)
        return out

    try:
        ds = ds.map(normalise, batched=True, with_indices=True, remove_columns=ds.column_names,
                    features=_normalised_features(), desc=f"validate {spec.task}",
                    cache_file_name=_cache_outside_user_folder(spec, ds, normalise))
    except UnicodeDecodeError as e:  # a value that is not UTF-8 surfaces only when rows are read
        where = list(spec.data_files) or spec.hf or spec.builtin or "the in-memory dataset"
        raise BadRowError(
            f"source {spec.task!r}: {where} has text that is not valid UTF-8 ({e}); re-encode the file as UTF-8"
        ) from e
    num_bad = int(sum(ds["_bad"]))
    if num_bad == len(ds):
        raise ValueError(
            f"source {spec.task!r}: all {num_bad} rows are malformed; fix the rows or map the right columns with 'columns'"
        )
    if num_bad:
        ds = ds.filter(lambda b: [not x for x in b], input_columns="_bad", batched=True)
    bits = ds.data.column("_cast").to_numpy()
    casts = {f: int(((bits >> i) & 1).sum()) for i, f in enumerate(CAST_FIELDS)}
    ds = ds.remove_columns(["_bad", "_cast"] if num_bad else ["_bad", "_cast", "source_row"])
    return NormalisedSource(ds, num_bad + unreadable, {f: n for f, n in casts.items() if n})


def _cache_outside_user_folder(spec: SourceSpec, ds, transform: Callable) -> str | None:
    """Where the first ``map`` of a ``save_to_disk`` source writes its result: a file in the ``datasets`` cache
    named by the dataset's fingerprint and the transform, so a second run reuses it. ``None`` (``datasets``'
    own choice) for every other source, whose files ``datasets`` has already copied into its cache.

    ``datasets`` memory-maps a saved folder's files in place and would write this map's ``cache-*.arrow``
    (and every later map's: the skip filter, the tokenizing) into the user's folder, one more per tokenizer
    and setting; the maps after this one write next to its result instead."""
    import datasets
    from datasets.fingerprint import Hasher

    if not (spec.hf and os.path.isdir(spec.hf) and datasets.is_caching_enabled() and ds.cache_files):
        return None
    folder = os.path.join(datasets.config.HF_DATASETS_CACHE, "dynabatch_saved_datasets")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"normalised-{Hasher.hash([ds._fingerprint, transform])}.arrow")


def _normalised_features():
    """Features of a normalised source, given to ``map`` explicitly: it would otherwise cast a returned column
    back to the type of the input column of the same name (a CSV's numeric ``targets`` to float64 again)."""
    from datasets import Features, Value

    return Features({"task": Value("string"), "inputs": Value("string"), "targets": Value("string"),
                     "_bad": Value("bool"), "_cast": Value("int8"), "source_row": Value("int64")})


def _apply_template(spec: SourceSpec, name: str, row: dict[str, Any]) -> str:
    """``spec.template[name]`` filled from the row's columns; a template that cannot apply is a clear error."""
    template = spec.template[name]
    try:
        return template.format_map(_Missing(row))
    except (ValueError, KeyError, IndexError, AttributeError, TypeError) as e:  # str.format's ways to fail
        raise BadRowError(
            f"source {spec.task!r}: template for {name!r} ({template!r:.60}) cannot be applied: {e}; "
            "a template uses {column} fields naming the source's columns"
        ) from e


class _Missing(dict):
    """format_map mapping that reports a missing template column clearly."""

    def __missing__(self, key: str) -> str:
        raise BadRowError(f"no column {key!r}; the columns are {sorted(self)}")
