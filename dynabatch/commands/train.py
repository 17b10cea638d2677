"""``dynabatch train``: train a T5, GPT-2 or Llama-style model on a mixture with dynamic micro-batching.

Launch directly for one process, or with ``torchrun --nproc-per-node STAGES*REPLICAS`` for a pipeline.
Every field of :class:`dynabatch.config.TrainConfig` is a flag (``dynabatch train --help`` lists them by section).
"""

from __future__ import annotations

import argparse

from dynabatch.config.flags import add_config_arguments, config_from_args, given_flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)


def run(args: argparse.Namespace) -> int:
    from dynabatch.runtime.trainer import train

    given = None
    if getattr(args, "argv", None) is not None:
        p = argparse.ArgumentParser()
        add_arguments(p)
        given = given_flags(p, args.argv)
    train(config_from_args(args, given))
    return 0
