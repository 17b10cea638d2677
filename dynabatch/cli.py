"""The ``dynabatch`` command: one sub-command per module.

Each sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``; modules are
imported lazily so ``dynabatch --help`` stays fast. Bad user input (``ValueError``,
``FileNotFoundError``) prints one clear line and exits 2; Ctrl-C prints one line (``dynabatch plan: interrupted``;
a training run names the step and the newest checkpoint to resume from) and exits 130. Set ``DYNABATCH_DEBUG=1``
for the traceback.
Under torchrun, a failing rank prints its own line, prefixed ``[rank N]``, and exits at once
(:mod:`dynabatch.engine.faults`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from dynabatch.training.config.flags import HelpFormatter, add_help_levels
from dynabatch.engine.faults import (INTERRUPTED_STATUS, error_line, follow_launcher,  # no torch import:
                                     interruption_message, is_user_error, user_message)  # `dynabatch --help` stays fast
from dynabatch.engine.log import quiet_third_party, setup_logging

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("dynabatch.commands.train", "train a T5/GPT-2/Llama-style model with dynamic micro-batching"),
    "bench": ("dynabatch.commands.bench", "measured real-token throughput of every batching method on the same executor"),
    "export": ("dynabatch.commands.export", "export a training checkpoint to a Hugging Face save_pretrained folder"),
    "data-report": ("dynabatch.commands.data_report", "per-task length statistics and baseline padding efficiency, "
                                                      "or a lengths file's tail (--lengths)"),
    "profile": ("dynabatch.commands.profile", "profile per-layer time and memory on this device"),
    "plan": ("dynabatch.commands.plan", "plan global batches with every method and compare predicted step times"),
    "simulate": ("dynabatch.commands.simulate", "plan, schedule and simulate global batches with every method"),
}


DESCRIPTION = ("dynamic micro-batching and pipeline scheduling for training Hugging Face encoder-decoder and "
               "decoder-only models")
EPILOG = ("`dynabatch COMMAND --help` lists a command's main options, `--help-all` all of them. `dynabatch train` "
          "alone trains the t5-tiny preset on the built-in offline mixture.")


class FlagError(ValueError):
    """A flag argparse refuses (unknown flag, a value of the wrong type or not among the choices)."""


class OneLineErrors(argparse.ArgumentParser):
    """A sub-command's parser: a bad flag is one line (what, and where to look), not the whole usage."""

    def error(self, message: str):
        raise FlagError(re.sub(r"/--[\w-]*_[\w-]*(?=[/:])", "", message))  # not its --name_with_underscores twins


def command_parser(name: str):
    """``(module, parser)`` of the sub-command ``name``: the parser ``dynabatch NAME`` parses its flags with (also used
    by ``scripts/gen_cli_reference.py`` and the docs test, which parse without running)."""
    if name not in COMMANDS:
        raise ValueError(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    module = importlib.import_module(COMMANDS[name][0])
    p = OneLineErrors(prog=f"dynabatch {name}", description=COMMANDS[name][1], formatter_class=HelpFormatter,
                      add_help=False)
    add_help_levels(p)  # --help: the basic options; --help-all: every option
    module.add_arguments(p)
    return module, p


def main(argv: list[str] | None = None) -> int:
    """Run ``dynabatch ARGV`` and return its exit status; Ctrl-C ends any command with one line and 130."""
    argv = sys.argv[1:] if argv is None else argv
    follow_launcher()  # a rank of `dynabatch train --stages N` ends with its launcher, also one killed outright
    try:
        return _run_command(argv)
    except KeyboardInterrupt as e:  # Ctrl-C: one line (a training run's says where it stopped), not a traceback
        if os.environ.get("DYNABATCH_DEBUG"):
            raise
        print(f"{_prog(argv)}: {interruption_message(e)}", file=sys.stderr, flush=True)
        return INTERRUPTED_STATUS


def _prog(argv: list[str]) -> str:
    """``dynabatch CMD`` of ``argv`` (``dynabatch`` before a command is known)."""
    return f"dynabatch {argv[0]}" if argv and argv[0] in COMMANDS else "dynabatch"


def _run_command(argv: list[str]) -> int:
    """:func:`main`'s body: parse ``argv`` and run its command; bad input is one line and 2."""
    parser = argparse.ArgumentParser(prog="dynabatch", description=DESCRIPTION, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
    if not argv or argv[0] not in COMMANDS:
        args = parser.parse_args(argv)
        parser.print_help()
        return 0 if not argv else 2
    module, p = command_parser(argv[0])
    try:
        args = p.parse_args(argv[1:])
    except FlagError as e:
        print(error_line(f"dynabatch {argv[0]}", f"{e} (see `dynabatch {argv[0]} --help`)"), file=sys.stderr)
        return 2
    args.argv = argv[1:]  # which flags were given (a --config file's values yield only to those)
    setup_logging()  # info on rank 0 (train applies --log-level), warnings elsewhere (engine.log)
    quiet_third_party()
    try:
        return int(module.run(args) or 0)
    except Exception as e:  # user input (or a full disk): a message, not a traceback
        if not is_user_error(e) or os.environ.get("DYNABATCH_DEBUG"):
            raise
        print(error_line(f"dynabatch {argv[0]}", user_message(e)), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
