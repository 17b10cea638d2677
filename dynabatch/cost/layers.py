"""The real Hugging Face layers behind each profiled layer kind, with inputs for one shape.

A pipeline stage is a sum of *layer kinds*. Every kind is cut out of a full HF model built from the
config (so ``_attn_implementation`` and every module are exactly those used in training) and is run
with the inputs a stage would hand it:

GPT-2 (``E`` = sequence length)
  ``gpt2_embedding`` (b, E)   wte(ids) + wpe(positions), dropout
  ``gpt2_context``   (b, E)   causal + padding mask, built once per stage and shared by its blocks
  ``gpt2_block``     (b, E)   one ``GPT2Block``
  ``gpt2_head``      (b, E)   ln_f, lm_head, shifted cross-entropy (HF ``ForCausalLMLoss``)
T5 (``E`` = encoder length, ``D`` = decoder length)
  ``t5_encoder_embedding`` (b, E), ``t5_decoder_embedding`` (b, D)   shared embedding, dropout
  ``t5_encoder_context``   (b, E)   padding mask + relative position bias (``compute_bias`` of layer 0)
  ``t5_encoder_block``     (b, E)   one ``T5Block`` given the precomputed bias
  ``t5_encoder_final``     (b, E)   encoder final RMS norm + dropout
  ``t5_decoder_context``   (b, E, D) causal mask, cross mask, decoder bias, zero cross bias; also owns the
                                    encoder states every decoder block of the stage reads
  ``t5_decoder_block``     (b, E, D) one ``T5Block`` with cross-attention
  ``t5_head``              (b, D)   decoder final norm, dropout, output scaling, lm_head, cross-entropy

Relative attention bias: HF computes it in layer 0 of each stack and hands the same tensor to every
later layer. Here a stage computes it once (``*_context``) and blocks are profiled *with the bias given*,
so a stage of k blocks costs context + k x block, not k x (block + bias). Tensors shared by all blocks
of a stage (masks, biases, encoder states) are excluded from a block's stored bytes and counted once
in the context kind when a block saves them (checked by running one consuming block).

Every micro-batch is padded, so inputs carry one padding token (the last token of the last sample):
the attention masks are materialised as they are in training, instead of the mask-free fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from dynabatch.cost.tables import GPT2_ANALYTIC_KINDS, T5_ANALYTIC_KINDS

Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class KindSpec:
    """A profiled layer kind."""

    name: str
    """Stable name used in profile files and stage specs."""
    dims: tuple[str, ...]
    """Table axes: ``("b", "E")``, ``("b", "D")`` or ``("b", "E", "D")``."""


GPT2_KINDS = (
    KindSpec("gpt2_embedding", ("b", "E")),
    KindSpec("gpt2_context", ("b", "E")),
    KindSpec("gpt2_block", ("b", "E")),
    KindSpec("gpt2_head", ("b", "E")),
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

@dataclass
class Step:
    """One kind at one shape: a forward closure plus what the measurement needs to know."""

    run: Callable[[], tuple[Tensors, Tensors]]
    """Forward. Returns ``(diff_outputs, aux_outputs)``; backward runs from ``diff_outputs``."""
    leaves: Tensors = ()
    """Inputs that need a gradient; their ``.grad`` is cleared before each iteration."""
    shared: Tensors = ()
    """Inputs shared by every layer of a stage: never counted in this kind's stored bytes."""
    consumer: Callable[[Tensors], object] | None = None
    """Context kinds: runs one consuming block on ``diff + aux`` outputs (memory pass only)."""
    passthrough: Tensors = ()
    """Inputs returned as outputs (T5 encoder states handed to every decoder block of a stage): counted in
    this kind's stored and peak bytes when a block saves them, as they are not allocated by ``run``."""
    grads: list[torch.Tensor] = field(default_factory=list)
    """Gradients for ``diff_outputs`` that need one (filled on the first run)."""


@dataclass
class ModelLayers:
    """A built HF model and the kinds it exposes."""

    name: str
    family: str
    """Registered family name (``gpt2``, ``t5``, ``llama``)."""
    model: nn.Module
    kinds: tuple[KindSpec, ...]
    makers: dict[str, Callable[[int, int, int], Step]]
    num_params: dict[str, int]
    """Parameters held by one use of each kind."""
    tied_params: dict[str, int]
    """Parameters of the (tied) token embedding that a kind holds; shared when two such kinds sit in one stage."""
    sequence_kind: str = "causal"
    """``causal`` or ``seq2seq`` (written to the profile so the tables need no family name)."""
    analytic_kinds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Analytic layer kind (``dynabatch.cost.model_specs``) -> the profiled kinds it is made of."""
    context_kinds: dict[str, str] = field(default_factory=dict)
    """Analytic block kind -> the profiled per-stage context kind its stage pays once."""

    @property
    def param_ptrs(self) -> frozenset[int]:
        return frozenset(p.untyped_storage().data_ptr() for p in self.model.parameters())


def token_ids(b: int, n: int, vocab: int, device) -> torch.Tensor:
    """Deterministic random token ids (b, n), avoiding the special ids 0-2."""
    g = torch.Generator().manual_seed(b * 100003 + n)
    return torch.randint(3, vocab, (b, n), generator=g).to(device)


def padding_mask(b: int, n: int, device) -> torch.Tensor:
    """All-ones (b, n) mask but for the last token of the last sample: a padded micro-batch."""
    mask = torch.ones(b, n, dtype=torch.long, device=device)
    if n > 1:
        mask[-1, -1] = 0
    return mask


def _hidden(b: int, n: int, d: int, device, dtype) -> torch.Tensor:
    return torch.randn(b, n, d, device=device, dtype=dtype).requires_grad_(True)


def _count(module: nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if not any(s in n for s in skip))


def build_layers(model: str | object, builder: Callable, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, dropout: float = 0.0, seed: int = 0) -> ModelLayers:
    """Build the HF model and run ``builder(name, hf_model, device, dtype) -> ModelLayers`` on it.

    ``model`` is a preset name or local checkpoint (:mod:`dynabatch.model_presets`) or an HF config
    (``dropout`` is then taken from the config). ``builder`` is the model family's profiler layer
    builder (``dynabatch.models.families``: ``family.profile_layers``), so this module knows no family.
    """
    from dynabatch.model_presets import build_model, model_class

    if isinstance(model, str):
        name, hf_model = model, build_model(model, dropout=dropout, seed=seed)
    else:
        torch.manual_seed(seed)
        name, hf_model = model.model_type, model_class(model).from_config(model)
    hf_model = hf_model.to(device=device, dtype=dtype).train()
    return builder(name, hf_model, torch.device(device), dtype)


def gpt2_layers(name: str, model, device, dtype) -> ModelLayers:
    from transformers.masking_utils import create_causal_mask

    from transformers.loss.loss_utils import ForCausalLMLoss as causal_lm_loss  # what GPT2LMHeadModel uses

    cfg, tr = model.config, model.transformer
    d, vocab = cfg.n_embd, cfg.vocab_size
    block = tr.h[0]

    def positions(n):
        return torch.arange(n, device=device).unsqueeze(0)

    def mask_for(hidden, b, n):
        return create_causal_mask(config=cfg, inputs_embeds=hidden, attention_mask=padding_mask(b, n, device),
                                  cache=None, position_ids=positions(n))

    def embedding(b, e, _d):
        ids, pos = token_ids(b, e, vocab, device), positions(e)
        return Step(run=lambda: ((tr.drop(tr.wte(ids) + tr.wpe(pos)),), ()))

    def context(b, e, _d):
        x = torch.zeros(b, e, d, device=device, dtype=dtype)
        h = _hidden(b, e, d, device, dtype)
        return Step(run=lambda: ((), (mask_for(x, b, e),)),
                    consumer=lambda outs: block(h, None, outs[0], position_ids=positions(e)))

    def block_step(b, e, _d):
        h = _hidden(b, e, d, device, dtype)
        mask, pos = mask_for(h.detach(), b, e), positions(e)
        shared = (mask,) if isinstance(mask, torch.Tensor) else ()
        return Step(run=lambda: ((block(h, None, mask, position_ids=pos),), ()), leaves=(h,), shared=shared)

    def head(b, e, _d):
        h = _hidden(b, e, d, device, dtype)
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
        num_params={"gpt2_embedding": _count(tr.wte) + _count(tr.wpe), "gpt2_context": 0,
                    "gpt2_block": _count(block), "gpt2_head": _count(tr.ln_f) + emb},
        tied_params={"gpt2_embedding": emb, "gpt2_head": emb},
        sequence_kind="causal",
        analytic_kinds=GPT2_ANALYTIC_KINDS,
        context_kinds={"gpt": "gpt2_context"},
    )


def t5_layers(name: str, model, device, dtype) -> ModelLayers:
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
        self_mask = create_causal_mask(config=dec.config, inputs_embeds=x, attention_mask=padding_mask(b, n, device),
                                       cache=None)
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
        h = _hidden(b, e, d, device, dtype)

        def run():
            mask, bias = enc_context(x, b, e)
            return (bias,), (mask,)
        return Step(run=run, consumer=lambda outs: enc_block(h, attention_mask=outs[1], position_bias=outs[0]))

    def encoder_block(b, e, _n):
        h = _hidden(b, e, d, device, dtype)
        with torch.no_grad():
            mask, bias = enc_context(h, b, e)
        return Step(run=lambda: ((enc_block(h, attention_mask=mask, position_bias=bias)[0],), ()),
                    leaves=(h,), shared=(mask, bias))

    def encoder_final(b, e, _n):
        h = _hidden(b, e, d, device, dtype)
        return Step(run=lambda: ((enc.dropout(enc.final_layer_norm(h)),), ()), leaves=(h,))

    def decoder_context(b, e, n):
        x = torch.zeros(b, n, d, device=device, dtype=dtype)
        h, enc_states = _hidden(b, n, d, device, dtype), _hidden(b, e, d, device, dtype)

        def run():
            self_mask, cross_mask, self_bias, cross_bias = dec_context(x, enc_states, b, e, n)
            return (self_bias,), (self_mask, cross_mask, cross_bias, enc_states)

        def consume(outs):
            self_bias, self_mask, cross_mask, cross_bias, states = outs
            return dec_block(h, self_mask, self_bias, states, cross_mask, cross_bias)
        return Step(run=run, consumer=consume, passthrough=(enc_states,))

    def decoder_block(b, e, n):
        h, enc_states = _hidden(b, n, d, device, dtype), _hidden(b, e, d, device, dtype)
        with torch.no_grad():
            ctx = dec_context(h, enc_states, b, e, n)
        self_mask, cross_mask, self_bias, cross_bias = ctx
        return Step(run=lambda: ((dec_block(h, self_mask, self_bias, enc_states, cross_mask, cross_bias)[0],), ()),
                    leaves=(h, enc_states), shared=(*ctx, enc_states))

    def head(b, _e, n):
        h = _hidden(b, n, d, device, dtype)
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
        num_params={"t5_encoder_embedding": emb, "t5_encoder_context": _count(enc_bias.relative_attention_bias),
                    "t5_encoder_block": _count(enc_block, bias_skip), "t5_encoder_final": _count(enc.final_layer_norm),
                    "t5_decoder_embedding": emb, "t5_decoder_context": _count(dec_bias.relative_attention_bias),
                    "t5_decoder_block": _count(dec_block, bias_skip),
                    "t5_head": _count(dec.final_layer_norm) + _count(model.lm_head)},
        tied_params={"t5_encoder_embedding": emb, "t5_decoder_embedding": emb,
                     **({"t5_head": emb} if cfg.tie_word_embeddings else {})},
        sequence_kind="seq2seq",
        analytic_kinds=T5_ANALYTIC_KINDS,
        context_kinds={"t5_encoder": "t5_encoder_context", "t5_decoder": "t5_decoder_context"},
    )
