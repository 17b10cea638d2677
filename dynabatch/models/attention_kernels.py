"""Which kernel runs a padding-free attention call: per-segment SDPA, FlashAttention varlen or FlexAttention.

:func:`dynabatch.models.attention.segment_attention` computes every sample's attention over its own span
only. Three kernels can do that, each from the same :class:`~dynabatch.models.attention.Segments` layout:

``sdpa``
    One ``scaled_dot_product_attention`` call per group of near-equal samples (the layout's groups), masks
    per group. Runs everywhere, trains everywhere; the only training-capable path on CPU (torch 2.13: flex
    has no CPU backward, varlen is CUDA-only). The reference the others are tested against.
``varlen``
    ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 varlen): the real tokens of every sample
    packed into one ``(tokens, heads, head_dim)`` tensor with ``cu_seqlens``; one call per layer, no pad,
    no Python loop over groups. Causal attention is ``window_size=(-1, 0)``, which FlashAttention aligns
    bottom-right when a sample has more keys than queries (a token slice against its context). Needs CUDA,
    fp16/bf16 inputs (autocast), no additive bias (so not T5 self-attention) and no attention dropout.
``flex``
    ``torch.nn.attention.flex_attention`` over the padded ``(B, H, Q, Dh)`` tensors with a *document*
    ``BlockMask`` (query and key in the same sample; causal bottom-right) built once per stage call, so
    blocks across samples or on pad are skipped. T5's relative-position bias enters as a ``score_mod``
    reading the Toeplitz bias's ``2L - 1`` distinct offsets (gradients flow into the bias). Trains on CUDA
    (compiled); on CPU it runs forward only (inference, and the tests that compare it with ``sdpa``).
    No attention dropout.

``auto`` (the default, ``--attention-kernel``) picks, per call: on CUDA ``varlen`` when it applies, else
``flex``, else ``sdpa``; on CPU ``sdpa``. A layout that is already dense (every row one unpadded sample)
always takes ``sdpa``: plain SDPA then hits the flash kernel itself. An explicit choice that cannot serve a
call (e.g. ``varlen`` with T5's bias) falls back to ``sdpa`` for that call; under ``auto`` a kernel that
raises (a compile or driver problem) is logged once and replaced by ``sdpa`` for the rest of the run. :data:`KERNEL_CALLS` counts the
calls each kernel served, and the trainer writes the per-step counts to ``metrics.jsonl``
(``attention_kernels``), so a run's metrics say which path ran.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from dynabatch.core.attention import ATTENTION_KERNELS

if TYPE_CHECKING:
    from dynabatch.models.attention import Segments

logger = logging.getLogger(__name__)

KERNEL_CALLS: Counter = Counter()
"""Attention calls served per kernel name in this process (the trainer logs per-step differences)."""

_preference = "auto"


@dataclass(frozen=True)
class SegmentKernel:
    """One way to run padding-free attention. ``unfit`` says why it cannot serve a call (``None``: it can)."""

    name: str
    unfit: Callable[..., "str | None"]
    run: Callable[..., torch.Tensor] | None
    """``run(query, key, value, segments, scale, bias) -> (B, Q, H, Dh)``; ``None`` for ``sdpa``, which
    :mod:`dynabatch.models.attention` runs itself."""


def _varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _varlen_unfit(query, segments, bias, dropout_p) -> str | None:
    if not query.is_cuda:
        return "varlen_attn is CUDA-only"
    if not _varlen_available():
        return "this torch has no torch.nn.attention.varlen"
    if bias is not None:
        return "varlen_attn takes no additive bias (T5 self-attention)"
    if dropout_p:
        return "varlen_attn has no attention dropout"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return "FlashAttention needs fp16/bf16 inputs (--dtype bf16 or fp16)"
    if query.shape[-1] % 8 or query.shape[-1] > 256:
        return "FlashAttention needs a head dimension that is a multiple of 8, at most 256"
    return None


def _flex_unfit(query, segments, bias, dropout_p) -> str | None:
    if not _flex_available():
        return "this torch has no flex_attention"
    if dropout_p:
        return "flex_attention has no attention dropout"
    if not query.is_cuda and torch.is_grad_enabled() and query.requires_grad:
        return "flex_attention has no backward on CPU"
    return None


def _sdpa_unfit(query, segments, bias, dropout_p) -> str | None:
    return None


def _packed_layout(segments: "Segments", device) -> dict:
    """Token indices and ``cu_seqlens`` of every sample's queries and keys, in the flattened (B*Q) / (B*K) rows."""
    key = ("varlen", str(device))
    if key not in segments.masks:
        rows, q_starts, q_lens, k_starts, k_lens = segments.spans

        def flat(starts, lens, width):
            total = int(lens.sum())
            first = np.repeat(rows * width + starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
            return torch.from_numpy(first + np.arange(total)).to(device)

        def cu(lens):
            return torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)).to(device)

        segments.masks[key] = dict(q_index=flat(q_starts, q_lens, segments.query_len),
                                   k_index=flat(k_starts, k_lens, segments.key_len),
                                   cu_q=cu(q_lens), cu_k=cu(k_lens), max_q=int(q_lens.max()), max_k=int(k_lens.max()))
    return segments.masks[key]


def _varlen_options(causal: bool) -> tuple[dict, bool]:
    """``varlen_attn``'s causal keyword for the installed torch, and whether it takes ``enable_gqa``: 2.12+
    takes ``window_size`` (causal = ``(-1, 0)``, aligned bottom-right as FlashAttention aligns it, so a token
    slice's queries see their whole context) and ``enable_gqa``; 2.10-2.11 take ``is_causal`` (the same
    alignment) and no GQA flag (the caller then repeats key/value heads)."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        options = {"window_size": (-1, 0) if causal else (-1, -1)}
    else:
        options = {"is_causal": causal}
    return options, "enable_gqa" in params


def _run_varlen(query, key, value, segments, scale, bias) -> torch.Tensor:
    """Every sample's real tokens packed, one FlashAttention varlen call, outputs scattered back (zero on pad)."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, q_len, head_dim = query.shape
    layout = _packed_layout(segments, query.device)

    def pack(x, index):  # (B, H, T, Dh) -> (tokens, H, Dh)
        return x.transpose(1, 2).reshape(-1, x.shape[1], head_dim).index_select(0, index)

    q, k, v = pack(query, layout["q_index"]), pack(key, layout["k_index"]), pack(value, layout["k_index"])
    options, takes_gqa = _varlen_options(segments.kind == "causal")
    groups = h // key.shape[1]
    if groups > 1 and takes_gqa:
        options["enable_gqa"] = True
    elif groups > 1:  # an older torch: one key/value head per query head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    o = varlen_attn(q, k, v, layout["cu_q"], layout["cu_k"], layout["max_q"], layout["max_k"], scale=scale,
                    **options)  # (tokens, H, Dh)
    out = o.new_zeros(b * q_len, h, head_dim).index_copy(0, layout["q_index"], o)
    return out.view(b, q_len, h, head_dim)


def _document_ids(segments: "Segments", device) -> dict:
    """Per-position sample ids (-1 on pad) and in-sample positions, queries in key coordinates."""
    key = ("flex", str(device))
    if key not in segments.masks:
        rows, q_starts, q_lens, k_starts, k_lens = segments.spans
        b = segments.num_rows

        def fill(width, starts, lens, shift):
            doc = np.full((b, width), -1, dtype=np.int64)
            pos = np.zeros((b, width), dtype=np.int64)
            for s, (r, start, n) in enumerate(zip(rows, starts, lens)):
                doc[r, start:start + n] = s
                pos[r, start:start + n] = np.arange(n) + shift[s]
            return torch.from_numpy(doc).to(device), torch.from_numpy(pos).to(device)

        q_doc, q_pos = fill(segments.query_len, q_starts, q_lens, k_lens - q_lens)  # bottom-right alignment
        k_doc, k_pos = fill(segments.key_len, k_starts, k_lens, np.zeros_like(k_lens))
        segments.masks[key] = dict(q_doc=q_doc, q_pos=q_pos, k_doc=k_doc, k_pos=k_pos, block_mask=None)
    return segments.masks[key]


def toeplitz_offsets(bias: torch.Tensor) -> torch.Tensor:
    """(1, H, L, L) bias that depends on ``j - i`` only -> (H, 2L - 1), offset ``d`` at ``d + L - 1``."""
    return torch.cat([bias[0, :, 1:, 0].flip(-1), bias[0, :, 0, :]], dim=-1)


_COMPILED_FLEX = None


def _flex_fn(device):
    """flex_attention, compiled on CUDA (eager materialises every score; fine for CPU forward checks)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        import torch._dynamo

        # every micro-batch shape and score_mod (T5's bias or none) may cost a recompile; dynamo's default
        # limit of 8 then falls back to eager flex, which materialises every score
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX


def _run_flex(query, key, value, segments, scale, bias) -> torch.Tensor:
    """flex_attention with a document BlockMask (and T5's bias as a score_mod) over the padded tensors."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = _document_ids(segments, query.device)
    q_doc, q_pos, k_doc, k_pos = ids["q_doc"], ids["q_pos"], ids["k_doc"], ids["k_pos"]
    causal = segments.kind == "causal"
    if ids["block_mask"] is None:
        def same_sample(b, h, q, k):
            allowed = (q_doc[b, q] == k_doc[b, k]) & (q_doc[b, q] >= 0)
            return allowed & (k_pos[b, k] <= q_pos[b, q]) if causal else allowed

        ids["block_mask"] = create_block_mask(same_sample, segments.num_rows, None, segments.query_len,
                                              segments.key_len, device=query.device)
        # eager: a compiled create_block_mask specialises on the id tensors' sizes and recompiles for every
        # micro-batch shape (seen on the H200: dynamo's recompile limit after 8 shapes)
    score_mod = None
    if bias is not None and segments.kind != "cross":
        offsets = toeplitz_offsets(bias)  # (H, 2L - 1)
        middle = bias.shape[-1] - 1

        def score_mod(score, b, h, q, k):
            return score + offsets[h, k_pos[b, k] - q_pos[b, q] + middle].to(score.dtype)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = _flex_fn(query.device)(query, key, value, score_mod=score_mod, block_mask=ids["block_mask"],
                                     scale=scale, enable_gqa=query.shape[1] != key.shape[1])  # (B, H, Q, Dh)
    real = (q_doc >= 0)[:, None, :, None]  # pad queries (all keys masked) give zeros, as the other kernels do
    return torch.where(real, out, out.new_zeros(())).transpose(1, 2)  # (B, Q, H, Dh)


KERNELS: dict[str, SegmentKernel] = {k.name: k for k in (
    SegmentKernel("sdpa", _sdpa_unfit, None),
    SegmentKernel("varlen", _varlen_unfit, _run_varlen),
    SegmentKernel("flex", _flex_unfit, _run_flex),
)}
"""The padding-free attention kernels by name (module docstring). ``--attention-kernel`` offers ``auto`` and
these: the names are :data:`dynabatch.core.attention.ATTENTION_KERNELS` (torch-free, for the flags), checked here."""
if ("auto", *KERNELS) != ATTENTION_KERNELS:
    raise ImportError(f"dynabatch.core.attention.ATTENTION_KERNELS {ATTENTION_KERNELS} does not list auto + {tuple(KERNELS)}")

AUTO_ORDER = ("varlen", "flex")
"""What ``auto`` tries on CUDA before ``sdpa``."""


def use_attention_kernel(name: str) -> None:
    """Set this process's kernel preference (``auto`` or a :data:`KERNELS` name)."""
    global _preference
    if name != "auto" and name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; valid: auto, {', '.join(KERNELS)}")
    _preference = name


def attention_kernel() -> str:
    """This process's kernel preference."""
    return _preference


def kernel_problem(name: str, device: torch.device | str, dtype: str = "fp32") -> str | None:
    """Why ``--attention-kernel name`` cannot train on ``device`` at ``dtype`` (``None``: it can), for a
    one-line error at start rather than a silent fallback on every call."""
    device = torch.device(device)
    if name in ("auto", "sdpa"):
        return None
    if name == "varlen":
        if device.type != "cuda":
            return "--attention-kernel varlen needs CUDA (torch's varlen_attn is CUDA-only); use auto or sdpa"
        if not _varlen_available():
            return "--attention-kernel varlen: this torch has no torch.nn.attention.varlen; use auto or flex"
        if dtype == "fp32":
            return "--attention-kernel varlen needs --dtype bf16 or fp16 (FlashAttention has no fp32)"
        return None
    if not _flex_available():
        return "--attention-kernel flex: this torch has no flex_attention; use auto or sdpa"
    if device.type != "cuda":
        return "--attention-kernel flex cannot train on CPU (flex_attention has no CPU backward); use auto or sdpa"
    return None


def choose(query: torch.Tensor, segments: "Segments", bias, dropout_p: float) -> SegmentKernel:
    """The kernel that serves this call (module docstring) and count it."""
    chosen = KERNELS["sdpa"]
    if not segments.is_dense_rows:
        names = (AUTO_ORDER if query.is_cuda else ()) if _preference == "auto" else (_preference,)
        for name in names:
            if name not in _BROKEN and KERNELS[name].unfit(query, segments, bias, dropout_p) is None:
                chosen = KERNELS[name]
                break
    KERNEL_CALLS[chosen.name] += 1
    return chosen


_BROKEN: dict[str, str] = {}
"""Kernels that raised under ``auto`` in this process, with the error: ``auto`` no longer tries them."""


try:  # checkpoint's control flow: ends a recomputation from inside the last op that saves a tensor
    from torch.utils.checkpoint import _StopRecomputationError as _NOT_A_FAILURE
except ImportError:  # a torch without early stop
    _NOT_A_FAILURE = ()


def run(kernel: SegmentKernel, query, key, value, segments: "Segments", scale, bias) -> torch.Tensor | None:
    """``kernel.run(...)``; under ``auto`` a kernel that raises (a compile or driver problem on a device no test
    ran on) is logged once and dropped for the process, and ``None`` tells the caller to run ``sdpa``.
    An explicit ``--attention-kernel`` raises. Checkpoint's early stop of a recomputation passes through."""
    try:
        return kernel.run(query, key, value, segments, scale, bias)
    except _NOT_A_FAILURE:
        raise
    except Exception as error:  # noqa: BLE001 (any kernel failure; re-raised unless auto)
        if _preference != "auto":
            raise
        _BROKEN[kernel.name] = f"{type(error).__name__}: {error}"
        KERNEL_CALLS[kernel.name] -= 1
        KERNEL_CALLS["sdpa"] += 1
        logger.warning(f"attention kernel {kernel.name} failed ({_BROKEN[kernel.name][:300]}); --attention-kernel auto "
                       "uses sdpa instead for the rest of the run")
        return None


def calls_since(before: Counter) -> dict[str, int]:
    """Calls per kernel since the snapshot ``before`` (``Counter(KERNEL_CALLS)`` taken earlier)."""
    return {name: n - before.get(name, 0) for name, n in sorted(KERNEL_CALLS.items()) if n - before.get(name, 0)}
