"""Reading the YAML and JSON files a user writes (a ``--config`` file, a mixture spec), strictly.

PyYAML and ``json`` keep the last value of a key given twice, silently: a mixture source with ``data_files``
written twice would train on the second file only. Here a key given twice in one mapping is an error naming the
key and both lines, and syntax errors name the line and column (1-based). ``what`` (e.g. ``"mixture spec
data/mix.yaml"``) starts every message.
"""

from __future__ import annotations

import json
import re
from typing import Any


def parse_user_file(text: str, what: str, yaml_syntax: bool, hint: str = "") -> Any:
    """The content of a user's YAML (``yaml_syntax``) or JSON file ``text``; ``ValueError`` on a syntax error or a
    key given twice. ``hint`` is appended to syntax errors (e.g. how a file's kind was chosen)."""
    return _parse_yaml(text, what) if yaml_syntax else _parse_json(text, what, hint)


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
