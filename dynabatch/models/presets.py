"""Compatibility home of the CPU presets: they live in :mod:`dynabatch.model_presets` (bottom floor,
so that ``cost/`` does not import ``models/``); :func:`model_family` asks the family registry."""

from __future__ import annotations

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


def model_family(config) -> str:
    """The registered family name of a supported config (``gpt2``, ``t5``, ``llama``), else a ``ValueError``."""
    from dynabatch.models.families import family_for_config

    return family_for_config(config).name
