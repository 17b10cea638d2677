"""The ``llama`` family: Llama-style decoders (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``MistralForCausalLM``).

What they share, and what a stage runs exactly as ``LlamaModel.forward`` does for its layers:

* ``embedding``: ``embed_tokens(input_ids)`` (no position table, no dropout);
* ``gpt`` blocks (the decoder-only block kind): each HF decoder layer (or the half of one where the stage
  boundary cuts it, :mod:`~dynabatch.models.block_parts`) called as the HF model calls it,
  with rotary ``position_embeddings = rotary_emb(hidden, position_ids)`` from the per-sample position
  ids (restarting at 0 in every packed sample, so every stage loads them:
  ``PipelineSpec.positions_every_stage``), grouped-query attention (``num_key_value_heads`` may be
  below ``num_attention_heads``), RMSNorm, gated SiLU MLP, and padding-free per-sample causal attention
  (:mod:`dynabatch.models.attention`; a ``dense`` stage: the 4-D additive block-diagonal causal mask
  built from the segment ids, :func:`~dynabatch.models.forward.causal_segment_mask`), no cache, through
  :func:`~dynabatch.models.recompute.run_block` (activation recomputation under the executor's mode);
* ``lm_head``: final RMSNorm, ``lm_head`` (tied to ``embed_tokens`` or not) and the fp32 token-loss
  sum against the pre-shifted targets.

Token slices (TeraPipe) pass a :class:`~dynabatch.models.slice_kv.SliceCache` as the layers' cache:
the attention calls ``cache.update`` with its keys *after* the rotary rotation, so the carried
keys/values (``(B, num_key_value_heads, C, head_dim)``) hold the positions of the earlier slices and
the slice's own position ids continue the sample's (tests/dist/test_llama_pipeline.py).

Qwen2 adds Q/K/V biases, Qwen3 a per-head RMSNorm of Q and K inside the attention (the layer is called
the same way); Mistral's sliding window is not modelled by the dense mask, so a length limit above
``sliding_window`` is refused at start. Tried: Llama, Qwen2, Qwen3 and Mistral (tests/unit/models/test_llama_family.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dynabatch.cost.activation_memory import ffn_saved_tensors
from dynabatch.cost.layers import KindSpec, ModelLayers, Step, count_params, hidden_input, padding_mask, token_ids
from dynabatch.cost.model_specs import TransformerSpec
from dynabatch.data.microbatch import IGNORE_INDEX
from dynabatch.models.block_parts import BlockNames, attention_layer_ids, block_parts
from dynabatch.models.boundary_copies import boundary_tied_parameters, hold_copies, units_to_run
from dynabatch.models.hf_compat import cache_kwargs
from dynabatch.models.families import ModelFamily, register_family
from dynabatch.models.masks import _token_losses, causal_segment_mask
from dynabatch.models.gpt2_stages import SHARED_EMBEDDING, gpt2_tied_groups
from dynabatch.models.recompute import run_block
from dynabatch.models.slice_kv import SliceCache, SliceContext
from dynabatch.models.stage import StageModule, StageOutput
from dynabatch.core.sequence import CAUSAL

LLAMA_BLOCK = BlockNames(attention_norm="input_layernorm", attention="self_attn", mlp_norm="post_attention_layernorm")
"""A Llama-style decoder layer's submodules (a stage boundary inside a layer runs its halves)."""
llama_tied_groups = gpt2_tied_groups
"""Same rule as GPT-2: the token table and a tied head form the ``shared_embedding`` group."""


class LlamaStage(StageModule):
    """Stage ``stage_index`` of a Llama-style pipeline cut by a :class:`~dynabatch.cost.stages.StageLayout`.

    Receives ``hidden`` (B, T, d) unless it holds the embedding; sends ``hidden`` unless it is the last
    stage. Loads ``segment_ids`` and ``position_ids`` always, ``input_ids`` with the embedding and
    ``labels`` with the head.
    """

    supports_slices = True

    def __init__(self, model: nn.Module, layout, stage_index: int, moving_boundaries: bool = False) -> None:
        super().__init__()
        self._place(layout, stage_index, moving_boundaries)
        inner = model.model
        self.tied_head = model.lm_head.weight is inner.embed_tokens.weight
        if self.has_embedding:
            self.embed_tokens = inner.embed_tokens
        self.rotary_emb = inner.rotary_emb  # buffers only (inv_freq), no parameters
        self.blocks = block_parts(inner.layers, layout, stage_index, LLAMA_BLOCK)
        hold_copies(self, lambda i: block_parts(inner.layers, layout, i, LLAMA_BLOCK))
        if self.has_head:
            self.norm = inner.norm
            self.lm_head = model.lm_head

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """``shared_embedding``: the token table (embedding stage) or the tied head weight (last stage); under
        moving boundaries also the units either side of a boundary may run (by original parameter name)."""
        moving = boundary_tied_parameters(self)
        if not llama_tied_groups(self.kinds, self.tied_head):
            return moving
        return {SHARED_EMBEDDING: self.embed_tokens.weight if self.has_embedding else self.lm_head.weight, **moving}

    def forward(
        self,
        received: dict[str, torch.Tensor],
        loaded: dict[str, torch.Tensor],
        context: SliceContext | None = None,
        *,
        sliced: bool = False,
        moves: tuple[int, int] = (0, 0),
    ) -> StageOutput:
        """``moves``: the micro-batch's moves at the boundaries below and above the stage (which units run,
        :func:`~dynabatch.models.boundary_copies.units_to_run`); a token slice's chain keeps one."""
        device, dtype = self._device_dtype()
        segment_ids = loaded["segment_ids"].to(device, non_blocking=True)  # (B, T)
        position_ids = loaded["position_ids"].to(device, non_blocking=True)  # (B, T), continue across slices
        if self.has_embedding:
            hidden = self.embed_tokens(loaded["input_ids"].to(device, non_blocking=True))  # (B, T, d)
        else:
            hidden = received["hidden"]  # (B, T, d)
        rotary = self.rotary_emb(hidden, position_ids)  # cos, sin: (B, T, head_dim)
        blocks = units_to_run(self, moves)
        cache = SliceCache(context, attention_layer_ids(blocks, LLAMA_BLOCK)) if sliced else None
        context_ids = context.segment_ids if context is not None else None
        mask = self.self_attention_mask("causal", loaded["segment_ids"], dtype, device, context_ids)
        for block in blocks:
            hidden = run_block(block, hidden, attention_mask=mask, position_ids=position_ids, use_cache=False,
                               position_embeddings=rotary, **cache_kwargs(block, cache))  # (B, T, d)
        return self.causal_output(hidden, loaded, segment_ids, cache, "norm")


def llama_spec(config, dtype_bytes: int = 2) -> TransformerSpec:
    """The analytic spec of a Llama / Qwen2 / Mistral config: RMSNorm, gated MLP, GQA, rotary (no table)."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
    return TransformerSpec(
        CAUSAL,
        d_model=int(config.hidden_size),
        num_heads=heads,
        d_kv=int(head_dim),
        d_ff=int(config.intermediate_size),
        num_layers=int(config.num_hidden_layers),
        num_decoder_layers=0,
        vocab_size=int(config.vocab_size),
        gated_ffn=True,
        dtype_bytes=dtype_bytes,
        tie_embeddings=bool(config.tie_word_embeddings),
        max_positions=0,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        norm="rms",
        biases="qkv" if qkv_bias else "none",
        qk_norm=config.model_type == "qwen3",
        ffn_saved=ffn_saved_tensors(config.hidden_act, gated=True),
    )


def _check_sliding_window(config, max_len: int) -> None:
    window = getattr(config, "sliding_window", None)
    if window is not None and max_len > window:
        raise ValueError(
            f"the length limit is {max_len} tokens but this {config.model_type} model uses sliding-window "
            f"attention over {window} tokens, which dynabatch's masks do not model; lower the limit to at most {window}"
        )


LLAMA_KINDS = (
    KindSpec("llama_embedding", ("b", "E")),
    KindSpec("llama_context", ("b", "E")),
    KindSpec("llama_block", ("b", "E")),
    KindSpec("llama_head", ("b", "E")),
)


def llama_layers(name: str, model, device, dtype) -> ModelLayers:
    """Profiler layer builders: embedding; per-stage context (mask from segment ids + rotary cos/sin,
    built once and shared by the stage's blocks); one decoder layer; final norm + head + loss."""
    cfg, inner = model.config, model.model
    d, vocab = cfg.hidden_size, cfg.vocab_size
    block = inner.layers[0]

    def positions(b, n):
        return torch.arange(n, device=device).expand(b, n)

    def context_of(x, b, n):
        segments = padding_mask(b, n, device)  # one sample per row, last token of the last row padding
        return causal_segment_mask(segments, dtype), inner.rotary_emb(x, positions(b, n))

    def embedding(b, e, _d):
        ids = token_ids(b, e, vocab, device)
        return Step(run=lambda: ((inner.embed_tokens(ids),), ()))

    def context(b, e, _d):
        x = torch.zeros(b, e, d, device=device, dtype=dtype)
        h = hidden_input(b, e, d, device, dtype)
        return Step(run=lambda: ((), (*_flat(context_of(x, b, e)),)),
                    consumer=lambda outs: block(h, attention_mask=outs[0], position_embeddings=(outs[1], outs[2])))

    def block_step(b, e, _d):
        h = hidden_input(b, e, d, device, dtype)
        with torch.no_grad():
            mask, rotary = context_of(h, b, e)
        return Step(run=lambda: ((block(h, attention_mask=mask, position_embeddings=rotary),), ()),
                    leaves=(h,), shared=(mask, *rotary))

    def head(b, e, _d):
        h = hidden_input(b, e, d, device, dtype)
        labels = token_ids(b, e, vocab, device)
        labels[-1, -1] = IGNORE_INDEX
        return Step(run=lambda: ((_token_losses(model.lm_head(inner.norm(h)), labels).sum(),), ()), leaves=(h,))

    emb = vocab * d
    tied = model.lm_head.weight is inner.embed_tokens.weight
    return ModelLayers(
        name, "llama", model, LLAMA_KINDS,
        makers={"llama_embedding": embedding, "llama_context": context, "llama_block": block_step, "llama_head": head},
        num_params={"llama_embedding": emb, "llama_context": 0, "llama_block": count_params(block),
                    "llama_head": count_params(inner.norm) + count_params(model.lm_head)},
        tied_params={"llama_embedding": emb, **({"llama_head": emb} if tied else {})},
        sequence_kind=CAUSAL,
        analytic_kinds={"embedding": ("llama_embedding",), "gpt": ("llama_block",), "lm_head": ("llama_head",)},
        context_kinds={"gpt": "llama_context"},
    )


def _flat(context) -> tuple[torch.Tensor, ...]:
    mask, (cos, sin) = context
    return mask, cos, sin


LLAMA = register_family(ModelFamily(
    name="llama",
    model_types=("llama", "qwen2", "qwen3", "mistral"),
    model_classes=("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"),
    sequence_kind=CAUSAL,
    stage_class=LlamaStage,
    tied_groups=llama_tied_groups,
    analytic_spec=llama_spec,
    d_model=lambda config: int(config.hidden_size),
    presets=("llama-tiny", "llama-d256"),
    positions_every_stage=True,
    trained_positions=lambda config: getattr(config, "max_position_embeddings", None),
    profile_layers=llama_layers,
    check_config=_check_sliding_window,
))
