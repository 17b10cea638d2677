"""``dynabatch export CHECKPOINT OUT``: a training checkpoint as a Hugging Face ``save_pretrained`` folder.

What it writes and what it refuses: :mod:`dynabatch.training.export` (imported only when the command runs, so
``dynabatch export --help`` loads no torch).
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (step-NNNNNN) or a run's checkpoints/ folder (newest)")
    p.add_argument("out", help="output directory for save_pretrained (new, empty, or an earlier export)")
    p.add_argument("--force", action="store_true", help="write into a non-empty OUT that holds no earlier export")


def run(args: argparse.Namespace) -> int:
    from dynabatch.training.export import export_checkpoint  # lazy: keeps torch out of `dynabatch export --help`

    out = export_checkpoint(args.checkpoint, args.out, force=args.force)
    logger.info(f"wrote Hugging Face model and tokenizer to {out}")
    return 0
