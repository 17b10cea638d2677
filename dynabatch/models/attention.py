"""Padding-free attention: every sample of a micro-batch attends only to its own tokens, and pad is never computed.

A micro-batch row holds one sample (padded dynamic micro-batches, ``padding``, ``token_budget``) or several
(``packing``, ``packing_free``, packed rows of the planner), laid out left to right with segment ids 1.. and
0 for pad (:mod:`dynabatch.data.collate`). The dense reference (:mod:`dynabatch.models.forward`) runs
attention over whole rows with a (B, 1, Q, K) additive mask: ``B x Q x K`` score pairs, most of them
masked in a packed row. This module runs it per *segment* instead:

1. :class:`Segments` is built once per stage call from the CPU segment ids: for every sample, its row, the
   start and length of its queries and of its keys. Self-attention: the sample's own span. A token slice
   (TeraPipe): the keys are the chain's earlier tokens (``context``) then the slice, so a sample's key span
   ends where its query span ends and the causal diagonal is aligned bottom-right. T5 cross-attention:
   decoder segment ``k`` against encoder segment ``k`` of the same row.
2. Samples with near-equal ``(query length, key length)`` form one group
   (:func:`dynabatch.cost.pairs.attention_groups`, within ``PAD_TOLERANCE`` = 25% of the group's longest
   and, on CPU, while padding adds at most ``GROUP_WASTE_PAIRS`` score pairs; padded to the group's
   longest under a key mask); :func:`segment_attention` makes one ``scaled_dot_product_attention`` call
   per group (the group's queries, keys and values gathered with
   advanced indexing into ``(n, heads, L, head_dim)``, or plain views for a group of one, or the whole
   tensors when every row is one unpadded sample of the same length), then writes each group's output
   back into a zero ``(B, Q, heads, head_dim)`` tensor: pad outputs are zero, which no loss reads and no
   real query attends.
3. Masks are per group and small: none for bidirectional attention, ``is_causal`` for causal
   self-attention (the flash/efficient kernels apply, CPU and CUDA), an explicit bottom-right ``(Lq, Lk)``
   triangle for slices (on CPU, two flash calls merged instead: :mod:`dynabatch.models.context_attention`), and T5's relative-position bias as the additive mask. The bias depends on
   ``j - i`` only (Toeplitz), so one ``(1, H, L, L)`` bias of the longest segment serves every segment
   through its top-left ``(Lq, Lk)`` window. T5's cross-attention bias is zero (HF builds zeros), so it
   is dropped.

HF layers reach this through ``transformers.AttentionInterface``: :data:`SEGMENT_ATTENTION` is registered
as an attention implementation, a stage built with ``attention="segments"`` sets it on its copy of the
config, and passes a :class:`Segments` where HF passes ``attention_mask``; GPT-2, Llama/Qwen2/Mistral and
T5 layers hand it unchanged to the attention function. Outputs, losses and gradients equal the dense
path's on real tokens (fp32 ``assert_close``, tests/unit/models/test_attention.py); a sample's loss has exactly
zero gradient with respect to another sample's inputs in the same row.

Measured (``scripts/bench_attention.py``): see docs/algorithms/runtime.md, "Padding-free attention".
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from dynabatch.core.attention import ATTENTION_PATHS  # segments (padding-free) or dense (4-D masks, the reference)
from dynabatch.cost.pairs import attention_groups, group_waste_limit
from dynabatch.models import attention_kernels, context_attention
from dynabatch.models.recompute import run_attention_core

SEGMENT_ATTENTION = "dynabatch_segments"
"""The name of the padding-free attention implementation in ``transformers.AttentionInterface``."""

AttentionKind = Literal["bidirectional", "causal", "cross"]


@dataclass(frozen=True)
class SegmentGroup:
    """Samples attended in one SDPA call, each padded to the group's query and key lengths."""

    query_len: int
    """Lq: the longest query span of the group."""
    key_len: int
    """Lk: the longest key span of the group."""
    rows: torch.Tensor
    """(n,) row of each sample."""
    query_starts: torch.Tensor
    """(n,) first query position of each sample in its row."""
    key_starts: torch.Tensor
    """(n,) first key position of each sample in its row (the key tensor's coordinates)."""
    query_lens: torch.Tensor
    """(n,) each sample's own query length (<= Lq)."""
    key_lens: torch.Tensor
    """(n,) each sample's own key length (<= Lk)."""
    first: tuple[int, int, int]
    """``(row, query_start, key_start)`` of the group's first sample (host ints, for a group of one)."""
    uniform: bool
    """Every sample has exactly ``(Lq, Lk)``: no padding inside the group, so no key mask."""
    whole_rows: bool = False
    """Every sample is the only one of its row and starts it (queries and keys): the group is row slices
    ``x[rows, :, :L]``, no gathering, and its padded tail is that row's own pad. Rows in ascending order."""
    all_rows: bool = False
    """``whole_rows`` and the group is every row of the micro-batch: plain views ``x[:, :, :L]``."""
    aligned: bool = True
    """Every sample's queries end where its keys end at the group's offset (``Lk_s - Lq_s == Lk - Lq``):
    always for self-attention; causal attention then needs no key mask (:func:`_group_mask`)."""

    @property
    def size(self) -> int:
        return int(self.rows.shape[0])


@dataclass(frozen=True)
class Segments:
    """Where each sample's queries and keys lie in a micro-batch: passed to HF layers as ``attention_mask``."""

    kind: AttentionKind
    num_rows: int
    query_len: int
    """Q: the query tensor's length (padded row length, or a slice's length)."""
    key_len: int
    """K: the key tensor's length (context + slice for token slices, the encoder row for cross-attention)."""
    groups: tuple[SegmentGroup, ...]
    max_len: int
    """Longest query or key span: the size of the relative-position bias a T5 stage computes."""
    masks: dict = field(default_factory=dict, compare=False, repr=False)
    """Per-group masks built by the first layer and reused by the others (:func:`_cached_mask`), and the
    other kernels' layouts (:mod:`dynabatch.models.attention_kernels`)."""
    spans: tuple = field(default=(), compare=False, repr=False)
    """Host arrays ``(rows, query_starts, query_lens, key_starts, key_lens)``, one entry per sample."""

    @property
    def is_dense_rows(self) -> bool:
        """Every row is one unpadded sample of the whole length: attention needs no mask and no gathering."""
        if len(self.groups) != 1:
            return False
        g = self.groups[0]
        return g.uniform and g.all_rows and g.query_len == self.query_len and g.key_len == self.key_len

    @property
    def num_pairs(self) -> int:
        """Query-key score pairs computed (the dense path computes ``num_rows * query_len * key_len``)."""
        return sum(g.size * g.query_len * g.key_len for g in self.groups)


def _runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of one non-zero segment id in each row of (B, T) ``ids``: rows, starts, lengths, ids."""
    b, t = ids.shape
    change = np.ones((b, t), dtype=bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    rows, starts = np.nonzero(change)  # row-major: runs in row order
    same_row_next = np.append(rows[1:] == rows[:-1], False)
    ends = np.where(same_row_next, np.append(starts[1:], t), t)
    run_ids = ids[rows, starts]
    keep = run_ids > 0
    return rows[keep], starts[keep], (ends - starts)[keep], run_ids[keep]


def _host(ids: torch.Tensor | np.ndarray) -> np.ndarray:
    return ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)


def build_segments(
    kind: AttentionKind,
    query_segment_ids,
    key_segment_ids=None,
    *,
    context_segment_ids=None,
    device: torch.device | str = "cpu",
) -> Segments:
    """The :class:`Segments` of one attention call from (B, Q) query segment ids.

    ``bidirectional`` / ``causal`` self-attention use the query ids as keys, behind ``context_segment_ids``
    (B, C) for a token slice (causal only). ``cross`` needs ``key_segment_ids`` (B, K): query segment ``k``
    attends key segment ``k`` of its row. Ids may be torch tensors (read on the host) or arrays.
    """
    q_ids = _host(query_segment_ids)
    if kind == "cross":
        if key_segment_ids is None:
            raise ValueError("cross-attention segments need the key (encoder) segment ids")
        k_ids = _host(key_segment_ids)
    elif context_segment_ids is not None:
        if kind != "causal":
            raise ValueError(f"a context (token slice) needs causal attention, got {kind!r}")
        k_ids = np.concatenate([_host(context_segment_ids), q_ids], axis=1)
    else:
        k_ids = None
    rows, q_starts, q_lens, seg = _runs(q_ids)
    if k_ids is None:
        k_starts, k_lens = q_starts, q_lens
    else:
        k_rows, k_starts_all, k_lens_all, k_seg = _runs(k_ids)
        width = int(max(q_ids.max(initial=0), k_ids.max(initial=0))) + 1
        k_keys = k_rows * width + k_seg
        order = np.argsort(k_keys, kind="stable")
        pos = np.searchsorted(k_keys[order], rows * width + seg)
        found = (pos < len(order)) & (k_keys[order[np.minimum(pos, len(order) - 1)]] == rows * width + seg)
        if not found.all():
            i = int(np.flatnonzero(~found)[0])
            raise ValueError(f"segment {seg[i]} of row {rows[i]} has queries but no keys")
        match = order[pos]
        k_starts, k_lens = k_starts_all[match], k_lens_all[match]
        if kind == "causal":  # a slice's sample: its keys end where its queries end (bottom-right alignment)
            context = k_ids.shape[1] - q_ids.shape[1]
            if not np.array_equal(k_starts + k_lens, q_starts + q_lens + context):
                raise ValueError("a token slice's segments must continue its context's segments")
    return _grouped(kind, q_ids.shape[0], q_ids.shape[1], q_ids.shape[1] if k_ids is None else k_ids.shape[1],
                    rows, q_starts, q_lens, k_starts, k_lens, device)


def _grouped(kind, num_rows, query_len, key_len, rows, q_starts, q_lens, k_starts, k_lens, device) -> Segments:
    """:class:`SegmentGroup` s by :func:`dynabatch.cost.pairs.attention_groups` (the cost model counts the same
    calls, but for the device's padding bound): near-equal lengths share a call; a sample alone in its row
    (and starting it) is a row slice."""
    alone = (np.bincount(rows, minlength=num_rows)[rows] == 1) & (q_starts == 0) & (k_starts == 0)
    groups = []
    for m, whole in attention_groups(q_lens, k_lens, alone, group_waste_limit(torch.device(device).type)):
        if whole:
            m = m[np.argsort(rows[m], kind="stable")]

        def index(a):
            return torch.from_numpy(np.ascontiguousarray(a[m])).to(device)

        uniform = bool((q_lens[m] == q_lens[m[0]]).all() and (k_lens[m] == k_lens[m[0]]).all())
        first = int(m[0])
        groups.append(SegmentGroup(int(q_lens[m].max()), int(k_lens[m].max()), index(rows), index(q_starts),
                                   index(k_starts), index(q_lens), index(k_lens),
                                   (int(rows[first]), int(q_starts[first]), int(k_starts[first])), uniform,
                                   whole_rows=whole, all_rows=whole and len(m) == num_rows,
                                   aligned=bool(((k_lens[m] - q_lens[m]) == k_lens[m].max() - q_lens[m].max()).all())))
    max_len = int(max(q_lens.max(initial=0), k_lens.max(initial=0)))
    return Segments(kind, num_rows, query_len, key_len, tuple(groups), max_len,
                    spans=(rows, q_starts, q_lens, k_starts, k_lens))


def _take(x: torch.Tensor, g: SegmentGroup, starts: torch.Tensor, length: int, first_start: int) -> torch.Tensor:
    """(B, H, T, Dh) -> the group's (n, H, length, Dh): row slices, a view for one sample, a gather otherwise."""
    if g.whole_rows:
        return (x if g.all_rows else x.index_select(0, g.rows))[:, :, :length]
    if g.size == 1:
        row = g.first[0]
        return x[row : row + 1, :, first_start : first_start + length]
    positions = (starts[:, None] + torch.arange(length, device=starts.device)).clamp(max=x.shape[2] - 1)  # (n, length)
    return x[g.rows[:, None], :, positions].transpose(1, 2)  # (n, length, H, Dh) -> (n, H, length, Dh)


def _group_mask(kind: AttentionKind, g: SegmentGroup, bias: torch.Tensor | None, dtype: torch.dtype):
    """``(attn_mask, is_causal)`` for one group (module docstring, point 3).

    Causal attention of an ``aligned`` group needs no key mask even when it is padded: a real query ``i``
    of a sample sees keys ``j <= i + Lk - Lq``, all inside its own span (padding, or the next sample of a
    packed row, lies beyond), so self-attention is plain ``is_causal`` (flash kernels apply) and a slice
    one shared bottom-right triangle. Otherwise sample ``s`` of a padded group may see keys ``j < Lk_s``
    (and causally ``j <= i + Lk_s - Lq_s``): a per-sample key mask.
    """
    lq, lk = g.query_len, g.key_len
    window = None if bias is None or kind == "cross" else bias[:, :, :lq, :lk]  # (1, H, lq, lk), Toeplitz
    device = g.rows.device
    if kind == "causal" and g.aligned:
        if window is None and lq == lk:
            return None, True
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)  # (lq, lk), bottom-right
    elif g.uniform:
        return window, False
    else:
        keys = torch.arange(lk, device=device)
        allowed = (keys < g.key_lens[:, None])[:, None, None, :]  # (n, 1, 1, lk)
        if kind == "causal":
            offset = (g.key_lens - g.query_lens)[:, None, None, None]  # (n, 1, 1, 1)
            allowed = allowed & (keys[None, None, None, :] <= torch.arange(lq, device=device)[:, None] + offset)
    if window is None:
        return allowed, False
    # Additive, not ``torch.where``: an add saves no tensor for backward, so building the mask inside a
    # checkpointed block (the first layer builds it, the recomputation finds it cached) saves the same
    # tensors in the forward and its recomputation (:mod:`dynabatch.models.recompute`).
    blocked = torch.zeros(allowed.shape, dtype=window.dtype, device=device)
    blocked.masked_fill_(~allowed, torch.finfo(dtype).min)
    return window + blocked, False


def _cached_mask(segments: "Segments", index: int, bias: torch.Tensor | None, dtype: torch.dtype):
    """:func:`_group_mask`, built once per stage call and shared by the stage's layers (same bias tensor)."""
    key = (index, None if bias is None else id(bias), dtype)
    if key not in segments.masks:
        segments.masks[key] = _group_mask(segments.kind, segments.groups[index], bias, dtype)
    return segments.masks[key]


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of (B, H, Q, Dh) queries over (B, Hk, K, Dh) keys/values within each sample's span.

    ``bias``: T5's (1, H, L, L) relative-position bias for self-attention, ``L >= segments.max_len``.
    Grouped-query attention (``Hk < H``) is handled by the kernel. Returns (B, Q, H, Dh), zero at pad
    queries. The kernel (per-group SDPA below, FlashAttention varlen or flex) is chosen per call by
    :func:`dynabatch.models.attention_kernels.choose`.
    """
    kernel = attention_kernels.choose(query, segments, bias, dropout_p)
    if kernel.run is not None and (out := attention_kernels.run(kernel, query, key, value, segments, scale, bias)) is not None:
        return out
    gqa = query.shape[1] != key.shape[1]
    if segments.is_dense_rows:  # every row one unpadded sample: no mask, no copies
        out = _sdpa(query, key, value, segments, 0, bias, scale, dropout_p, gqa)
        return out.transpose(1, 2)  # (B, Q, H, Dh)
    b, h, q_len, head_dim = query.shape
    out = None  # (B, Q, H, Dh) in SDPA's output dtype: under autocast it may differ from the queries' (Llama's
    # rotary embedding leaves them fp32 while SDPA computes in half precision)
    for index, g in enumerate(segments.groups):
        _, qs, ks = g.first
        q = _take(query, g, g.query_starts, g.query_len, qs)
        k = _take(key, g, g.key_starts, g.key_len, ks)
        v = _take(value, g, g.key_starts, g.key_len, ks)
        o = _sdpa(q, k, v, segments, index, bias, scale, dropout_p, gqa).transpose(1, 2)  # (n, lq, H, Dh)
        if out is None:
            out = o.new_zeros(b, q_len, h, head_dim)
        _put(out, o, g)
    return out if out is not None else query.new_zeros(b, q_len, h, head_dim)


def _sdpa(q, k, v, segments: Segments, index: int, bias, scale, dropout_p, gqa) -> torch.Tensor:
    """One group's (n, H, Lq, Dh) attention: a token slice's aligned group (keys ``Lk - Lq`` of context, then
    the slice's own) as two flash calls merged (:mod:`dynabatch.models.context_attention`) where that
    applies, else SDPA with the group's mask (:func:`_group_mask`)."""
    g = segments.groups[index]
    context = g.key_len - g.query_len if segments.kind == "causal" and g.aligned else 0
    if context_attention.applies(q, k, context, bias, dropout_p):
        return context_attention.context_causal_attention(q, k, v, context, scale)
    mask, causal = _cached_mask(segments, index, bias, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p,
                                          scale=scale, enable_gqa=gqa)


def _put(out: torch.Tensor, o: torch.Tensor, g: SegmentGroup) -> None:
    """Write a group's (n, Lq, H, Dh) output into (B, Q, H, Dh) ``out`` at its samples' query positions."""
    lq = g.query_len
    if g.whole_rows:  # the padded tail is the row's own pad
        if g.all_rows:
            out[:, :lq] = o
        else:
            out[g.rows, :lq] = o
    elif g.size == 1:
        row, qs, _ = g.first
        out[row, qs : qs + lq] = o[0]
    elif g.uniform:
        out[g.rows[:, None], g.query_starts[:, None] + torch.arange(lq, device=out.device)] = o
    else:  # padded group of samples sharing rows: write each sample's own queries only
        steps = torch.arange(lq, device=out.device)
        real = steps < g.query_lens[:, None]  # (n, lq)
        rows = g.rows[:, None].expand(-1, lq)
        out[rows[real], (g.query_starts[:, None] + steps)[real]] = o[real]


def segment_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                              position_bias=None, **kwargs):
    """The ``transformers.AttentionInterface`` entry (HF's signature).

    A :class:`Segments` ``attention_mask`` runs :func:`segment_attention`; T5's ``position_bias`` is used for
    self-attention and ignored for cross-attention, where HF's is all zeros. Anything else (a 4-D tensor,
    ``None`` during generation) goes to the implementation the config had before
    :func:`use_segment_attention` switched it, so a switched model still runs every HF code path.
    """
    if not isinstance(attention_mask, Segments):
        extra = {} if position_bias is None else {"position_bias": position_bias}
        return run_attention_core(_dense_attention(module), module, query, key, value, attention_mask,
                                  scaling=scaling, dropout=dropout, **extra, **kwargs)
    bias = position_bias if attention_mask.kind != "cross" else None
    out = run_attention_core(segment_attention, query, key, value, attention_mask, scale=scaling, dropout_p=dropout,
                             bias=bias)
    return out, None


_DENSE_IMPLEMENTATION: dict[int, str] = {}
"""id(config) -> the attention implementation it had before it was switched (kept while the config lives)."""


def _dense_attention(module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = _DENSE_IMPLEMENTATION.get(id(module.config), "sdpa")
    eager = sys.modules[type(module).__module__].eager_attention_forward  # each HF modeling file defines one
    return eager if name == "eager" else ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)


def _dense_mask(*args, config=None, **kwargs):
    """The ``transformers.AttentionMaskInterface`` entry: the mask the implementation the config had before
    :func:`use_segment_attention` would get (sdpa's boolean mask, eager's additive one), since
    :func:`segment_attention_forward` hands every mask but :class:`Segments` to that implementation. Without an entry
    HF builds no mask at all for an unknown implementation, so a switched model called the Hugging Face way
    (``model(input_ids, attention_mask=...)``, ``generate`` on a padded batch) attended to padding."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = _DENSE_IMPLEMENTATION.get(id(config), "sdpa") if config is not None else "sdpa"
    make = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name)
    return None if make is None else make(*args, config=config, **kwargs)  # None: as HF does for a maskless one


def register() -> None:
    """Register :data:`SEGMENT_ATTENTION` with ``transformers.AttentionInterface``, and its dense masks with
    ``AttentionMaskInterface`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SEGMENT_ATTENTION, segment_attention_forward)
    AttentionMaskInterface.register(SEGMENT_ATTENTION, _dense_mask)


def use_segment_attention(module: torch.nn.Module) -> None:
    """Point every HF config inside ``module`` at :data:`SEGMENT_ATTENTION` (dense masks still work: they are
    handed to the previous implementation, see :func:`segment_attention_forward`)."""
    register()
    configs = {id(c): c for sub in module.modules() if (c := getattr(sub, "config", None)) is not None}
    for key, config in configs.items():
        current = getattr(config, "_attn_implementation", None)
        if current != SEGMENT_ATTENTION:
            _DENSE_IMPLEMENTATION[key] = current or "eager"
            weakref.finalize(config, _DENSE_IMPLEMENTATION.pop, key, None)
            config._attn_implementation = SEGMENT_ATTENTION


def check_attention_path(path: str) -> str:
    if path not in ATTENTION_PATHS:
        raise ValueError(f"unknown attention path {path!r}; valid: {', '.join(ATTENTION_PATHS)}")
    return path
