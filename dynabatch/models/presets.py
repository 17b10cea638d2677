"""Compatibility home of the CPU presets: they live in :mod:`dynabatch.model_presets` (bottom floor,
so that ``cost/`` does not import ``models/``); :func:`model_family` asks the family registry, and
:func:`build_run_model` builds the model a run trains for its tokenizer."""

from __future__ import annotations

import os

from dynabatch.core.sequence import is_seq2seq
from dynabatch.data.tokenize import check_tokenizer_fits, resolve_tokenizer
from dynabatch.model_presets import (  # noqa: F401 - re-exported
    BUILTIN_VOCAB_SIZE,
    EOS_ID,
    PAD_ID,
    PRESETS,
    UNK_ID,
    ModelPreset,
    build_config,
    build_model,
    load_config,
    model_class,
)
from dynabatch.models.families import family_for_config


def model_family(config) -> str:
    """The registered family name of a supported config (``gpt2``, ``t5``, ``llama``), else a ``ValueError``."""
    return family_for_config(config).name


def build_run_model(model: str, tokenizer: str, info, family: str, dropout: float = 0.0, seed: int = 0):
    """The model a run trains with the tokenizer ``info`` describes (``tokenizer`` names it): a preset built with
    the tokenizer's vocabulary and special ids, or a model folder, loaded after
    :func:`~dynabatch.data.tokenize.check_tokenizer_fits` accepts the pair (one ``ValueError`` line otherwise)."""
    if os.path.isdir(model):
        check_tokenizer_fits(info, load_config(model), resolve_tokenizer(tokenizer, model), model)
    return build_model(model, vocab_size=info.vocab_size, dropout=dropout, seed=seed,
                       special_ids=info.config_ids(is_seq2seq(family)))
