"""Where a run's data comes from: a mixture spec, ``--data`` with ``--columns``, or datasets in memory.

One function, :func:`load_data`, turns any of them into a tokenized :class:`~dynabatch.data.pipeline.MixtureData`;
``dynabatch train`` (:func:`dynabatch.training.trainer.load_training_data`), ``dynabatch data-report`` and evaluation
call it.

``--data`` names a file (json/jsonl/csv/parquet/arrow), a local dataset folder (``save_to_disk`` output or a folder
of data files) or a dataset in the local Hugging Face cache (a hub name such as ``org/name``; with
``HF_HUB_OFFLINE=1`` ``datasets`` reads the cache and never downloads). It is one source whose task is named after
the file (its stem), the folder or the dataset; ``--columns inputs=question,targets=answer[,task=category]`` maps
the fields to its columns (a ``task`` column labels every row with its own task).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dynabatch.data.builtin import default_mixture_path
from dynabatch.data.mixture import MixtureSpec
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.source_spec import CAST_FIELDS, FILE_BUILDERS, SourceSpec

COLUMNS_EXAMPLE = "inputs=question,targets=answer[,task=category]"


COLUMNS_WITHOUT_DATA = ("--columns maps the columns of --data (or of in-memory datasets); pass --data FILE with it, or "
                        "drop --columns (a mixture spec maps its own)")
"""The one line for ``--columns`` given without ``--data``."""


def parse_columns(text: str | None) -> dict[str, str]:
    """``--columns`` text as ``{field: column}``; any malformed text is one ``ValueError`` line."""
    if not text or not text.strip():
        return {}
    out: dict[str, str] = {}
    for item in text.split(","):
        field, sep, column = (x.strip() for x in item.partition("="))
        if not sep or not field or not column:
            raise ValueError(f"--columns: {item.strip()!r} is not FIELD=COLUMN; write e.g. --columns {COLUMNS_EXAMPLE}")
        if field not in CAST_FIELDS:
            raise ValueError(f"--columns: unknown field {field!r} in {text!r}; the fields are {', '.join(CAST_FIELDS)} "
                             f"(e.g. --columns {COLUMNS_EXAMPLE})")
        if field in out:
            raise ValueError(f"--columns: field {field!r} is mapped twice in {text!r}; map each field once")
        out[field] = column
    return out


def data_spec(data: str, columns: str | Mapping[str, str] | None = None, seed: int = 0) -> MixtureSpec:
    """The one-source mixture of ``--data`` (a file, a local dataset folder or a cached hub dataset); ``seed``
    orders its rows."""
    cols = parse_columns(columns) if isinstance(columns, str) or columns is None else dict(columns)
    path = data.rstrip("/")
    if os.path.isfile(path):
        task = os.path.splitext(os.path.basename(path))[0]
        return MixtureSpec(sources=(SourceSpec(task=task, data_files=(os.path.abspath(path),), columns=cols),),
                           seed=seed)
    if os.path.splitext(path)[1].lower() in FILE_BUILDERS:
        raise FileNotFoundError(f"--data: file {data!r} not found")
    return MixtureSpec(sources=(SourceSpec(task=os.path.basename(path) or path, hf=path, columns=cols),), seed=seed)


def load_data(
    tokenizer,
    family: str,
    *,
    mixture: str | None = None,
    data: str | None = None,
    columns: str | Mapping[str, str] | None = None,
    datasets: Any = None,
    bad_rows: str | None = None,
    seed: int = 0,
    max_stream_rows: int | None = None,
) -> MixtureData:
    """The tokenized data of exactly one of ``datasets`` (a ``Dataset`` / ``IterableDataset`` or a mapping of task
    names to them: :meth:`MixtureData.from_datasets`), ``data`` (:func:`data_spec`) or ``mixture`` (a spec file);
    none of them: the built-in mixture. ``columns`` maps the columns of ``data`` or ``datasets``; ``seed`` orders
    their rows (a mixture spec has its own); ``max_stream_rows`` the rows read from an ``IterableDataset`` of
    ``datasets`` (default :data:`~dynabatch.data.pipeline.DEFAULT_STREAM_ROWS`)."""
    given = [n for n, v in (("mixture", mixture), ("data", data), ("datasets", datasets)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give one of mixture, data or datasets, got {' and '.join(given)}")
    if columns and not (data or datasets is not None):
        raise ValueError(COLUMNS_WITHOUT_DATA)
    if datasets is not None:
        cols = parse_columns(columns) if isinstance(columns, str) else columns
        stream = {} if max_stream_rows is None else {"max_stream_rows": max_stream_rows}
        return MixtureData.from_datasets(datasets, tokenizer, family, columns=cols, seed=seed,
                                         bad_rows=bad_rows or "error", **stream)
    if data is not None:
        spec = data_spec(data, columns, seed)
    else:
        spec = MixtureSpec.from_file(mixture or default_mixture_path())
    return MixtureData.load(spec, tokenizer, family, bad_rows=bad_rows)


def data_notes(data: MixtureData) -> list[str]:
    """One line per source with numbers cast to text or malformed rows skipped, for the data report and run logs."""
    notes = []
    for src in data.sources:
        parts = []
        if src.casts:
            parts.append(f"{sum(src.casts.values())} numbers/bools cast to text "
                         f"({', '.join(f'{f} {n}' for f, n in src.casts.items())})")
        if src.num_skipped:
            parts.append(f"({src.num_skipped} malformed rows skipped)")
        if parts:
            notes.append(f"source {src.name!r}: {' '.join(parts)}")
    return notes
