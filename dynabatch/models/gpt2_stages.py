"""One pipeline stage of a Hugging Face ``GPT2LMHeadModel``.

A stage holds a contiguous run of the layer kinds ``embedding, gpt x L, lm_head`` (see
:mod:`dynabatch.cost.model_specs`) and runs exactly what ``GPT2Model.forward`` runs for them:

* ``embedding``: ``drop(wte(input_ids) + wpe(position_ids))`` with the per-sample position ids;
* ``gpt`` blocks: each ``GPT2Block`` (or the half of one, ``gpt_attn`` / ``gpt_mlp``, where the stage
  boundary cuts the block: :mod:`~dynabatch.models.block_parts`) called directly as GPT2Model calls it, with
  padding-free per-sample causal attention (:mod:`dynabatch.models.attention`) or, on a ``dense`` stage, the 4-D additive
  block-diagonal causal mask built from ``segment_ids`` (:func:`~dynabatch.models.forward.causal_segment_mask`),
  no cache, no cross-attention, through :func:`~dynabatch.models.recompute.run_block` (activation
  recomputation under the executor's mode); a token slice (TeraPipe) instead passes a
  :class:`~dynabatch.models.slice_kv.SliceCache` as the blocks' cache, so attention also sees the keys
  and values of the chain's earlier slices, with the causal mask aligned bottom-right;
* ``lm_head``: ``ln_f``, ``lm_head`` (tied to ``wte`` unless the model unties it) and the fp32 token
  loss sum against the micro-batch's pre-shifted ``target_ids`` (loaded as ``labels``).

Chained stages reproduce :func:`~dynabatch.models.forward.causal_lm_forward` on the whole model, loss
and gradients (tests/unit/models/test_stage_split.py). The constructor references the model's own
submodules; :func:`dynabatch.models.split.build_stage` deep-copies the result so the stage owns its
parameters and fills :attr:`GPT2Stage.parameter_map`.
"""

from __future__ import annotations

import torch
from torch import nn

from dynabatch.models.block_parts import BlockNames, attention_layer_ids, block_parts
from dynabatch.models.boundary_copies import boundary_tied_parameters, hold_copies, units_to_run
from dynabatch.models.hf_compat import cache_kwargs
from dynabatch.models.recompute import run_block
from dynabatch.models.slice_kv import SliceCache, SliceContext
from dynabatch.models.stage import StageModule, StageOutput

GPT2_BLOCK = BlockNames(attention_norm="ln_1", attention="attn", mlp_norm="ln_2")
"""``GPT2Block``'s submodules (a stage boundary inside a block runs its halves, :mod:`~dynabatch.models.block_parts`)."""
SHARED_EMBEDDING = "shared_embedding"
"""Tied-parameter group of the token table and the tied output projection."""


def gpt2_tied_groups(kinds: tuple[str, ...], tied_head: bool) -> tuple[str, ...]:
    """Tied-parameter groups a GPT-2 stage with layer ``kinds`` holds (``tied_head``: lm_head is wte)."""
    holds_table = "embedding" in kinds or (tied_head and "lm_head" in kinds)
    return (SHARED_EMBEDDING,) if holds_table and tied_head else ()


class GPT2Stage(StageModule):
    """Stage ``stage_index`` of a GPT-2 pipeline cut by a :class:`~dynabatch.cost.stages.StageLayout`.

    Receives ``hidden`` (B, T, d) unless it holds the embedding; sends ``hidden`` unless it is the
    last stage. Loads ``segment_ids`` always, ``input_ids`` + ``position_ids`` with the embedding and
    ``labels`` with the head.
    """

    parameter_map: dict[str, str]
    """Stage parameter name -> the original model's parameter name (tied copies map to the canonical
    name, ``transformer.wte.weight``); filled by :func:`dynabatch.models.split.build_stage`."""

    def __init__(self, model: nn.Module, layout, stage_index: int, moving_boundaries: bool = False) -> None:
        super().__init__()
        self._place(layout, stage_index, moving_boundaries)
        transformer = model.transformer
        self.tied_head = model.lm_head.weight is transformer.wte.weight
        if self.has_embedding:
            self.wte = transformer.wte
            self.wpe = transformer.wpe
            self.drop = transformer.drop
        self.blocks = block_parts(transformer.h, layout, stage_index, GPT2_BLOCK)
        hold_copies(self, lambda i: block_parts(transformer.h, layout, i, GPT2_BLOCK))
        if self.has_head:
            self.ln_f = transformer.ln_f
            self.lm_head = model.lm_head

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """``shared_embedding``: the token table (embedding stage) or the tied head weight (last stage); under
        moving boundaries also the units either side of a boundary may run (by original parameter name)."""
        moving = boundary_tied_parameters(self)
        if not gpt2_tied_groups(self.kinds, self.tied_head):
            return moving
        weight = self.wte.weight if self.has_embedding else self.lm_head.weight
        return {SHARED_EMBEDDING: weight, **moving}

    supports_slices = True

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
        if self.has_embedding:
            input_ids = loaded["input_ids"].to(device, non_blocking=True)  # (B, T)
            position_ids = loaded["position_ids"].to(device, non_blocking=True)  # (B, T)
            hidden = self.drop(self.wte(input_ids) + self.wpe(position_ids))  # (B, T, d)
        else:
            hidden = received["hidden"]  # (B, T, d)
        blocks = units_to_run(self, moves)
        cache = SliceCache(context, attention_layer_ids(blocks, GPT2_BLOCK)) if sliced else None
        context_ids = context.segment_ids if context is not None else None
        mask = self.self_attention_mask("causal", loaded["segment_ids"], dtype, device, context_ids)
        for block in blocks:
            hidden = run_block(block, hidden, attention_mask=mask, use_cache=False,
                               **cache_kwargs(block, cache))  # (B, T, d)
        return self.causal_output(hidden, loaded, segment_ids, cache, "ln_f")
