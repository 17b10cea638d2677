"""Sequence kinds, kept at their old import path: the names live in :mod:`dynabatch.core.sequence`."""

from dynabatch.core.sequence import CAUSAL, SEQ2SEQ, SEQUENCE_KINDS, is_seq2seq, sequence_kind  # noqa: F401
