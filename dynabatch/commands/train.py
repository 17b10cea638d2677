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
from dynabatch.engine.errors import Interrupted
from dynabatch.engine.faults import INTERRUPTED_STATUS
from dynabatch.data.batching import LengthLimits, check_token_budget, replica_budget_problem
from dynabatch.data.inputs import COLUMNS_WITHOUT_DATA
from dynabatch.data.mixture import MixtureSpec
from dynabatch.data.tokenize import tokenizer_problem
from dynabatch.model_presets import model_problem, sequence_kind, stages_problem
from dynabatch.commands.output_files import profile_file_problem


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)


def interrupted_run(output_dir: str) -> BaseException:
    """The :class:`~dynabatch.engine.errors.Interrupted` of a launched run stopped by Ctrl-C, read from its output
    folder: the step after the last one logged, and the newest complete checkpoint."""
    from dynabatch.engine.outputs import interruption_line, steps_logged  # lazy: torch (loaded by the launcher)

    step = steps_logged(os.path.join(output_dir, "metrics.jsonl"))
    return Interrupted(interruption_line(output_dir, step if step else None))


def _budget_problem(cfg) -> str | None:
    """The trainer's refusal of a global batch that holds less than one maximal sample per replica, said before the
    launch where the model's sequence kind can be told from the file system (else each rank says it); a batch that
    cannot hold one maximal sample of that kind at all is a ``ValueError`` here."""
    kind = sequence_kind(cfg.model)
    if kind is None:
        return None
    limits = LengthLimits(kind, max_input_len=cfg.max_input_len, max_target_len=cfg.max_target_len,
                          max_seq_len=cfg.max_input_len)
    check_token_budget(cfg.global_batch_tokens, limits, "--global-batch-tokens")
    return replica_budget_problem(cfg.global_batch_tokens, cfg.replicas, limits)


def _eval_mixture_problem(path: str | None) -> str | None:
    """What is wrong with the ``--eval-mixture`` spec file (missing, a directory, a data file rather than a spec,
    bad fields), said before any rank loads a model: rank 0 reads it only after the model, the training data and the
    start-up lines, and its message named no flag."""
    if not path:
        return None
    try:
        MixtureSpec.from_file(path)
    except (OSError, ValueError) as e:
        return f"--eval-mixture: {e}"
    return None


def run(args: argparse.Namespace) -> int:
    given = None
    argv = getattr(args, "argv", None)
    if argv is not None:
        p = argparse.ArgumentParser()
        add_arguments(p)
        given = given_flags(p, argv)
    cfg = config_from_args(args, given)  # bad flags stop here, before any rank starts
    if cfg.columns and not cfg.data:  # train() may map in-memory datasets; the command has only --data to map
        raise ValueError(COLUMNS_WITHOUT_DATA)
    if (problem := _eval_mixture_problem(cfg.eval_mixture)) is not None:
        raise ValueError(problem)
    if cfg.world_size > 1 and "RANK" not in os.environ and argv is not None:
        from dynabatch.engine.launch import launch_local  # lazy: keeps torch out of `dynabatch train --help`

        # what every rank would refuse alike, said once here (the file system only: no transformers import)
        for problem in (model_problem(cfg.model), tokenizer_problem(cfg.tokenizer, cfg.model),
                        stages_problem(cfg.model, cfg.stages), _budget_problem(cfg),
                        profile_file_problem(cfg.cost_profile)):
            if problem is not None:
                raise ValueError(problem)

        code = launch_local(["-m", "dynabatch", "train", *argv], cfg.world_size)
        if code == INTERRUPTED_STATUS:  # Ctrl-C: the ranks are stopped; the run's one line is said here
            raise interrupted_run(cfg.output_dir)
        return code
    # After the launch: a launcher that only starts the ranks never imports the training loop (its imports cost
    # about 4 s of a run's start-up on 2 cores, before any rank could start).
    from dynabatch.training.trainer import train  # lazy: keeps torch and transformers out of `dynabatch train --help`

    if objective_note(cfg.method) and os.environ.get("RANK", "0") == "0":  # packing_free_split: say so, once
        print(f"note: {cfg.method} {objective_note(cfg.method)}", file=sys.stderr, flush=True)
    train(cfg)
    return 0
