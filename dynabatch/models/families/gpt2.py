"""The ``gpt2`` family: Hugging Face ``GPT2LMHeadModel`` (learned positions, LayerNorm, biases, GELU MLP).

Stages: :class:`~dynabatch.models.gpt2_stages.GPT2Stage` (token slices supported). The learned
position table (``n_positions``) is a hard limit on the sequence length, checked at start.
"""

from __future__ import annotations

import torch

from dynabatch.cost.activation_memory import ffn_saved_tensors
from dynabatch.cost.layers import KindSpec, ModelLayers, Step, count_params, hidden_input, padding_mask, token_ids
from dynabatch.cost.model_specs import TransformerSpec
from dynabatch.cost.tables import GPT2_ANALYTIC_KINDS
from dynabatch.models.families import ModelFamily, register_family
from dynabatch.models.gpt2_stages import GPT2Stage, gpt2_tied_groups
from dynabatch.core.sequence import CAUSAL


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
        fused_qkv=True,
        ffn_saved=ffn_saved_tensors(config.activation_function, gated=False),
    )


GPT2_KINDS = (
    KindSpec("gpt2_embedding", ("b", "E")),
    KindSpec("gpt2_context", ("b", "E")),
    KindSpec("gpt2_block", ("b", "E")),
    KindSpec("gpt2_head", ("b", "E")),
)


def gpt2_layers(name: str, model, device, dtype) -> ModelLayers:
    """Profiler layer builders of a ``GPT2LMHeadModel`` (kinds :data:`GPT2_KINDS`)."""
    from transformers.masking_utils import create_causal_mask

    from transformers.loss.loss_utils import ForCausalLMLoss as causal_lm_loss  # what GPT2LMHeadModel uses

    cfg, tr = model.config, model.transformer
    d, vocab = cfg.n_embd, cfg.vocab_size
    block = tr.h[0]

    def positions(n):
        return torch.arange(n, device=device).unsqueeze(0)

    def mask_for(hidden, b, n):
        # no cache, passed positionally: its keyword is past_key_values in transformers 5.17, cache in 5.24
        return create_causal_mask(cfg, hidden, padding_mask(b, n, device), None, position_ids=positions(n))

    def embedding(b, e, _d):
        ids, pos = token_ids(b, e, vocab, device), positions(e)
        return Step(run=lambda: ((tr.drop(tr.wte(ids) + tr.wpe(pos)),), ()))

    def context(b, e, _d):
        x = torch.zeros(b, e, d, device=device, dtype=dtype)
        h = hidden_input(b, e, d, device, dtype)
        return Step(run=lambda: ((), (mask_for(x, b, e),)),
                    consumer=lambda outs: block(h, None, outs[0], position_ids=positions(e)))

    def block_step(b, e, _d):
        h = hidden_input(b, e, d, device, dtype)
        mask, pos = mask_for(h.detach(), b, e), positions(e)
        shared = (mask,) if isinstance(mask, torch.Tensor) else ()
        return Step(run=lambda: ((block(h, None, mask, position_ids=pos),), ()), leaves=(h,), shared=shared)

    def head(b, e, _d):
        h = hidden_input(b, e, d, device, dtype)
        labels = token_ids(b, e, vocab, device)
        labels[-1, -1] = -100

        def run():
            logits = model.lm_head(tr.ln_f(h))
            return (causal_lm_loss(logits=logits, labels=labels, vocab_size=vocab),), ()
        return Step(run=run, leaves=(h,))

    emb = vocab * d
    return ModelLayers(
        name, "gpt2", model, GPT2_KINDS,
        makers={"gpt2_embedding": embedding, "gpt2_context": context, "gpt2_block": block_step, "gpt2_head": head},
        num_params={"gpt2_embedding": count_params(tr.wte) + count_params(tr.wpe), "gpt2_context": 0,
                    "gpt2_block": count_params(block), "gpt2_head": count_params(tr.ln_f) + emb},
        tied_params={"gpt2_embedding": emb, "gpt2_head": emb},
        sequence_kind="causal",
        analytic_kinds=GPT2_ANALYTIC_KINDS,
        context_kinds={"gpt": "gpt2_context"},
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
