"""The decoder-only blocks a pipeline stage runs: whole Hugging Face blocks, or the halves of a block a stage
boundary cuts (``gpt_attn`` / ``gpt_mlp``, :data:`~dynabatch.cost.model_specs.BLOCK_HALVES`).

A pre-norm decoder block (GPT-2's ``GPT2Block``, Llama's ``LlamaDecoderLayer`` and the layers called like it)
computes ``h = x + attention(norm_1(x))`` then ``h + mlp(norm_2(h))``. :class:`AttentionHalf` runs the first
residual branch, :class:`MlpHalf` the second, on the block's own submodules, so the two halves chained equal
the block exactly (IEEE addition commutes, so ``out + x`` is HF's ``residual + out`` bit for bit) and a stage
hands the next one the hidden state between them, the size of any other hand-off.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dynabatch.cost.model_specs import BLOCK_HALVES

BLOCK = "gpt"
ATTENTION_HALF, MLP_HALF = BLOCK_HALVES[BLOCK]


@dataclass(frozen=True)
class BlockNames:
    """Where a family's decoder block keeps its submodules."""

    attention_norm: str
    attention: str
    mlp_norm: str
    mlp: str = "mlp"


class AttentionHalf(nn.Module):
    """``x + attention(norm(x))``: the first half of a pre-norm decoder block (its self-attention keeps its
    ``layer_idx``, so a token slice's key/value cache still finds it)."""

    def __init__(self, norm: nn.Module, attention: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.attention = attention

    @property
    def cache_target(self) -> nn.Module:
        """The module its keyword arguments reach, so the KV-cache keyword is that module's
        (:func:`~dynabatch.models.hf_compat.cache_kwargs`)."""
        return self.attention

    def forward(self, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
        out = self.attention(self.norm(hidden), **kwargs)[0]  # (B, T, d)
        return out + hidden


class MlpHalf(nn.Module):
    """``x + mlp(norm(x))``: the second half of a pre-norm decoder block (attention arguments are ignored)."""

    def __init__(self, norm: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, **_) -> torch.Tensor:
        return hidden + self.mlp(self.norm(hidden))  # (B, T, d)


def stage_blocks(layout, stage_index: int, block: str = BLOCK) -> list[tuple[int, str]]:
    """``(block index, kind)`` of every ``block`` (``gpt``, ``t5_encoder``) or block half (``gpt_attn`` /
    ``gpt_mlp``, ``t5_enc_attn`` / ``t5_enc_ffn``) that stage ``stage_index`` of ``layout`` holds, in order; a
    stage that begins with the second half holds it of the block whose first half ended the stage before."""
    first, second = BLOCK_HALVES[block]
    index, out = -1, []
    for s, kinds in enumerate(layout.stages):
        for kind in kinds:
            if kind in (block, first):
                index += 1
            elif kind != second:
                continue
            if s == stage_index:
                out.append((index, kind))
    return out


def block_parts(blocks, layout, stage_index: int, names: BlockNames) -> nn.ModuleList:
    """The modules stage ``stage_index`` runs for its blocks: the HF block itself, or the half the stage
    holds (on the block's own submodules, named by ``names``)."""
    parts = []
    for index, kind in stage_blocks(layout, stage_index):
        block = blocks[index]
        if kind == ATTENTION_HALF:
            parts.append(AttentionHalf(getattr(block, names.attention_norm), getattr(block, names.attention)))
        elif kind == MLP_HALF:
            parts.append(MlpHalf(getattr(block, names.mlp_norm), getattr(block, names.mlp)))
        else:
            parts.append(block)
    return nn.ModuleList(parts)


def attention_layer_ids(parts, names: BlockNames) -> list[int]:
    """``layer_idx`` of the self-attention of every part that has one, in order (the slice cache's layers)."""
    out = []
    for part in parts:
        if isinstance(part, MlpHalf):
            continue
        attention = part.attention if isinstance(part, AttentionHalf) else getattr(part, names.attention)
        out.append(attention.layer_idx)
    return out
