"""``dynabatch train``: train a T5, GPT-2 or Llama-style model on a mixture with dynamic micro-batching.

Launch directly: one process, or with ``--stages`` / ``--replicas`` above 1 one per rank on this machine
(:mod:`dynabatch.engine.launch`); or with ``torchrun --nproc-per-node STAGES*REPLICAS`` (several machines too).
Every field of :class:`dynabatch.training.config.TrainConfig` is a flag (``dynabatch train --help`` lists them by section).
"""

from __future__ import annotations

import argparse
import os
import sys

from dynabatch.training.config.flags import add_config_arguments, config_from_args, given_flags
from dynabatch.core.methods import objective_note
from dynabatch.data.tokenize import tokenizer_problem
from dynabatch.model_presets import model_problem


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)


def run(args: argparse.Namespace) -> int:
    given = None
    argv = getattr(args, "argv", None)
    if argv is not None:
        p = argparse.ArgumentParser()
        add_arguments(p)
        given = given_flags(p, argv)
    cfg = config_from_args(args, given)  # bad flags stop here, before any rank starts
    if cfg.world_size > 1 and "RANK" not in os.environ and argv is not None:
        from dynabatch.engine.launch import launch_local  # lazy: keeps torch out of `dynabatch train --help`

        # what every rank would refuse alike, said once here (the file system only: no transformers import)
        for problem in (model_problem(cfg.model), tokenizer_problem(cfg.tokenizer, cfg.model)):
            if problem is not None:
                raise ValueError(problem)

        return launch_local(["-m", "dynabatch", "train", *argv], cfg.world_size)
    # After the launch: a launcher that only starts the ranks never imports the training loop (its imports cost
    # about 4 s of a run's start-up on 2 cores, before any rank could start).
    from dynabatch.training.trainer import train  # lazy: keeps torch and transformers out of `dynabatch train --help`

    if objective_note(cfg.method) and os.environ.get("RANK", "0") == "0":  # packing_free_split: say so, once
        print(f"note: {cfg.method} {objective_note(cfg.method)}", file=sys.stderr, flush=True)
    train(cfg)
    return 0
