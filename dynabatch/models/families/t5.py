"""The ``t5`` family: ``T5ForConditionalGeneration`` (T5, T5 v1.1 / Flan-T5 with gated-GELU FFN and an
untied head) and ``MT5ForConditionalGeneration`` (mT5: the same modules under the ``mt5`` model type).

Stages: :class:`~dynabatch.models.t5_stages.T5Stage`. Relative positions: no length limit.
"""

from __future__ import annotations

import torch
from torch import nn

from dynabatch.cost.activation_memory import ffn_saved_tensors
from dynabatch.cost.layers import KindSpec, ModelLayers, Step, count_params, hidden_input, padding_mask, token_ids
from dynabatch.cost.model_specs import TransformerSpec
from dynabatch.cost.tables import T5_ANALYTIC_KINDS
from dynabatch.models.families import ModelFamily, register_family
from dynabatch.models.t5_stages import T5Stage, t5_tied_groups
from dynabatch.core.sequence import SEQ2SEQ


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
        ffn_saved=ffn_saved_tensors(config.dense_act_fn, gated=bool(config.is_gated_act)),
    )


T5_KINDS = (
    KindSpec("t5_encoder_embedding", ("b", "E")),
    KindSpec("t5_encoder_context", ("b", "E")),
    KindSpec("t5_encoder_block", ("b", "E")),
    KindSpec("t5_encoder_final", ("b", "E")),
    KindSpec("t5_decoder_embedding", ("b", "D")),
    KindSpec("t5_decoder_context", ("b", "E", "D")),
    KindSpec("t5_decoder_block", ("b", "E", "D")),
    KindSpec("t5_head", ("b", "D")),
)


def t5_layers(name: str, model, device, dtype) -> ModelLayers:
    """Profiler layer builders of a T5 / mT5 model (kinds :data:`T5_KINDS`)."""
    from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

    cfg, enc, dec = model.config, model.encoder, model.decoder
    d, vocab, heads = cfg.d_model, cfg.vocab_size, cfg.num_heads
    enc_block = enc.block[min(1, len(enc.block) - 1)]
    dec_block = dec.block[min(1, len(dec.block) - 1)]
    enc_bias, dec_bias = enc.block[0].layer[0].SelfAttention, dec.block[0].layer[0].SelfAttention
    scale = getattr(cfg, "scale_decoder_outputs", False)  # T5 with a tied head; mT5 never rescales

    def enc_context(x, b, e):
        mask = create_bidirectional_mask(config=enc.config, inputs_embeds=x, attention_mask=padding_mask(b, e, device))
        return mask, enc_bias.compute_bias(e, e, device=device)

    def dec_context(x, enc_states, b, e, n):
        # no cache, passed positionally: its keyword is past_key_values in transformers 5.17, cache in 5.24
        self_mask = create_causal_mask(dec.config, x, padding_mask(b, n, device), None)
        cross_mask = create_bidirectional_mask(config=dec.config, inputs_embeds=x,
                                               attention_mask=padding_mask(b, e, device),
                                               encoder_hidden_states=enc_states)
        self_bias = dec_bias.compute_bias(n, n, device=device)
        cross_bias = torch.zeros(1, heads, n, e, device=device, dtype=dtype)
        return self_mask, cross_mask, self_bias, cross_bias

    def embedding(stack, length_dim):
        def make(b, e, n):
            ids = token_ids(b, e if length_dim == "E" else n, vocab, device)
            return Step(run=lambda: ((stack.dropout(model.shared(ids)),), ()))
        return make

    def encoder_context(b, e, _n):
        x = torch.zeros(b, e, d, device=device, dtype=dtype)
        h = hidden_input(b, e, d, device, dtype)

        def run():
            mask, bias = enc_context(x, b, e)
            return (bias,), (mask,)
        return Step(run=run, consumer=lambda outs: enc_block(h, attention_mask=outs[1], position_bias=outs[0]))

    def encoder_block(b, e, _n):
        h = hidden_input(b, e, d, device, dtype)
        with torch.no_grad():
            mask, bias = enc_context(h, b, e)
        return Step(run=lambda: ((enc_block(h, attention_mask=mask, position_bias=bias)[0],), ()),
                    leaves=(h,), shared=(mask, bias))

    def encoder_final(b, e, _n):
        h = hidden_input(b, e, d, device, dtype)
        return Step(run=lambda: ((enc.dropout(enc.final_layer_norm(h)),), ()), leaves=(h,))

    def decoder_context(b, e, n):
        x = torch.zeros(b, n, d, device=device, dtype=dtype)
        h, enc_states = hidden_input(b, n, d, device, dtype), hidden_input(b, e, d, device, dtype)

        def run():
            self_mask, cross_mask, self_bias, cross_bias = dec_context(x, enc_states, b, e, n)
            return (self_bias,), (self_mask, cross_mask, cross_bias, enc_states)

        def consume(outs):
            self_bias, self_mask, cross_mask, cross_bias, states = outs
            return dec_block(h, self_mask, self_bias, states, cross_mask, cross_bias)
        return Step(run=run, consumer=consume, passthrough=(enc_states,))

    def decoder_block(b, e, n):
        h, enc_states = hidden_input(b, n, d, device, dtype), hidden_input(b, e, d, device, dtype)
        with torch.no_grad():
            ctx = dec_context(h, enc_states, b, e, n)
        self_mask, cross_mask, self_bias, cross_bias = ctx
        return Step(run=lambda: ((dec_block(h, self_mask, self_bias, enc_states, cross_mask, cross_bias)[0],), ()),
                    leaves=(h, enc_states), shared=(*ctx, enc_states))

    def head(b, _e, n):
        h = hidden_input(b, n, d, device, dtype)
        labels = token_ids(b, n, vocab, device)
        labels[-1, -1] = -100
        loss_fn = nn.CrossEntropyLoss(ignore_index=-100)

        def run():
            out = dec.dropout(dec.final_layer_norm(h))
            if scale:
                out = out * (d**-0.5)
            logits = model.lm_head(out)
            return (loss_fn(logits.view(-1, logits.size(-1)), labels.view(-1)),), ()
        return Step(run=run, leaves=(h,))

    emb = vocab * d
    bias_skip = ("relative_attention_bias",)
    return ModelLayers(
        name, "t5", model, T5_KINDS,
        makers={"t5_encoder_embedding": embedding(enc, "E"), "t5_encoder_context": encoder_context,
                "t5_encoder_block": encoder_block, "t5_encoder_final": encoder_final,
                "t5_decoder_embedding": embedding(dec, "D"), "t5_decoder_context": decoder_context,
                "t5_decoder_block": decoder_block, "t5_head": head},
        num_params={"t5_encoder_embedding": emb, "t5_encoder_context": count_params(enc_bias.relative_attention_bias),
                    "t5_encoder_block": count_params(enc_block, bias_skip), "t5_encoder_final": count_params(enc.final_layer_norm),
                    "t5_decoder_embedding": emb, "t5_decoder_context": count_params(dec_bias.relative_attention_bias),
                    "t5_decoder_block": count_params(dec_block, bias_skip),
                    "t5_head": count_params(dec.final_layer_norm) + count_params(model.lm_head)},
        tied_params={"t5_encoder_embedding": emb, "t5_decoder_embedding": emb,
                     **({"t5_head": emb} if cfg.tie_word_embeddings else {})},
        sequence_kind="seq2seq",
        analytic_kinds=T5_ANALYTIC_KINDS,
        context_kinds={"t5_encoder": "t5_encoder_context", "t5_decoder": "t5_decoder_context"},
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
