"""Flags and config files of :class:`~dynabatch.config.TrainConfig` (and of any command that uses its sections).

:func:`add_sections` puts the flags of some sections into a parser, through ``transformers.HfArgumentParser``'s
field-to-argument rules (``Literal`` -> choices, bool -> ``--flag [true|false]`` and ``--no-flag``, a field's
metadata -> help and aliases; ``--name-with-dashes`` and ``--name_with_underscores`` both). The layering
(defaults < ``--config`` file < flags given on the command line) is :func:`config_from_args`: a parser built
with every default set to a marker tells which flags were given.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
from typing import Any

from dynabatch.data.user_files import parse_user_file

_NOT_GIVEN = object()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every default shown, except where the help text already says what the default is."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def add_sections(p: argparse.ArgumentParser, sections, defaults: dict[str, Any] | None = None,
                 only: set[str] | None = None, helps: dict[str, str] | None = None) -> None:
    """One flag per field of each section in ``sections`` (an argument group each, named after the section).
    ``only`` keeps the named fields alone; ``defaults`` and ``helps`` override a field's default and help text
    for this command (``--help`` shows them)."""
    import typing

    from transformers import HfArgumentParser

    groups = {g.title: g for g in p._action_groups}
    for section in sections:
        hints = typing.get_type_hints(section)
        fields = [f for f in dataclasses.fields(section) if only is None or f.name in only]
        if not fields:
            continue
        name = section._argument_group_name
        group = groups.get(name) or p.add_argument_group(name)
        groups[name] = group
        for f in fields:
            f = copy.copy(f)  # HfArgumentParser rewrites the field's type; the section keeps its own
            f.type = hints[f.name]
            if helps and f.name in helps:
                f.metadata = {**f.metadata, "help": helps[f.name]}
            before = len(p._actions)
            HfArgumentParser._parse_dataclass_field(group, f)
            main = "--" + f.name.replace("_", "-")
            for action in p._actions[before:]:  # show --dashed-names first (both spellings parse)
                action.option_strings.sort(key=lambda o: (o not in (main, "--no-" + main[2:]), "_" in o))
    if defaults:
        p.set_defaults(**defaults)


def add_fields(p: argparse.ArgumentParser, names, defaults: dict[str, Any] | None = None,
               helps: dict[str, str] | None = None) -> None:
    """The flags of the TrainConfig fields ``names`` (grouped by their sections), for a command that shares
    them with ``dynabatch train``: the same name means the same thing in every command."""
    from dynabatch.config import SECTIONS

    names = set(names)
    known = {f.name for s in SECTIONS for f in dataclasses.fields(s)}
    assert names <= known, sorted(names - known)
    add_sections(p, SECTIONS, defaults, only=names, helps=helps)


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """Every TrainConfig flag, grouped by section, plus ``--config FILE``."""
    from dynabatch.config import SECTIONS

    p.add_argument("--config", default=None, help="YAML/JSON file of TrainConfig fields (flat, or nested by section)")
    add_sections(p, SECTIONS)


def given_flags(p: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags ``argv`` sets (a parse with every default replaced by a marker)."""
    marker = copy.deepcopy(p)
    for action in marker._actions:
        if action.dest != "help":
            action.default = _NOT_GIVEN
    ns = marker.parse_args(argv)
    return {k for k, v in vars(ns).items() if v is not _NOT_GIVEN}


def config_from_args(args: argparse.Namespace, given: set[str] | None = None):
    """The TrainConfig of parsed flags: defaults, then ``args.config``'s values, then the flags in ``given``
    (``None``: every value in ``args`` that differs from its field's default counts as given)."""
    from dynabatch.config import TrainConfig

    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    if given is None:
        given = {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}
    config_path = getattr(args, "config", None)
    from_file = load_config_file(config_path) if config_path else {}
    values = dict(from_file)
    for name in defaults:
        if name in given and hasattr(args, name):
            values[name] = getattr(args, name)
            from_file.pop(name, None)
    try:
        return TrainConfig(**values)
    except ValueError as e:  # name the file when the offending field came from it
        if any(str(e).startswith(f"{name} ") for name in from_file):
            raise ValueError(f"config file {config_path}: {e}") from None
        raise


def parse_config(p: argparse.ArgumentParser, argv: list[str]):
    """``p.parse_args(argv)`` and the TrainConfig it describes (with ``--config`` layered under the flags)."""
    args = p.parse_args(argv)
    return args, config_from_args(args, given_flags(p, argv))


def load_config_file(path: str) -> dict[str, Any]:
    """A config file's fields (flat, or nested under section names), under current names, numbers parsed."""
    from dynabatch.config import SECTIONS, TrainConfig, canonical

    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path!r} not found")
    if os.path.isdir(path):
        raise ValueError(f"config file {path!r} is a folder; pass a YAML or JSON file of TrainConfig fields")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    raw = parse_user_file(text, f"config file {path}", path.endswith((".yaml", ".yml")))
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path} must hold a mapping of TrainConfig fields, got {type(raw).__name__}")
    sections = {s._argument_group_name: s for s in SECTIONS}
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in sections and isinstance(value, dict):  # nested: {optim: {learning_rate: ...}}
            fields = {f.name for f in dataclasses.fields(sections[key])}
            for name, v in canonical(value).items():
                if name not in fields:
                    raise ValueError(f"{path}: section {key!r} has no field {name!r}; valid: {sorted(fields)}")
                flat[name] = v
        else:
            flat[key] = value
    try:
        flat = canonical(flat)
    except ValueError as e:
        raise ValueError(f"config file {path}: {e}") from None
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(flat) - known
    if unknown:
        raise ValueError(f"{path}: unknown config keys {sorted(unknown)}; valid: {sorted(known)} "
                         f"(or nested under {', '.join(sections)})")
    return {k: _coerce(path, k, v) for k, v in flat.items()}


def _coerce(path: str, name: str, value: Any) -> Any:
    """YAML 1.1 reads ``learning_rate: 3e-4`` as a string: turn numeric strings into the field's number type."""
    from dynabatch.config import _allowed, field_types

    allowed, _, _ = _allowed(field_types()[name])
    number = float if float in allowed else int if int in allowed else None
    if isinstance(value, str) and number is not None:
        try:
            return number(value)
        except ValueError:
            raise ValueError(f"config file {path}: {name} must be a number, got {value!r}") from None
    return value
