"""Small model configurations that run on a CPU, and loading of local checkpoints.

``build_config("t5-tiny")`` returns a Hugging Face config; ``build_model(name_or_path)`` returns a
randomly initialised model for a preset name, or ``from_pretrained`` of a local directory.
Vocabulary and special ids default to the built-in offline tokenizer (pad 0, eos 1, unk 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from transformers import GPT2Config, GPT2LMHeadModel, PretrainedConfig, T5Config, T5ForConditionalGeneration

BUILTIN_VOCAB_SIZE = 8192
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


@dataclass(frozen=True)
class ModelPreset:
    """A named model shape."""

    family: str
    """``t5`` (encoder-decoder) or ``gpt2`` (decoder-only)."""
    d_model: int
    num_layers: int
    """Layers of the encoder and of the decoder for T5; transformer blocks for GPT-2."""
    num_heads: int
    d_ff: int
    max_positions: int = 4096
    """GPT-2 position table size (T5 uses relative positions and has no limit)."""


PRESETS: dict[str, ModelPreset] = {
    "t5-tiny": ModelPreset("t5", d_model=64, num_layers=2, num_heads=4, d_ff=128),
    "t5-mini": ModelPreset("t5", d_model=128, num_layers=4, num_heads=4, d_ff=512),
    "t5-small": ModelPreset("t5", d_model=512, num_layers=6, num_heads=8, d_ff=2048),
    "gpt2-tiny": ModelPreset("gpt2", d_model=64, num_layers=2, num_heads=4, d_ff=256),
    "gpt2-mini": ModelPreset("gpt2", d_model=128, num_layers=4, num_heads=4, d_ff=512),
    "gpt2-small": ModelPreset("gpt2", d_model=768, num_layers=12, num_heads=12, d_ff=3072),
    # The benchmark models of `dynabatch bench --model t5 / gpt` (issue 9's "small T5, about d_model 256,
    # 4+4 layers" and a GPT-2 of similar size: 8 blocks, about the same parameters).
    "t5-d256": ModelPreset("t5", d_model=256, num_layers=4, num_heads=4, d_ff=1024),
    "gpt2-d256": ModelPreset("gpt2", d_model=256, num_layers=8, num_heads=4, d_ff=1024),
}


def build_config(name: str, vocab_size: int = BUILTIN_VOCAB_SIZE, dropout: float = 0.0) -> PretrainedConfig:
    """The Hugging Face config of a preset. ``dropout`` applies to every dropout in the model."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)} (or a local checkpoint dir)")
    p = PRESETS[name]
    if p.family == "t5":
        return T5Config(
            vocab_size=vocab_size,
            d_model=p.d_model,
            d_kv=p.d_model // p.num_heads,
            d_ff=p.d_ff,
            num_layers=p.num_layers,
            num_decoder_layers=p.num_layers,
            num_heads=p.num_heads,
            dropout_rate=dropout,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            decoder_start_token_id=PAD_ID,
            feed_forward_proj="relu",
            tie_word_embeddings=True,
            use_cache=False,
        )
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=p.max_positions,
        n_embd=p.d_model,
        n_layer=p.num_layers,
        n_head=p.num_heads,
        n_inner=p.d_ff,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=EOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        use_cache=False,
    )


def model_family(config: PretrainedConfig) -> str:
    """``t5`` or ``gpt2`` for a supported config, else a ``ValueError``."""
    if config.model_type in ("t5", "gpt2"):
        return config.model_type
    raise ValueError(f"model type {config.model_type!r} is not supported; dynabatch supports t5 and gpt2")


def build_model(name_or_path: str, vocab_size: int = BUILTIN_VOCAB_SIZE, dropout: float = 0.0, seed: int = 0):
    """A preset built from config (random init, seeded) or a local checkpoint directory."""
    import torch

    if os.path.isdir(name_or_path):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
        cls = T5ForConditionalGeneration if model_family(config) == "t5" else GPT2LMHeadModel
        return cls.from_pretrained(name_or_path, local_files_only=True)
    config = build_config(name_or_path, vocab_size=vocab_size, dropout=dropout)
    torch.manual_seed(seed)
    cls = T5ForConditionalGeneration if config.model_type == "t5" else GPT2LMHeadModel
    return cls(config)
