"""Attention paths and padding-free kernels, torch-free (the models check their kernels against these names)."""

from __future__ import annotations

from dynabatch.core.registry import Registry

ATTENTION_PATHS = Registry("attention path", [
    ("segments", "padding-free: per-sample attention, nothing computed across samples or on pad"),
    ("dense", "4-D block-diagonal masks, the reference"),
])
"""``--attention``: segments (padding-free) or dense (4-D masks); :mod:`dynabatch.models.attention` uses it."""

ATTENTION_KERNELS = Registry("attention kernel", [
    ("auto", "CUDA: FlashAttention varlen where it applies, else flex_attention; CPU: sdpa"),
    ("sdpa", "one SDPA call per group of near-equal samples"),
    ("varlen", "FlashAttention varlen"),
    ("flex", "flex_attention with a document block mask"),
])
"""``--attention-kernel``: what runs padding-free attention (:data:`dynabatch.models.attention_kernels.KERNELS`)."""
