"""Sequence kinds: the one fact about a model that data, planning and scheduling need.

A model family (``dynabatch.models.families``) is either *causal* (decoder-only: one sequence of
inputs + targets, e.g. GPT-2, Llama, Qwen2, Mistral) or *seq2seq* (encoder-decoder: encoder inputs
and decoder targets, e.g. T5, Flan-T5, mT5). ``data/``, ``plan/``, ``schedule/`` and ``cost/`` branch
on this kind only, never on a family name.

The names the project used before it had a family registry (``gpt2``/``gpt`` for causal, ``t5`` for
seq2seq) are still accepted by :func:`sequence_kind`, so old profile files and calls keep working.
"""

from __future__ import annotations

from dynabatch.core.registry import Registry

CAUSAL = "causal"
"""Decoder-only: one sequence per sample (inputs then targets), causal attention."""
SEQ2SEQ = "seq2seq"
"""Encoder-decoder: encoder inputs, decoder targets, cross-attention."""
SEQUENCE_KINDS = Registry("sequence kind", [(CAUSAL, "decoder-only"), (SEQ2SEQ, "encoder-decoder")])

_LEGACY_NAMES = {"gpt2": CAUSAL, "gpt": CAUSAL, "t5": SEQ2SEQ}
"""Family names used before the registry, mapped to their sequence kind."""


def sequence_kind(name: str) -> str:
    """The sequence kind ``name`` stands for (``causal``/``seq2seq``, or a legacy name); else ``ValueError``."""
    if name in SEQUENCE_KINDS:
        return name
    if name in _LEGACY_NAMES:
        return _LEGACY_NAMES[name]
    raise ValueError(f"unknown sequence kind {name!r}; valid: {', '.join(SEQUENCE_KINDS)}")


def is_seq2seq(name: str) -> bool:
    """Whether ``name`` (a sequence kind or legacy family name) is encoder-decoder."""
    return sequence_kind(name) == SEQ2SEQ
