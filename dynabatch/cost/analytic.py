"""Analytic per-layer cost model: time, memory and traffic of a micro-batch on hardware you do not have.

For a micro-batch of ``b`` samples padded to encoder length ``E`` (GPT: sequence length) and decoder
length ``D`` (T5), each layer kind (see :mod:`dynabatch.cost.model_specs`) is written out as the list of
kernels it runs in the forward pass, each with FLOPs and bytes of memory traffic:

* GEMMs ``(m, k) @ (k, n)``: ``2 m n k`` FLOPs, ``p (mk + kn + mn)`` bytes (``p`` = dtype bytes).
  One block's GEMMs are QKV/out projections ``2 bT d a`` each per output width (K and V
  ``2 bT d a_kv`` under grouped-query attention, ``a_kv = kv_heads d_kv``), FFN ``2 bT d f`` per
  matrix (3 matrices when gated); the attention core adds ``QK^T`` and ``AV`` at ``2 b h Tq Tk d_kv``
  each (self-attention ``Tq = Tk = T``, T5 cross-attention ``Tq = D, Tk = E``). With ``a = d, f = 4d``
  a GPT block is ``24 bTd^2 + 4 bT^2 d`` forward FLOPs (Narayanan et al. 2021). Causal masks are not
  exploited (dense kernels compute the full square).
* Memory-bound kernels (norms, softmax, dropout, residual adds, activation, loss): bytes only.

A kernel takes ``max(flops / (peak * eff), bytes / (bandwidth * mem_eff)) + launch`` (a roofline per
kernel; kernels of one stream run one after another, so the layer time is their sum). ``eff`` is the
hardware's matmul or attention efficiency. The backward pass costs 2x the forward per kernel (input and
weight gradients are one GEMM each of the forward's size; elementwise backward reads the saved input and
the incoming gradient and writes one gradient), 2.5x for a fused (flash) attention kernel, which recomputes
the scores. With full activation recomputation a block's forward runs again in backward.

Activations stored for backward follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", Eq. 1 with t = 1): ``s b h (34 + 5 a s / h)`` bytes per GPT layer with
16-bit activations and 1-byte dropout masks. Term by term, generalised to ``p`` bytes, attention width
``a = h d_kv`` (here ``h`` = heads), FFN width ``f``, query length ``Tq`` and key length ``Tk``:

* each norm: its input ``p bT d`` (RMSNorm, T5 and Llama: also its fp32 normalised input ``4 bT d``, which HF's
  norms keep for the weight's gradient, :data:`~dynabatch.cost.stored_bytes.RMS_NORM_EXTRA_BYTES`);
* attention: projection input ``p bTq d``; Q, K, V ``p b (Tq + 2 Tk) a``; softmax output ``p b h Tq Tk``,
  dropout mask ``b h Tq Tk`` and dropout output ``p b h Tq Tk``; out-projection input ``p bTq a``; output
  dropout mask ``bTq d``. Fused attention replaces the ``Tq Tk`` terms by the fp32 log-sum-exp ``4 b h Tq``;
* FFN: input ``p bT d``, activation input and output ``2 p bT f`` (gated: ``3 p bT f``), dropout mask ``bT d``.

Under autocast (fp32 weights, ``cast_copy_bytes > 0``; ``p`` is the autocast dtype's) the residual stream stays
fp32, so each norm's input is 4 bytes an element, each projection saves its own half-precision cast of an fp32
input (three for separate Q, K, V; one for GPT-2's fused ``c_attn``; two for a gated FFN; a T5 cross-attention's
K and V each cast the encoder output), T5's unfused attention runs in fp32 (its fp32 bias promotes it) and HF's
T5 FFN keeps one more FFN-wide cast (:class:`~dynabatch.cost.stored_bytes.StoredBytes`; measured on CPU).

A T5 decoder layer adds a norm and a cross-attention (``Tq = D, Tk = E``, per-layer K and V of the
encoder output). The encoder output itself is one tensor shared by every decoder layer, so
:meth:`AnalyticCostModel.stage_cost` counts ``p b E d`` once per stage holding decoder layers. The loss
keeps HF's fp32 log-probabilities (``4 bT V``). Peak extra bytes are the transient buffers of the layer's
backward: incoming and outgoing hidden-state gradients plus the larger of the FFN's gradient buffers and
the attention-score gradients (eager attention: ``2 p b h Tq Tk``). The LM head's are the larger of its
forward's logits and their fp32 copy (``(p + 4) bT V``) and its backward's two fp32 logit gradients (the
log-probabilities' and the logits', ``8 bT V`` whatever ``p``): under bf16 autocast the backward is the
peak (measured on CPU with the allocator's events: 12 bytes per logit above the hidden states in fp32 and
in bf16; ``tests/unit/cost/test_analytic.py``).

Per-segment (padding-free) attention: ``pairs=`` (:class:`~dynabatch.cost.pairs.AttentionPairs`) gives the
score pairs each attention kind computes, summed over rows and over the samples packed in a row (``sum
L_q L_k``, at most the dense ``b Tq Tk``). The attention core then costs ``2 h P d_kv`` FLOPs per GEMM
(``P`` pairs; Q, K and V are still read per padded token), the softmax/dropout traffic, the stored
softmax output and dropout mask (non-flash) and the score-gradient transient are ``h P`` elements, and a
T5 stage's mask elements are the pairs; projections, FFNs, norms and the position bias keep the padded
shape. With ``pairs.calls`` the core's kernels are launched once per call. ``pairs=None`` is the dense
count, computed exactly as before (same floating-point expressions).

Per-stage context of T5 (``context_costs``, on by default). Every T5 stage builds, once per micro-batch,
what its blocks share: the additive segment masks (encoder ``b E^2``, decoder ``b (D^2 + D E)`` elements:
compare, select, write) and each stack's relative position bias ``(1, h, T, T)``. The stages bucket the
``2T - 1`` distinct offsets only and window the result (``t5_stages.relative_position_bias``), so the bias
costs one ``h T^2`` copy forward and a window sum backward; HF's own bucketing of the full ``T^2`` grid and
its scatter of ``h T^2`` gradients cost about 2.5x more (0.68 s against 0.27 s per 2048-token stack on one
CPU core, 4 heads, measured). The bias does not depend on ``b``: a micro-batch of one 2048-token sample
pays it like one of eight, which the per-layer terms miss and which makes many small long micro-batches
dearer than they look. Written as memory traffic: ``MASK_BYTES`` per mask element and
``BIAS_BYTES_PER_PAIR + 4 h p`` per query-key pair of the bias, backward ``BIAS_BWD_FACTOR`` x forward
(masks have no backward), calibrated on the ``cpu`` preset to the measured mask and bias costs. (GPT's
causal mask, ``b T^2`` elements, costs a few % of its attention and is left out.)

Between stages, a stage whose last layer is a GPT block or a T5 encoder layer sends the hidden states
``p b E d``; one ending in the T5 decoder sends the decoder hidden states and the encoder output,
``p b (D + E) d``. The gradient sent back has the same size. A message takes ``latency + bytes /
(bandwidth * link_eff)``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Sequence, Union

import numpy as np

from dynabatch.core.dtypes import DTYPE_BYTES, autocasts
from dynabatch.core.sequence import is_seq2seq
from dynabatch.cost.hardware import HardwareSpec, device_hardware, hardware_spec
from dynabatch.cost.model_specs import (
    tied_copy_params,
    ATTENTION_HALVES,
    BLOCK_KINDS,
    CAUSAL_ATTENTION_KINDS,
    ENCODER_ATTENTION_KINDS,
    FFN_HALVES,
    TransformerSpec,
    check_kind,
    layer_kinds,
    layer_param_count,
    model_spec,
    num_params,
)
from dynabatch.cost.pairs import AttentionPairs
from dynabatch.cost.roofline import Op as _Op, gemm as _gemm, memory_op as _mem
from dynabatch.cost.stored_bytes import LOSS_BYTES, StoredBytes
from dynabatch.cost.recompute import RecomputeTerms

if TYPE_CHECKING:
    from dynabatch.cost.recompute import RecomputeTerms

ArrayLike = Union[float, int, np.ndarray, Sequence[float]]
Value = Union[float, np.ndarray]

OPTIMIZER_STATE_BYTES = {"adam": 8, "momentum": 4, "sgd": 0}
"""fp32 optimizer-state bytes per parameter (Adam: first and second moments)."""


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer (or a stage of layers) for one micro-batch; arrays when the inputs were arrays."""

    fwd_time_s: Value
    """Forward time in seconds."""
    bwd_time_s: Value
    """Backward time in seconds (including recomputation when enabled)."""
    fwd_flops: Value
    """Forward GEMM and attention-core FLOPs (model FLOPs; the backward does about twice as many)."""
    stored_activation_bytes: Value
    """Bytes kept from the forward until the backward of this micro-batch."""
    peak_extra_bytes: Value
    """Transient bytes on top of the stored activations while the layer runs (a stage takes the maximum)."""


def _broadcast_pairs(pairs: AttentionPairs | None, shape) -> AttentionPairs | None:
    """``pairs`` broadcast to the inputs' shape; ``ValueError`` for anything but :class:`AttentionPairs`."""
    if pairs is None:
        return None
    if not isinstance(pairs, AttentionPairs):
        raise ValueError(f"pairs must be an AttentionPairs (dynabatch.cost.pairs) or None, got {type(pairs).__name__}")
    try:
        return pairs.broadcast_to(shape)
    except ValueError as e:
        raise ValueError(f"pairs of shape {pairs.shape} do not broadcast to the micro-batch shape {shape}") from e


_CHECKED = ("checked inputs",)
"""The key under which a ``layers`` memo keeps the checked inputs (:meth:`AnalyticCostModel._arrays`)."""


def checked_memo(b, E, D) -> dict:  # noqa: N803 - the shape names
    """A ``layers`` memo (:meth:`AnalyticCostModel.stage_cost`) holding ``b, E, D`` as inputs already checked and
    broadcast (``D`` None: a decoder-only model's 1), which the methods given it take as they are: how
    :class:`~dynabatch.cost.stage_programs.StagePrograms` runs the model on symbolic inputs."""
    return {_CHECKED: ((b, E, D), (False, (b, E, 1.0 if D is None else D)))}
MASK_BYTES = 24.0
"""Memory traffic per element of an additive segment mask (segment compare, select, float write)."""
BIAS_BYTES_PER_PAIR = 0.0
"""Memory traffic per query-key pair of the relative-position bucketing beyond the bias copy itself
(0: buckets are computed per distinct offset; HF's per-pair bucketing measured as 160)."""
BIAS_BWD_FACTOR = 1.5
"""Position-bias backward (window sum of the gradient, then a gather of 2T - 1 rows) over its forward."""


@dataclass(frozen=True)
class AnalyticCostModel(StoredBytes):
    """Predicts per-layer time and memory of a :class:`TransformerSpec` on a :class:`HardwareSpec`."""

    shares_layer_costs: ClassVar[bool] = True
    """:meth:`stage_cost` and :meth:`recompute_terms` take a ``layers`` memo shared over a layout's stages."""

    spec: TransformerSpec
    """Model shape."""
    hardware: HardwareSpec
    """Device and links."""
    flash_attention: bool = False
    """Fused attention: no ``Tq x Tk`` score tensors stored or moved (HF T5 with position bias runs eager)."""
    dropout: bool = True
    """Dropout is active (masks stored, as in Korthikanti et al.'s formula)."""
    recompute: bool = False
    """Full activation recomputation of transformer blocks: only the block input is stored."""
    context_costs: bool = True
    """Add each stage's once-per-micro-batch masks and T5 position bias (module docstring)."""
    cast_copy_bytes: int = 0
    """Bytes per parameter of autocast's half-precision weight copies, added to the model states: the runtime
    trains fp32 weights under bf16/fp16 autocast and keeps one copy of each weight for the step (2; the first
    H200 run measured 18 bytes per parameter held against the 16 priced)."""
    flash_memory: bool | None = None
    """Memory priced as fused attention (no score tensors kept or transient), whatever ``flash_attention``
    says for time; ``None``: as ``flash_attention``. The runtime's per-segment kernels (SDPA's flash path on
    CPU, varlen / flex on CUDA) keep only Q, K, V, the output and the log-sum-exp: measured on CPU, a GPT-2
    stage keeps 51 kB less under selective recomputation, exactly its log-sum-exp, not the score tensors."""

    fused_cross_memory: bool = False
    """Cross-attention cores keep no score tensors although the self-attention cores may: the padding-free path
    runs T5's cross-attention (no position bias) on SDPA's flash kernel even on CPU, where its biased
    self-attention takes the math path (measured: log-sum-exp and output only, no scores)."""

    dense_masks: bool = False
    """The dense reference path (``--attention dense``): every attention call takes a 4-D fp32 mask. A causal
    stage's SDPA keeps its ``b T T`` mask for backward (once per stage, every mode); a T5 stack's checkpointed
    blocks keep the masks and HF's all-zero cross-attention bias as inputs under ``full`` (measured on CPU)."""

    @property
    def fused_memory(self) -> bool:
        """No ``Tq x Tk`` score tensors in stored or transient memory (:attr:`flash_memory`)."""
        return self.flash_attention if self.flash_memory is None else self.flash_memory

    @classmethod
    def from_names(cls, model: str, hardware: str, **options) -> "AnalyticCostModel":
        """A model from preset names, e.g. ``from_names("gpt3-175b", "a100-80gb")``."""
        return cls(model_spec(model), hardware_spec(hardware), **options)

    @classmethod
    def for_run(cls, spec: TransformerSpec, device: str = "cpu", *, dtype: str = "fp32",
                attention_path: str = "segments", dropout: bool = False,
                hardware: HardwareSpec | None = None) -> "AnalyticCostModel":
        """The model of a training run of the model ``spec`` describes, as the runtime executes it (the trainer's
        planner and the dataloader take it from an HF config through
        :func:`dynabatch.models.families.run_cost_model`): activations in ``dtype`` (``fp32`` / ``bf16`` / ``fp16``,
        which sets ``spec``'s element size; a half precision trains fp32 weights under autocast, so each weight's
        cast copy is counted), on ``hardware`` (default: the preset of ``device``,
        :func:`~dynabatch.cost.hardware.device_hardware`). Memory is priced as fused attention where the
        padding-free path's kernels keep no score tensors: every ``segments`` run except T5 on CPU, where SDPA with
        the float position bias takes its math path (its cross-attention, with no bias, still keeps no scores:
        :attr:`fused_cross_memory`)."""
        spec = dataclasses.replace(spec, dtype_bytes=DTYPE_BYTES[dtype])
        # causal models run SDPA on either path (its fused kernels take the dense path's masks); T5's biased
        # attention is fused only on CUDA's padding-free kernels (varlen, flex), and HF runs it eager on the dense one
        fused = not is_seq2seq(spec.family) or (attention_path == "segments" and device == "cuda")
        return cls(spec, hardware if hardware is not None else device_hardware(device), dropout=dropout,
                   flash_memory=True if fused else None, fused_cross_memory=attention_path == "segments",
                   dense_masks=attention_path == "dense",
                   cast_copy_bytes=DTYPE_BYTES[dtype] if autocasts(dtype) else 0)

    # ---------------------------------------------------------------- public API

    def layer_cost(self, kind: str, b: ArrayLike, E: ArrayLike, D: ArrayLike | None = None,
                   pairs: AttentionPairs | None = None) -> LayerCost:
        """Cost of one ``kind`` layer for ``b`` samples of encoder length ``E`` and decoder length ``D``.

        ``b``, ``E`` and ``D`` broadcast against each other; scalars in, floats out. GPT uses ``E`` as the
        sequence length and ignores ``D``. ``pairs`` (:class:`~dynabatch.cost.pairs.AttentionPairs`, shaped
        like the broadcast inputs) prices the attention cores by the score pairs they compute (padding-free,
        per-segment attention) instead of the dense ``b x Tq x Tk``: core FLOPs, score bytes stored without
        flash attention and the score-gradient transient scale with the pairs (module docstring).
        """
        check_kind(self.spec, kind)
        scalar, (b, E, D) = self._inputs(kind, b, E, D)
        return self._layer_cost(kind, scalar, b, E, D, _broadcast_pairs(pairs, b.shape))

    def _layer_cost(self, kind: str, scalar: bool, b, E, D, pairs, flops: bool = True) -> LayerCost:
        """:meth:`layer_cost` of inputs already checked and broadcast (:meth:`_arrays`, :func:`_broadcast_pairs`);
        ``flops=False``: ``fwd_flops`` is NaN, not summed (:meth:`stage_cost`)."""
        ops = self._ops(kind, b, E, D, pairs)
        times = [self._op_time(op) for op in ops]  # each op's forward time, once
        fwd = sum(times)
        if all(op.bwd_factor == 2.0 for op in ops):  # the same value: doubling is exact, so it commutes with the sum
            bwd = 2.0 * fwd
        else:
            bwd = sum(t * op.bwd_factor for t, op in zip(times, ops))
        flops = sum(op.flops for op in ops) if flops else np.nan
        stored = self._stored(kind, b, E, D, pairs)
        peak = self._peak_extra(kind, b, E, D, pairs)
        if self.recompute and kind in BLOCK_KINDS:
            bwd = bwd + fwd
            peak = peak + stored
            stored = self._residual_bytes() * b * (D if kind == "t5_decoder" else E) * self.spec.d_model
        if scalar:
            return LayerCost(*[float(x) for x in (fwd, bwd, flops, stored, peak)])
        # each value is a fresh result of arithmetic on the inputs: kept as it is where it has their shape
        return LayerCost(*[x if isinstance(x, np.ndarray) and x.shape == b.shape else np.broadcast_to(x, b.shape).copy()
                           for x in (fwd, bwd, flops, stored, peak)])

    def stage_cost(self, kinds: Sequence[str], b: ArrayLike, E: ArrayLike, D: ArrayLike | None = None,
                   pairs: AttentionPairs | None = None, layers: dict | None = None, flops: bool = True) -> LayerCost:
        """Cost of a pipeline stage made of ``kinds``: times, FLOPs and stored bytes add up, the peak
        extra is the largest layer's, and a stage with decoder layers stores the encoder output once.
        ``pairs``: per-segment attention work (:meth:`layer_cost`); ``None`` is dense. ``layers``: each kind's
        cost of these same inputs, shared by the calls over one layout's stages (filled as it goes): a kind
        that several stages hold (a T5 encoder block on three of four stages) is priced once; the calls sharing
        one memo pass the same ``flops``. ``flops=False``: ``fwd_flops`` is NaN, the FLOPs not summed (about a
        pass over the entries per kernel, which the planner and the simulator never read)."""
        if len(kinds) == 0:
            raise ValueError("a stage needs at least one layer kind, got an empty list")
        counts = Counter(kinds)
        for kind in counts:
            check_kind(self.spec, kind)
            self._check_decoder_length(kind, D)
        scalar, arrays = self._arrays(b, E, D, layers)  # checked once for every layer of the stage (and layout)
        work = _broadcast_pairs(pairs, arrays[0].shape)
        if layers is None:
            layers = {}
        for kind in counts:
            if kind not in layers:
                layers[kind] = self._layer_cost(kind, scalar, *arrays, work, flops)
        costs = [(layers[kind], n) for kind, n in counts.items()]

        def total(field: str):
            return sum(getattr(cost, field) * count for cost, count in costs)

        fwd, bwd = total("fwd_time_s"), total("bwd_time_s")
        if self.context_costs:
            ctx_fwd, ctx_bwd = self.context_cost(kinds, b, E, D, pairs, layers)
            fwd, bwd = fwd + ctx_fwd, bwd + ctx_bwd
        stored = total("stored_activation_bytes")
        if "t5_decoder" in kinds and not self.autocast:  # under autocast each layer's K / V projection casts it
            stored = stored + self.spec.dtype_bytes * arrays[0] * arrays[1] * self.spec.d_model
        if self.dense_masks and not is_seq2seq(self.spec.family) and any(k in CAUSAL_ATTENTION_KINDS for k in kinds):
            stored = stored + 4.0 * arrays[0] * arrays[1] ** 2  # the stage's (b, 1, T, T) mask
        peak = costs[0][0].peak_extra_bytes
        for c, _ in costs[1:]:
            peak = np.maximum(peak, c.peak_extra_bytes)
        out = (fwd, bwd, total("fwd_flops") if flops else np.nan, stored, peak)
        return LayerCost(*[float(x) if np.ndim(x) == 0 else x for x in out])

    def recompute_terms(self, kinds: Sequence[str], b: ArrayLike, E: ArrayLike, D: ArrayLike | None = None,
                        pairs: AttentionPairs | None = None, layers: dict | None = None) -> "RecomputeTerms":
        """What activation recomputation changes on a stage of ``kinds`` (:mod:`dynabatch.cost.recompute`):
        for ``full``, the transformer blocks' forward time and the bytes they store beyond their input
        hidden states; for ``selective``, the attention cores' forward time and the bytes they alone store
        (:meth:`_core_stored`); with the largest single block's (core's) stored bytes, re-materialised while
        that block runs its backward. Arrays shaped like the broadcast inputs. ``layers``: as in :meth:`stage_cost`
        (a block's forward time and stored bytes are its layer cost's, when that was priced without
        recomputation)."""

        s, p, d = self.spec, self.spec.dtype_bytes, self.spec.d_model
        blocks = [k for k in kinds if k in BLOCK_KINDS]
        kind = blocks[0] if blocks else kinds[0]
        _, (b, E, D) = self._inputs(kind, b, E, D, layers)
        work = _broadcast_pairs(pairs, b.shape)
        zero = np.zeros_like(b)

        def role(name: str):
            return (None, None) if work is None else work.role(name)

        terms = {f: zero for f in RecomputeTerms.fields()}
        for k, n in Counter(blocks).items():
            T = D if k == "t5_decoder" else E
            layer = None if layers is None or self.recompute else layers.get(k)
            stored = self._stored(k, b, E, D, work) if layer is None else layer.stored_activation_bytes
            core = None if layers is None else layers.get(("recompute_core", k))
            if core is None:  # the attention cores' forward time and stored bytes (the same on every stage)
                cores = ([] if k in FFN_HALVES else
                         {"t5_decoder": [(D, D, role("decoder"), False), (D, E, role("cross"), True)]}.get(
                             k, [(E, E, role("encoder"), False)]))
                core = (sum(self._op_time(op) for tq, tk, (pr, calls), _ in cores
                            for op in self._core_ops(b, tq, tk, pr, calls)),
                        sum(self._core_stored(b, tq, tk, pr, cross) for tq, tk, (pr, _), cross in cores))
                if layers is not None:
                    layers[("recompute_core", k)] = core
            core_fwd, core_stored = core
            block_fwd = (sum(self._op_time(op) for op in self._ops(k, b, E, D, work)) if layer is None
                         else layer.fwd_time_s)
            terms["full_extra_s"] = terms["full_extra_s"] + n * block_fwd
            terms["full_freed_bytes"] = terms["full_freed_bytes"] + n * (stored - self._residual_bytes() * b * T * d)
            terms["full_peak_bytes"] = np.maximum(terms["full_peak_bytes"], stored)
            terms["selective_extra_s"] = terms["selective_extra_s"] + n * core_fwd
            terms["selective_freed_bytes"] = terms["selective_freed_bytes"] + n * core_stored
            terms["selective_peak_bytes"] = np.maximum(terms["selective_peak_bytes"], core_stored)
        # T5: every checkpointed block (under selective, every self-attention core) of a stack takes the stack's
        # fp32 (1, h, T, T) position-bias window as an input, so it stays stored once per stack (measured on
        # t5-tiny, padding-free path, both modes)
        windows = (E, D) if work is None else work.bias_lengths(E, D)
        stacks = (any(k in ENCODER_ATTENTION_KINDS for k in blocks), "t5_decoder" in blocks)  # (an FFN half: neither)
        bias = sum(4 * s.num_heads * T * T for T, held in zip(windows, stacks) if held)
        if self.dense_masks:  # T5 blocks' mask inputs, and the decoder's all-zero (1, h, D, E) cross bias
            masks = (b * E * E, b * (D * D + D * E) + s.num_heads * D * E)
            bias = bias + sum(4.0 * n for n, held in zip(masks, stacks) if held)
        if self.autocast and "t5_decoder" in blocks:  # the fp32 encoder output, a decoder block input (no cast)
            bias = bias + 4.0 * b * E * d
        terms["full_freed_bytes"] = np.maximum(terms["full_freed_bytes"] - bias, 0.0)
        terms["selective_freed_bytes"] = np.maximum(terms["selective_freed_bytes"] - bias, 0.0)
        return RecomputeTerms(**{f: np.broadcast_to(v, b.shape).astype(np.float64, copy=False) for f, v in terms.items()})

    def context_cost(self, kinds: Sequence[str], b: ArrayLike, E: ArrayLike, D: ArrayLike | None = None,
                     pairs: AttentionPairs | None = None, layers: dict | None = None):
        """(forward, backward) seconds of the masks and position biases a T5 stage of ``kinds`` builds once
        per micro-batch (module docstring); zero for a stage without T5 blocks and for GPT. With ``pairs``
        the mask elements are the pairs (per-segment masks); the bias keeps its ``(1, h, T, T)`` size.
        ``layers``: as in :meth:`stage_cost` (the inputs' check is kept there too)."""
        s, p = self.spec, self.spec.dtype_bytes
        kind = next((k for k in kinds if k in ("t5_decoder", *ENCODER_ATTENTION_KINDS)), None)
        if kind is None:  # no T5 attention (GPT, or only an encoder block's FFN half)
            return 0.0, 0.0
        _, (b, E, D) = self._inputs(kind, b, E, D, layers)
        work = _broadcast_pairs(pairs, b.shape)
        masks, bias_pairs = np.zeros_like(b), []
        Le, Ld = (E, D) if work is None else work.bias_lengths(E, D)  # noqa: N806 - the bias windows
        if any(k in ENCODER_ATTENTION_KINDS for k in kinds):
            masks = masks + (b * E * E if work is None else work.encoder)
            bias_pairs.append(Le * Le)
        if "t5_decoder" in kinds:
            masks = masks + (b * (D * D + D * E) if work is None else work.decoder + work.cross)
            bias_pairs.append(Ld * Ld)
        fwd = self._op_time(_mem(MASK_BYTES * masks))
        bwd = np.zeros_like(fwd)
        for n in bias_pairs:
            bias = self._op_time(_mem((BIAS_BYTES_PER_PAIR + 4 * s.num_heads * p) * n))
            fwd, bwd = fwd + bias, bwd + BIAS_BWD_FACTOR * bias
        return fwd, bwd

    def send_bytes(self, last_kind: str, b: ArrayLike, E: ArrayLike, D: ArrayLike | None = None,
                   layers: dict | None = None) -> Value:
        """Activation bytes a stage whose last layer is ``last_kind`` sends downstream (its gradient, of the
        same size, comes back): ``p b E d`` after encoder/GPT layers, ``p b (E + D) d`` after the decoder
        has started, 0 after ``lm_head``. ``layers``: as in :meth:`stage_cost` (the inputs' check is kept there)."""
        check_kind(self.spec, last_kind)
        scalar, (b, E, D) = self._inputs(last_kind, b, E, D, layers)
        tokens = {"lm_head": 0.0, "decoder_embedding": E + D, "t5_decoder": E + D}.get(last_kind, E)
        out = np.broadcast_to(self.spec.dtype_bytes * b * tokens * self.spec.d_model, b.shape)
        return float(out) if scalar else out.copy()

    def send_time(self, num_bytes: ArrayLike, link: str = "intra") -> Value:
        """Seconds to send ``num_bytes`` to a pipeline neighbour over ``link`` (:meth:`HardwareSpec.send_time`)."""
        return self.hardware.send_time(num_bytes, link)

    def model_state_bytes(self, num_params: ArrayLike, optimizer: str = "adam", mixed_precision: bool = True) -> Value:
        """Bytes of parameters, gradients and optimizer state for ``num_params`` parameters.

        Mixed precision (Rajbhandari et al. 2020, ZeRO, Sec. 3.1): 2 (16-bit weights) + 2 (16-bit
        gradients) + 4 (fp32 master weights) + fp32 states, i.e. 16 bytes/param for Adam; fp32 training:
        4 + 4 + states (also 16 for Adam). States: Adam 8, momentum SGD 4, plain SGD 0.
        """
        if optimizer not in OPTIMIZER_STATE_BYTES:
            raise ValueError(f"unknown optimizer {optimizer!r}; valid optimizers: {', '.join(OPTIMIZER_STATE_BYTES)}")
        per_param = (2 + 2 + 4 if mixed_precision else 4 + 4) + OPTIMIZER_STATE_BYTES[optimizer]
        if np.any(np.asarray(num_params) < 0):
            raise ValueError(f"num_params must be >= 0, got {num_params}")
        out = np.asarray(num_params, dtype=np.float64) * (per_param + self.cast_copy_bytes)
        return float(out) if out.ndim == 0 else out

    def param_count(self, kind: str) -> int:
        """Parameters of one ``kind`` layer (matches the Hugging Face block)."""
        return layer_param_count(self.spec, kind)

    def tied_copy_count(self, kinds) -> int:
        """Parameters of the tied token-table copy a stage of layer ``kinds`` holds (:func:`tied_copy_params`)."""

        return tied_copy_params(self.spec, kinds)

    def num_params(self) -> int:
        """Parameters of the whole model."""
        return num_params(self.spec)

    def layer_kinds(self) -> list[str]:
        """The whole model as an ordered list of layer kinds."""
        return layer_kinds(self.spec)

    def priced_kinds(self) -> tuple[str, ...]:
        """Every layer kind this model prices: the model's own and the block halves a layer split may cut."""
        return self.spec.layer_kinds

    def checked_inputs(self, b: ArrayLike, E: ArrayLike, D: ArrayLike | None = None,
                       pairs: AttentionPairs | None = None):
        """``(b, E, D, pairs)``: ``b, E, D`` float64 arrays of one shape, each finite and >= 1 (``D`` None stays None),
        ``pairs`` broadcast to that shape: the checks the pricing methods make, for a caller that prices the same
        inputs otherwise (:class:`~dynabatch.cost.stage_programs.StagePrograms`)."""
        _, (b, E, d) = self._arrays(b, E, D)
        return b, E, (None if D is None else d), _broadcast_pairs(pairs, b.shape)

    # ---------------------------------------------------------------- helpers

    def _inputs(self, kind: str, b, E, D, layers: dict | None = None) -> tuple[bool, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Validated float64 arrays broadcast to one shape, and whether all inputs were scalars (``layers``: see
        :meth:`_arrays`)."""
        self._check_decoder_length(kind, D)
        return self._arrays(b, E, D, layers)

    def _check_decoder_length(self, kind: str, D) -> None:
        """``ValueError`` when ``kind`` needs the decoder length and ``D`` is None; a warning for a GPT's ``D``."""
        needs_d = is_seq2seq(self.spec.family) and kind in ("decoder_embedding", "t5_decoder", "lm_head")
        if needs_d and D is None:
            raise ValueError(f"layer kind {kind!r} of a t5 model needs the decoder length D, got None")
        if not is_seq2seq(self.spec.family) and D is not None and np.any(np.asarray(D) != 0):
            warnings.warn("D (decoder length) has no effect for a gpt model; the sequence length is E", stacklevel=4)

    def _arrays(self, b, E, D, layers: dict | None = None) -> tuple[bool, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``b, E, D`` (``D`` None: 1) as float64 arrays broadcast to one shape, each finite and >= 1, and whether
        all were scalars. ``layers`` (the memo of one :class:`~dynabatch.cost.stages.StageCostModel` call, whose
        stages and terms all take the same inputs): the checked result is kept there for those same input objects,
        so a layout's stages check them once, not once per stage and per term."""
        if layers is not None:
            seen = layers.get(_CHECKED)
            if seen is not None and all(x is y for x, y in zip(seen[0], (b, E, D))):
                return seen[1]
            out = self._arrays(b, E, D)
            layers[_CHECKED] = ((b, E, D), out)  # the inputs held: their ids stay theirs for the call
            return out
        scalar = all(np.ndim(x) == 0 for x in (b, E, D) if x is not None)
        arrays = [np.asarray(x if x is not None else 1.0, dtype=np.float64) for x in (b, E, D)]
        for name, x in zip("bED", arrays):
            if x.size and not (np.all(np.isfinite(x)) and np.all(x >= 1)):
                raise ValueError(f"{name} must be finite and >= 1, got min {x.min()} in {x if x.size < 8 else x.shape}")
        return scalar, tuple(np.broadcast_arrays(*arrays))  # type: ignore[return-value]

    def _op_time(self, op: _Op) -> np.ndarray:
        hw = self.hardware
        memory = op.bytes / (hw.memory_bandwidth * hw.memory_efficiency)
        if op.unit == "memory":  # no FLOPs (_mem): max(0, memory) is memory itself, bytes being >= 0
            return memory + op.launches * hw.kernel_launch_s
        eff = hw.matmul_efficiency if op.unit == "matmul" else hw.attention_efficiency
        compute = op.flops / (hw.peak_flops * eff)
        return np.maximum(compute, memory) + op.launches * hw.kernel_launch_s

    def _residual(self, n_tokens) -> _Op:
        """Bias, dropout and residual add over ``n_tokens`` hidden states (one fused kernel)."""
        p, d = self.spec.dtype_bytes, self.spec.d_model
        return _mem((3 * p + (1 if self.dropout else 0)) * n_tokens * d)

    def _attention_ops(self, b, Tq, Tk, is_self: bool, pairs=None, calls=None) -> list[_Op]:
        """Projections, attention core and output projection of one attention sub-layer; ``pairs`` (an
        array like ``b``, or None for the dense ``b Tq Tk``) are the score pairs the core computes, in
        ``calls`` calls (None: one; each call launches the core's kernels again)."""
        s, p = self.spec, self.spec.dtype_bytes
        d, a, kv = s.d_model, s.d_attn, s.d_kv_attn
        if is_self:  # Q (a wide) and K, V (kv wide each: narrower under grouped-query attention)
            proj = [_gemm(b * Tq, a + 2 * kv, d, p)]
        else:  # Q from the decoder, K and V from the encoder output
            proj = [_gemm(b * Tq, a, d, p), _gemm(b * Tk, 2 * a, d, p)]
        core = self._core_ops(b, Tq, Tk, pairs, calls)
        return [_mem(2 * p * b * Tq * d)] + proj + core + [_gemm(b * Tq, d, a, p), self._residual(b * Tq)]

    def _core_ops(self, b, Tq, Tk, pairs=None, calls=None) -> list[_Op]:
        """The attention core of one attention sub-layer (scores, softmax, dropout, weighted values): what
        selective recomputation runs again in backward."""
        s, p = self.spec, self.spec.dtype_bytes
        a, h, kv = s.d_attn, s.num_heads, s.d_kv_attn
        if self.flash_attention:
            flops = 4.0 * b * h * Tq * Tk * s.d_kv if pairs is None else 4.0 * h * pairs * s.d_kv
            core = [_Op(flops, p * b * 2 * (Tq * a + Tk * kv), "attention", bwd_factor=2.5)]
        elif pairs is None:
            scores = b * h * Tq * Tk
            core = [_gemm(Tq, Tk, s.d_kv, p, batch=b * h, unit="attention"), _mem(2 * p * scores)]
            core += self._dropout(scores) + [_gemm(Tq, s.d_kv, Tk, p, batch=b * h, unit="attention")]
        else:  # QK^T and AV over each segment's block: FLOPs and score bytes per pair, Q/K/V bytes per token
            scores = h * pairs
            gemm = _Op(2.0 * scores * s.d_kv, p * (scores + h * b * (Tq + Tk) * s.d_kv), "attention")
            core = [gemm, _mem(2 * p * scores)] + self._dropout(scores) + [gemm]
        if calls is not None:
            core = [dataclasses.replace(op, launches=calls) for op in core]
        return core

    def _ffn_ops(self, b, T) -> list[_Op]:
        s, p = self.spec, self.spec.dtype_bytes
        n, width = b * T, s.d_ff * (2 if s.gated_ffn else 1)
        act = _mem((3 if s.gated_ffn else 2) * p * n * s.d_ff)
        norm = _mem(2 * p * n * s.d_model)
        return [norm, _gemm(n, width, s.d_model, p), act, _gemm(n, s.d_model, s.d_ff, p), self._residual(n)]

    def _dropout(self, n_elements) -> list[_Op]:
        """A standalone dropout kernel (read, write, 1-byte mask), none when dropout is off."""
        return [_mem((2 * self.spec.dtype_bytes + 1) * n_elements)] if self.dropout else []

    def _ops(self, kind: str, b, E, D, pairs=None) -> list[_Op]:
        s, p, d = self.spec, self.spec.dtype_bytes, self.spec.d_model
        enc, dec, cross = ((None, None), (None, None), (None, None)) if pairs is None else (
            pairs.role("encoder"), pairs.role("decoder"), pairs.role("cross"))
        if kind in ("gpt", "t5_encoder"):
            return self._attention_ops(b, E, E, True, *enc) + self._ffn_ops(b, E)
        if kind in ATTENTION_HALVES:
            return self._attention_ops(b, E, E, True, *enc)
        if kind in FFN_HALVES:
            return self._ffn_ops(b, E)
        if kind == "t5_decoder":
            return (self._attention_ops(b, D, D, True, *dec) + self._attention_ops(b, D, E, False, *cross)
                    + self._ffn_ops(b, D))
        if kind == "embedding":  # gather (+ GPT position add), dropout
            n = b * E
            positions = [_mem(3 * p * n * d)] if s.max_positions else []  # learned position table (GPT-2)
            return [_mem(2 * p * n * d)] + positions + self._dropout(n * d)
        if kind == "decoder_embedding":  # encoder final norm + dropout, decoder gather + dropout
            encoder_final = [_mem(2 * p * b * E * d)] + self._dropout(b * E * d)
            return encoder_final + [_mem(2 * p * b * D * d)] + self._dropout(b * D * d)
        # lm_head: final norm (+ T5 dropout), logits GEMM, fp32 log-softmax + NLL (about three passes)
        n = b * (D if is_seq2seq(s.family) else E)
        ops = [_mem(2 * p * n * d)] + (self._dropout(n * d) if is_seq2seq(s.family) else [])
        return ops + [_gemm(n, s.vocab_size, d, p), _mem((p + 2 * LOSS_BYTES) * n * s.vocab_size)]
