"""The ``gpt2`` family: Hugging Face ``GPT2LMHeadModel`` (learned positions, LayerNorm, biases, GELU MLP).

Stages: :class:`~dynabatch.models.gpt2_stages.GPT2Stage` (token slices supported). The learned
position table (``n_positions``) is a hard limit on the sequence length, checked at start.
"""

from __future__ import annotations

from dynabatch.cost.layers import gpt2_layers
from dynabatch.cost.model_specs import TransformerSpec
from dynabatch.models.families import ModelFamily, register_family
from dynabatch.models.gpt2_stages import GPT2Stage, gpt2_tied_groups
from dynabatch.sequence import CAUSAL



def gpt2_spec(config, dtype_bytes: int = 2) -> TransformerSpec:
    """The analytic spec of a ``GPT2Config`` (LayerNorm, biases everywhere, learned positions)."""
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
    return TransformerSpec(
        CAUSAL,
        d_model=config.n_embd,
        num_heads=config.n_head,
        d_kv=config.n_embd // config.n_head,
        d_ff=config.n_inner or 4 * config.n_embd,
        num_layers=config.n_layer,
        num_decoder_layers=0,
        vocab_size=config.vocab_size,
        dtype_bytes=dtype_bytes,
        tie_embeddings=bool(config.tie_word_embeddings),
        max_positions=config.n_positions,
    )


GPT2 = register_family(ModelFamily(
    name="gpt2",
    model_types=("gpt2",),
    model_classes=("GPT2LMHeadModel",),
    sequence_kind=CAUSAL,
    stage_class=GPT2Stage,
    tied_groups=gpt2_tied_groups,
    analytic_spec=gpt2_spec,
    d_model=lambda config: int(config.n_embd),
    presets=("gpt2-tiny", "gpt2-mini", "gpt2-small", "gpt2-d256"),
    position_table=lambda config: int(config.n_positions),
    profile_layers=gpt2_layers,
))
