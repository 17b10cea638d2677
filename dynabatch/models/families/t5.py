"""The ``t5`` family: ``T5ForConditionalGeneration`` (T5, T5 v1.1 / Flan-T5 with gated-GELU FFN and an
untied head) and ``MT5ForConditionalGeneration`` (mT5: the same modules under the ``mt5`` model type).

Stages: :class:`~dynabatch.models.t5_stages.T5Stage`. Relative positions: no length limit.
"""

from __future__ import annotations

from dynabatch.cost.layers import t5_layers
from dynabatch.cost.model_specs import TransformerSpec
from dynabatch.models.families import ModelFamily, register_family
from dynabatch.models.t5_stages import T5Stage, t5_tied_groups
from dynabatch.sequence import SEQ2SEQ



def t5_spec(config, dtype_bytes: int = 2) -> TransformerSpec:
    """The analytic spec of a ``T5Config`` / ``MT5Config``.

    The head is tied when ``config.tie_word_embeddings`` says so; transformers 5 forces this for every
    T5 config (the module it builds is tied), while the ``t5-v1_1-*`` presets keep the published untied head.
    """
    return TransformerSpec(
        SEQ2SEQ,
        d_model=config.d_model,
        num_heads=config.num_heads,
        d_kv=config.d_kv,
        d_ff=config.d_ff,
        num_layers=config.num_layers,
        num_decoder_layers=config.num_decoder_layers,
        vocab_size=config.vocab_size,
        gated_ffn=bool(config.is_gated_act),
        dtype_bytes=dtype_bytes,
        tie_embeddings=bool(config.tie_word_embeddings),
        relative_attention_num_buckets=config.relative_attention_num_buckets,
    )


T5 = register_family(ModelFamily(
    name="t5",
    model_types=("t5", "mt5"),
    model_classes=("T5ForConditionalGeneration", "MT5ForConditionalGeneration"),
    sequence_kind=SEQ2SEQ,
    stage_class=T5Stage,
    tied_groups=t5_tied_groups,
    analytic_spec=t5_spec,
    d_model=lambda config: int(config.d_model),
    presets=("t5-tiny", "t5-mini", "t5-small", "t5-d256"),
    profile_layers=t5_layers,
))
