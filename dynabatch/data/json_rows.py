"""JSON data files read row by row with the ``json`` module, beside ``datasets``' own reading of them.

``datasets`` reads a column that holds text in some rows and numbers in others as JSON text and parses it back,
so ``"007"`` would come back as 7 (:func:`exact_mixed_columns` rebuilds such columns from the files as written);
and when it cannot parse a .jsonl file it does not say which line is wrong (:func:`json_lines` reads the lines one
by one and names every line that is not a JSON object, so a source can name it or skip it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


def exact_mixed_columns(ds, files):
    """``ds``, read from the JSON ``files``, with every mixed-type column (text in some rows, numbers, booleans or
    objects in others: a ``datasets.Json`` column) holding the values the files wrote.

    ``datasets`` stores such a column's strings unquoted when they parse as JSON, so reading it back turns the text
    ``"007"`` into 7, ``"1.50"`` into 1.5, ``"1e3"`` into 1000.0, ``"null"`` into a missing value and ``"[1, 2]"``
    into a list: targets would change silently, or a row be refused for a value it does not hold. The rows are
    read again with the ``json`` module and the column rebuilt as properly quoted JSON text, so text stays text
    and only real numbers and booleans are cast (and counted) later. When the files cannot be read back row for
    row as ``datasets`` read them, ``ds`` is returned as it is."""
    import datasets
    import pyarrow as pa

    mixed = [name for name, feature in ds.features.items() if isinstance(feature, datasets.Json)]
    if not mixed:
        return ds
    rows = _json_file_rows(files)
    if rows is None or len(rows) != len(ds):
        return ds
    table = ds.data.table
    for name in mixed:
        text = pa.array([None if row.get(name) is None else json.dumps(row[name], ensure_ascii=False)
                         for row in rows], pa.string())
        column = pa.ExtensionArray.from_storage(table.schema.field(name).type, text)
        table = table.set_column(table.schema.get_field_index(name), name, column)
    return datasets.Dataset(datasets.table.InMemoryTable(table), info=ds.info)


def _json_file_rows(files) -> list | None:
    """The rows of JSON ``files`` in file order, as the ``json`` module reads them: a file holding one JSON list of
    objects, or one object per line (:func:`json_lines`); ``None`` when a file is neither."""
    rows: list = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                whole = json.load(f)
        except (OSError, UnicodeDecodeError):
            return None
        except json.JSONDecodeError:  # JSON lines
            whole = None
        if isinstance(whole, list) and all(isinstance(row, dict) for row in whole):
            rows += whole
            continue
        lines = json_lines([path])
        if lines is None or lines.bad:
            return None
        rows += lines.rows
    return rows


@dataclass(frozen=True)
class JsonLines:
    """The lines of .jsonl files (:func:`json_lines`): the rows read and the lines that are not rows."""

    rows: list
    """Every line that is a JSON object, in file order."""
    bad: list
    """``(file, line number from 1, why)`` of every other non-blank line."""


def json_lines(files) -> JsonLines | None:
    """The .jsonl ``files`` read line by line (what ``datasets`` could not parse, found and named); ``None`` when a
    file cannot be read at all."""
    rows, bad = [], []
    for path in files:
        try:
            with open(path, "rb") as f:
                for number, raw in enumerate(f, 1):
                    if not raw.strip():
                        continue
                    try:
                        obj = json.loads(raw.decode("utf-8").strip())
                    except UnicodeDecodeError as e:
                        bad.append((path, number, f"not valid UTF-8: {e.reason}"))
                        continue
                    except json.JSONDecodeError as e:
                        bad.append((path, number, f"{e.msg} at column {e.colno}"))
                        continue
                    (rows.append(obj) if isinstance(obj, dict) else
                     bad.append((path, number, f"a JSON {type(obj).__name__}, not an object")))
        except OSError:
            return None
    return JsonLines(rows, bad)
