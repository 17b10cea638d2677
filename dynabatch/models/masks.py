"""Segment masks and token losses: the low-level pieces every stage and the whole-model forward share.

Masks are 4-D *additive floats* built from segment ids (1.. per sample, 0 = pad), shape (B, 1, Q, K): 0 where a
query may attend a key, ``finfo(dtype).min`` where it may not (:mod:`dynabatch.models.forward` explains the rules
and why floats). Token losses are per-token fp32 cross-entropies. Nothing here imports another part of
``models``, so the stage modules (:mod:`~dynabatch.models.stage`, the families) and
:mod:`~dynabatch.models.forward` (which builds whole-model stages from them) all import it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dynabatch.data.microbatch import IGNORE_INDEX


# ----------------------------------------------------------------------------------------------
# Masks
# ----------------------------------------------------------------------------------------------


def _same_segment(query_segment_ids: torch.Tensor, key_segment_ids: torch.Tensor) -> torch.Tensor:
    """Bool (B, Q, K): real query ``q`` may see key ``k`` of the same segment; pad queries see all keys."""
    q = query_segment_ids[:, :, None]  # (B, Q, 1)
    k = key_segment_ids[:, None, :]  # (B, 1, K)
    return ((q == k) & (q > 0)) | (q == 0)


def _to_additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (B, Q, K) -> additive float (B, 1, Q, K): 0 where allowed, ``finfo(dtype).min`` elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, blocked)[:, None, :, :]


def bidirectional_segment_mask(segment_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block-diagonal bidirectional mask (T5 encoder) from (B, T) segment ids; returns (B, 1, T, T)."""
    return _to_additive(_same_segment(segment_ids, segment_ids), dtype)


def causal_segment_mask(
    segment_ids: torch.Tensor, dtype: torch.dtype = torch.float32, context_segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Block-diagonal causal mask (GPT-2, T5 decoder self-attention); (B, T) -> (B, 1, T, C + T).

    Segments are contiguous in a row, so "earlier in the row and same segment" is "earlier in the
    same sample". Pad queries keep their full (non-causal) row so that no row is empty.
    ``context_segment_ids`` (B, C): a token slice's queries also see the ``C`` earlier tokens of their
    rows (keys are context then slice; the causal diagonal is aligned bottom-right, so query ``i``
    sees keys ``<= C + i``).
    """
    keys = segment_ids if context_segment_ids is None else torch.cat([context_segment_ids, segment_ids], dim=1)
    t, c = segment_ids.shape[1], keys.shape[1] - segment_ids.shape[1]
    earlier = torch.ones(t, c + t, dtype=torch.bool, device=segment_ids.device).tril(diagonal=c)  # (T, C + T)
    allowed = _same_segment(segment_ids, keys) & (earlier | (segment_ids == 0)[:, :, None])
    return _to_additive(allowed, dtype)


def cross_segment_mask(
    query_segment_ids: torch.Tensor, key_segment_ids: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Cross-attention confined to the same sample: decoder (B, D) x encoder (B, E) -> (B, 1, D, E).

    Every decoder segment k must have encoder tokens with segment k (collate guarantees it);
    otherwise that query's row is fully masked and its output is meaningless (finite, not NaN).
    """
    return _to_additive(_same_segment(query_segment_ids, key_segment_ids), dtype)


def _token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 cross-entropy: logits (B, T, V), targets (B, T) -> (B, T), 0 where ignored."""
    b, t, v = logits.shape
    losses = F.cross_entropy(
        logits.float().reshape(b * t, v), targets.reshape(b * t), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return losses.view(b, t)  # (B, T)
