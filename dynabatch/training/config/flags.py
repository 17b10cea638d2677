"""Flags and config files of :class:`~dynabatch.training.config.TrainConfig` (and of any command that uses its sections).

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
import re
from typing import Any

# The package defines these before it imports this module (config/__init__.py's last lines), so they exist
# whichever of the two is imported first.
from dynabatch.training.config import TrainConfig, _allowed, canonical, field_types
from dynabatch.training.config.sections import SECTIONS
from dynabatch.data.user_files import file_syntax, parse_user_file

_NOT_GIVEN = object()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every default shown, except where the help text already says what the default is; a flag's
    ``--name_with_underscores`` twin is left out and its value named once (both spellings still parse)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None:
            return text
        return super()._get_help_string(action)

    def _format_action_invocation(self, action):
        shown = ", ".join(shown_options(action))
        if not action.option_strings or action.nargs == 0:
            return shown or super()._format_action_invocation(action)
        value = value_name(action) if _is_switch(action) else self._format_args(action, action.dest.upper())
        return f"{shown} {value}"


def _is_switch(action: argparse.Action) -> bool:
    """An on/off option (its value parsed by ``string_to_bool``: ``--flag``, ``--flag false``)."""
    return getattr(action.type, "__name__", "") == "string_to_bool"


def shown_options(action: argparse.Action) -> list[str]:
    """The spellings help shows of a flag: each one but the ``--name_with_underscores`` twin of a dashed one."""
    dashed = {o.replace("_", "-") for o in action.option_strings if "_" not in o}
    return [o for o in action.option_strings if "_" not in o or o.replace("_", "-") not in dashed]


def value_name(action: argparse.Action) -> str:
    """What help writes for a flag's value: ``[true|false]`` for a switch, else its metavar (optional in [])."""
    if _is_switch(action):
        return "[true|false]"
    metavar = action.metavar or action.dest.upper()
    return f"[{metavar}]" if action.nargs == "?" else metavar


def short_usage(p: argparse.ArgumentParser) -> str:
    """``PROG [options]`` and the positional arguments, in order (both help levels start with it)."""
    positionals = [a.metavar or a.dest for a in p._actions if not a.option_strings and a.help != argparse.SUPPRESS]
    return " ".join([p.prog, "[options]", *positionals])


class _BasicHelp(argparse.Action):
    """``-h``/``--help``: the ``basic`` options, one line each (:func:`basic_help`)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(basic_help(parser), end="")
        parser.exit()


class _FullHelp(_BasicHelp):
    """``--help-all``: every option, grouped by section, research switches in the ``experimental`` group."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.usage = short_usage(parser)
        parser.print_help()
        parser.exit()


def add_help_levels(p: argparse.ArgumentParser) -> None:
    """``-h``/``--help`` (the basic options) and ``--help-all`` (every option) on a parser made with
    ``add_help=False``: both are generated from the fields' ``level`` metadata, nothing is listed by hand."""
    p.add_argument("-h", "--help", action=_BasicHelp, help="the options a run needs, one line each")
    p.add_argument("--help-all", action=_FullHelp, help="every option (research switches in the experimental group)")


def basic_options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions ``--help`` lists: every flag whose field is ``basic`` (a command's own flags are), one per
    destination (a bool field's ``--no-X`` twin is left out), in group order."""
    out, seen = [], set()
    for group in p._action_groups:
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or getattr(action, "level", "basic") != "basic":
                continue
            if action.dest in seen and action.dest != argparse.SUPPRESS:
                continue
            seen.add(action.dest)
            out.append(action)
    return out


def basic_help(p: argparse.ArgumentParser) -> str:
    """``--help``: usage, then per group its basic options, one line each (flag, what it does, its default), and
    how many more ``--help-all`` lists."""
    formatter = p._get_formatter()
    shown = basic_options(p)
    rows: list[tuple[str, str, str]] = []  # (group title, invocation, help)
    for group in p._action_groups:
        for action in group._group_actions:
            if action not in shown:
                continue
            if action.option_strings:
                flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
                if action.nargs != 0:  # a short metavar: the help text names the choices
                    flag += " " + value_name(action)
            else:
                flag = action.dest
            text = " ".join(formatter._expand_help(action).split()) if action.help else ""
            if "default" not in text and action.default not in (None, argparse.SUPPRESS) and action.nargs != 0:
                text += f" (default: {action.default})"
            rows.append((group.title or "options", flag, text))
    width = min(max(len(r[1]) for r in rows), 34)
    hidden = {a.dest for a in p._actions if a.help != argparse.SUPPRESS} - {a.dest for a in shown}
    lines = [f"usage: {short_usage(p)}", ""]
    if p.description:
        lines += [p.description, ""]
    title = None
    for group_title, flag, text in rows:
        if group_title != title:
            lines += ([""] if title is not None else []) + [f"{group_title}:"]
            title = group_title
        lines.append(f"  {flag.ljust(width)}  {text}".rstrip())
    if hidden:
        lines += ["", f"{len(hidden)} more options (advanced, and research switches in the experimental group): "
                      f"{p.prog} --help-all"]
    return "\n".join(lines) + "\n"


EXPERIMENTAL_GROUP = "experimental"
"""The ``--help-all`` group of every ``experimental``-level field (:data:`dynabatch.training.config.sections.LEVELS`)."""


def add_sections(p: argparse.ArgumentParser, sections, defaults: dict[str, Any] | None = None,
                 only: set[str] | None = None, helps: dict[str, str] | None = None) -> None:
    """One flag per field of each section in ``sections`` (an argument group each, named after the section;
    ``experimental`` fields go to one ``experimental`` group, listed last). ``only`` keeps the named fields alone;
    ``defaults`` and ``helps`` override a field's default and help text for this command (``--help`` shows
    them). Each flag's action carries its field's help ``level`` (``action.level``), which ``--help`` reads."""
    import typing

    from transformers import HfArgumentParser

    groups = {g.title: g for g in p._action_groups}
    for section in sections:
        hints = typing.get_type_hints(section)
        fields = [f for f in dataclasses.fields(section) if only is None or f.name in only]
        for f in fields:
            level = f.metadata.get("level", "basic")
            name = EXPERIMENTAL_GROUP if level == "experimental" else section._argument_group_name
            group = groups.get(name) or p.add_argument_group(name)
            groups[name] = group
            f = copy.copy(f)  # HfArgumentParser rewrites the field's type; the section keeps its own
            f.type = hints[f.name]
            metadata = {k: v for k, v in f.metadata.items() if k != "level"}
            if helps and f.name in helps:
                metadata["help"] = helps[f.name]
            f.metadata = metadata
            before = len(p._actions)
            HfArgumentParser._parse_dataclass_field(group, f)
            main = "--" + f.name.replace("_", "-")
            for action in p._actions[before:]:  # show --dashed-names first (both spellings parse)
                action.option_strings.sort(key=lambda o: (o not in (main, "--no-" + main[2:]), "_" in o))
                action.level = level
                if action.option_strings[0] == "--no-" + main[2:]:  # a bool field's generated off switch: own words
                    action.help = f"turn off --{action.option_strings[0][5:]}"
                    action.default = argparse.SUPPRESS  # the field's default is its --flag's (parsed first)
    if EXPERIMENTAL_GROUP in groups:  # research switches last
        p._action_groups.remove(groups[EXPERIMENTAL_GROUP])
        p._action_groups.append(groups[EXPERIMENTAL_GROUP])
    if defaults:
        p.set_defaults(**defaults)


def add_fields(p: argparse.ArgumentParser, names, defaults: dict[str, Any] | None = None,
               helps: dict[str, str] | None = None) -> None:
    """The flags of the TrainConfig fields ``names`` (grouped by their sections), for a command that shares
    them with ``dynabatch train``: the same name means the same thing in every command."""
    names = set(names)
    known = {f.name for s in SECTIONS for f in dataclasses.fields(s)}
    assert names <= known, sorted(names - known)
    add_sections(p, SECTIONS, defaults, only=names, helps=helps)


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """Every TrainConfig flag, grouped by section, plus ``--config FILE``."""
    p.add_argument("--config", default=None, help="YAML/JSON/TOML file of these options, e.g. a run's config.yaml (flat, or "
                                                  "nested by section); flags given with it override its values")
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
        cfg = TrainConfig(**values)
    except ValueError as e:  # name the file when a field the message names came from it
        named = [name for name in from_file if _names(str(e), name)]
        if not named:
            raise
        flags = [f"--{name.replace('_', '-')}" for name in sorted(given & defaults.keys()) if _names(str(e), name)]
        where = f" ({', '.join(named)} from the file, {', '.join(flags)} from the command line)" if flags else ""
        raise ValueError(f"config file {config_path}: {e}{where}") from None
    for name in ("generate_every", "generation_max_new_tokens"):  # defaults of their own: a value cannot tell
        if name in given and not (cfg.eval_mixture or cfg.eval_holdout):
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"{flag} sets the generation metrics of evaluation, and no evaluation data is given: "
                             f"pass --eval-mixture SPEC or --eval-holdout FRACTION, or drop {flag}")
    return cfg


def _names(message: str, field: str) -> bool:
    """Whether an error ``message`` names ``field``: as a flag (``--cost-profile``), as a field with an underscore
    (``cost_profile``) anywhere, or as its first word (a one-word name elsewhere may be plain English: "cost model")."""
    spellings = [f"--{field.replace('_', '-')}"] + ([field] if "_" in field else [])
    return (message.startswith(f"{field} ")
            or bool(re.search(rf"(?<![\w-])({'|'.join(spellings)})(?![\w-])", message)))


def parse_config(p: argparse.ArgumentParser, argv: list[str]):
    """``p.parse_args(argv)`` and the TrainConfig it describes (with ``--config`` layered under the flags)."""
    args = p.parse_args(argv)
    return args, config_from_args(args, given_flags(p, argv))


def load_config_file(path: str) -> dict[str, Any]:
    """A config file's fields (flat, or nested under section names), under current names, numbers parsed."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path!r} not found")
    if os.path.isdir(path):
        raise ValueError(f"config file {path!r} is a folder; pass a YAML, JSON or TOML file of TrainConfig fields")
    syntax = file_syntax(path, f"config file {path}")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    raw = parse_user_file(text, f"config file {path}", syntax)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path} must hold a mapping of TrainConfig fields, got {type(raw).__name__}")
    sections = {s._argument_group_name: {f.name for f in dataclasses.fields(s)} for s in SECTIONS}
    sections[EXPERIMENTAL_GROUP] = {f.name for s in SECTIONS for f in dataclasses.fields(s)
                                    if f.metadata.get("level") == "experimental"}  # as --help-all groups them
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if key in sections and isinstance(value, dict):  # nested: {optim: {learning_rate: ...}}
            fields = sections[key]
            try:
                value = canonical(value)
            except ValueError as e:
                raise ValueError(f"config file {path}, section {key!r}: {e}") from None
            for name, v in value.items():
                if name not in fields:
                    raise ValueError(f"config file {path}: section {key!r} has no field {name!r}; valid: {sorted(fields)}")
                if name in flat:
                    raise ValueError(f"config file {path}: {name} is given twice (under {key!r} and elsewhere); give it "
                                     "once")
                flat[name] = v
        else:
            if key in sections and key not in {f.name for f in dataclasses.fields(TrainConfig)}:
                raise ValueError(f"config file {path}: section {key!r} must be a mapping of its fields (each on its "
                                 f"own line, indented under '{key}:'), got {type(value).__name__} {value!r}")
            if key in flat:
                raise ValueError(f"config file {path}: {key} is given twice (flat and under a section); give it once")
            flat[key] = value
    try:
        flat = canonical(flat)
    except ValueError as e:
        raise ValueError(f"config file {path}: {e}") from None
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(flat) - known
    if unknown:
        raise ValueError(f"config file {path}: unknown config keys {sorted(unknown)}; valid: {sorted(known)} "
                         f"(or nested under {', '.join(sections)})")
    return {k: _coerce(path, k, v) for k, v in flat.items()}


def _coerce(path: str, name: str, value: Any) -> Any:
    """YAML 1.1 reads ``learning_rate: 3e-4`` as a string: turn numeric strings into the field's number type."""
    allowed, _, _ = _allowed(field_types()[name])
    number = float if float in allowed else int if int in allowed else None
    if isinstance(value, str) and number is not None:
        try:
            return number(value)
        except ValueError:
            kind = "a whole number" if number is int else "a number"
            raise ValueError(f"config file {path}: {name} must be {kind}, got {value!r}") from None
    return value


CONFIG_FILE = "config.yaml"
"""What a run writes into its output folder: every field, resolved, nested by section."""


ONE_SHOT = {"resume_from_checkpoint": None, "overwrite_output_dir": False}
"""How one start treated its output folder, not what the run runs: ``OUTPUT/config.yaml`` holds their defaults, so
running that file again never resumes nor deletes the run it describes unless told to again."""


def write_config_file(path: str, cfg) -> None:
    """``cfg`` as a YAML file nested by section (what :func:`load_config_file` reads back), written atomically; the
    :data:`ONE_SHOT` fields at their defaults."""
    import yaml

    cfg = dataclasses.replace(cfg, **ONE_SHOT)
    text = ("# dynabatch train --config this file: every field of the run, resolved (docs/configuration.md)\n"
            + yaml.safe_dump(cfg.sections(), sort_keys=False, default_flow_style=False))
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


NOT_RUN_SETTINGS = ("resume_from_checkpoint", "output_dir", "overwrite_output_dir")
"""Fields that say where and how a run starts, not what it runs: a resume does not report them as differences."""
