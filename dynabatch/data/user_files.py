"""Reading the YAML, JSON and TOML files a user writes (a ``--config`` file, a mixture spec), strictly.

PyYAML and ``json`` keep the last value of a key given twice, silently: a mixture source with ``data_files``
written twice would train on the second file only. Here a key given twice in one mapping is an error naming the
key and both lines, and syntax errors name the line and column (1-based). ``tomllib`` refuses a key given twice
itself; its error is turned into the same line. ``what`` (e.g. ``"mixture spec data/mix.yaml"``) starts every
message.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

SYNTAXES = {".yaml": "yaml", ".yml": "yaml", ".json": "json", ".toml": "toml"}
"""File name ending -> the syntax :func:`parse_user_file` reads it with."""

USER_FILE_ENDINGS = tuple(SYNTAXES)
"""The endings of a config file or a mixture spec (what tells a mixture spec from a lengths file)."""

USER_FILE_KINDS = ".yaml/.yml, .json or .toml"
"""The endings, for help texts and error lines."""


def is_user_file(path: str) -> bool:
    """Whether ``path`` ends like a file :func:`parse_user_file` reads (a mixture spec, not a lengths file)."""
    return path.lower().endswith(USER_FILE_ENDINGS)


def file_syntax(path: str, what: str, hint: str = "") -> str:
    """``yaml``, ``json`` or ``toml``: how ``path`` is read, by its ending; another ending is one ``ValueError``
    line naming ``what`` and the endings accepted (``hint`` appended, e.g. where a data file goes instead)."""
    ending = os.path.splitext(path)[1].lower()
    if ending not in SYNTAXES:
        got = f"'{ending}'" if ending else "no ending"
        raise ValueError(f"{what}: unknown file type ({got}); accepted: {', '.join(SYNTAXES)} (YAML, JSON or TOML "
                         f"by that ending): rename or convert the file{hint}")
    return SYNTAXES[ending]


def parse_user_file(text: str, what: str, syntax: str, hint: str = "") -> Any:
    """The content of a user's ``syntax`` (``yaml``, ``json`` or ``toml``) file ``text``; ``ValueError`` on a
    syntax error or a key given twice. ``hint`` is appended to JSON syntax errors (e.g. how a file's kind was
    chosen)."""
    if syntax == "yaml":
        return _parse_yaml(text, what)
    if syntax == "toml":
        return _parse_toml(text, what)
    return _parse_json(text, what, hint)


def _parse_yaml(text: str, what: str) -> Any:
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                self.flatten_mapping(node)  # merge keys (<<) may repeat a key on purpose: they are resolved first
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        first = seen.setdefault(key, line)
                    except TypeError:  # an unhashable key: SafeLoader's own error says so
                        break
                    if first != line:
                        raise ValueError(f"{what}: key {key!r} is given twice (line {line}, first at line {first}); "
                                         "keep one")
            return super().construct_mapping(node, deep=deep)

    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{what}: YAML syntax error{where}: {problem}; fix the file") from None


def _parse_json(text: str, what: str, hint: str) -> Any:
    def refuse_duplicates(pairs):
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"{what}: key {key!r} is given twice{_json_lines(text, key)}; keep one")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=refuse_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: JSON{hint} syntax error at line {e.lineno}, column {e.colno}: {e.msg}; "
                         "fix the file") from None


def _json_lines(text: str, key: str) -> str:
    """`` (lines a, b)``: where ``"key":`` occurs in ``text`` (the first two), or nothing if not found."""
    pattern = re.compile(re.escape(json.dumps(key)) + r"\s*:")
    lines = [text.count("\n", 0, m.start()) + 1 for m in pattern.finditer(text)][:2]
    return f" (line {lines[1]}, first at line {lines[0]})" if len(lines) == 2 else ""


_TOML_WHERE = re.compile(r"\s*\(at (?:line (\d+), column (\d+)|end of document)\)\s*$")


def _parse_toml(text: str, what: str) -> Any:
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # Python 3.10: tomli, the package tomllib was taken from (a dependency there)
        import tomli as tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        message = str(e)
        found = _TOML_WHERE.search(message)
        problem = message[:found.start()] if found else message
        line = int(found.group(1)) if found and found.group(1) else None
        if line is not None and problem.startswith(("Cannot overwrite a value", "Cannot declare")):
            key, first = _toml_key(text, line)
            if key is not None:
                at = f"line {line}, first at line {first}" if first else f"line {line}"
                raise ValueError(f"{what}: {key} is given twice ({at}); keep one") from None
        where = f" at line {line}, column {found.group(2)}" if line is not None else ""
        raise ValueError(f"{what}: TOML syntax error{where}: {problem}; fix the file") from None


def _toml_key(text: str, line: int) -> tuple[str | None, int | None]:
    """``key 'name'`` (or ``table [name]``) that TOML line ``line`` gives again, and the line it was first given on
    (the nearest earlier line giving it, inside the same table for a key); ``(None, None)`` if the line is not
    one."""
    lines = text.splitlines()
    if not 1 <= line <= len(lines):
        return None, None
    here = lines[line - 1].strip()
    header = re.match(r"^\[\s*([^\[\]]+?)\s*\]", here)
    if header:
        name = header.group(1)
        pattern = re.compile(rf"^\s*\[\s*{re.escape(name)}\s*\]")
        first = next((i + 1 for i in range(line - 1) if pattern.match(lines[i])), None)
        return f"table [{name}]", first
    if "=" not in here:
        return None, None
    key = here.split("=", 1)[0].strip().strip("\"'")
    pattern = re.compile(rf"^\s*[\"']?{re.escape(key)}[\"']?\s*=")
    for i in range(line - 2, -1, -1):
        if pattern.match(lines[i]):
            return f"key {key!r}", i + 1
        if lines[i].lstrip().startswith("["):
            break
    return f"key {key!r}", None
