"""Argument checks the example scripts share (``examples/hf_trainer.py``, ``examples/train_loop.py``): a wrong
argument ends in one ``SCRIPT: error: ...`` line and exit 2 (argparse's), before any data or model loads."""

from __future__ import annotations

import argparse

from dynabatch.data.batching import LengthLimits
from dynabatch.model_presets import sequence_kind

EXAMPLE_MODELS = ("t5-tiny", "t5-mini", "gpt2-tiny", "gpt2-mini")
"""The presets the examples train."""


def positive(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate)."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def length_limits(family: str) -> LengthLimits:
    """The examples' per-sample limits."""
    return LengthLimits(family, max_input_len=256, max_target_len=64, max_seq_len=320)


def check_token_budget(parser: argparse.ArgumentParser, budget: int, model: str) -> None:
    """``parser.error`` (one line, exit 2) when ``--token-budget`` cannot hold one maximal sample of ``model``."""
    longest = length_limits(sequence_kind(model)).max_tokens
    if budget < longest:
        parser.error(f"--token-budget {budget} cannot hold one maximal sample ({longest} tokens); "
                     f"pass at least {longest}")
