"""Tiny random-weight configs of the model families for tests (no downloads).

``decoder_config("qwen2")`` etc.: Llama-style decoders with grouped-query attention (4 query heads,
2 key/value heads) and an untied head unless ``tie=True``; ``t5_config("gated")`` / ``("mt5")``: T5 v1.1 /
Flan-T5 (gated-GELU, untied head) and mT5 shapes.
"""

from __future__ import annotations

from transformers import AutoConfig

from dynabatch.model_presets import EOS_ID, PAD_ID


def decoder_config(model_type: str, vocab_size: int = 512, d_model: int = 64, num_layers: int = 4,
                   num_heads: int = 4, num_kv_heads: int = 2, tie: bool = False, **extra):
    """A tiny Llama / Qwen2 / Mistral config (GQA, rotary, RMSNorm, gated MLP)."""
    fields = dict(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=2 * d_model,
                  max_position_embeddings=512, tie_word_embeddings=tie, pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                  bos_token_id=EOS_ID, use_cache=False)
    if model_type == "mistral":
        fields["sliding_window"] = None
    fields.update(extra)
    return AutoConfig.for_model(model_type, **fields)


def t5_config(variant: str, vocab_size: int = 512):
    """T5 v1.1 / Flan-T5 (``gated``: gated-GELU, untied head) or mT5 (``mt5``) at t5-tiny size."""
    model_type = "mt5" if variant == "mt5" else "t5"
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_decoder_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
                                tie_word_embeddings=False, dropout_rate=0.0, pad_token_id=PAD_ID,
                                eos_token_id=EOS_ID, decoder_start_token_id=PAD_ID, use_cache=False)


def build(config, seed: int = 0):
    """A seeded random-weight model of ``config`` in train mode."""
    import torch

    from dynabatch.model_presets import model_class

    torch.manual_seed(seed)
    return model_class(config).from_config(config).train()
