"""What each layer keeps for backward, and its backward's transient buffers: the activation-memory half of
:class:`~dynabatch.cost.analytic.AnalyticCostModel`, a mixin over its ``spec``, ``dropout`` and memory flags
(``fused_memory``, ``fused_cross_memory``). The terms are listed in :mod:`dynabatch.cost.analytic`'s docstring;
each was measured against the runtime's saved tensors (docs/algorithms/runtime.md, "Activation recomputation": measured / predicted
1.00-1.06 for GPT-2, T5 and Llama in every recompute mode on both attention paths in fp32, 0.98-1.07 under bf16
autocast).
"""

from __future__ import annotations

import numpy as np

from dynabatch.cost.model_specs import ATTENTION_HALVES, FFN_HALVES
from dynabatch.core.sequence import is_seq2seq

LOSS_BYTES = 4
"""fp32 log-probabilities per logit, as Hugging Face computes the loss."""
IDS_BYTES = 8
"""int64 token ids saved for the embedding backward, per token."""
RMS_NORM_EXTRA_BYTES = 4
"""Bytes per element an RMSNorm keeps beyond its input and output: Hugging Face's T5 / Llama norms multiply the
weight by ``x * rsqrt(mean(x^2))``, computed in fp32, and keep that product for the weight's gradient (measured
on t5-tiny: the norm's input, the fp32 product and the output, against LayerNorm's input and output)."""


class StoredBytes:
    """Per-layer stored and transient bytes of an analytic model (mixed into ``AnalyticCostModel``)."""

    @property
    def autocast(self) -> bool:
        """fp32 weights trained under half-precision autocast (``cast_copy_bytes > 0``; ``dtype_bytes`` is the
        autocast dtype's): the residual stream, the norms and the embeddings stay fp32, and every projection saves
        its own half-precision cast of an fp32 input (measured on CPU under bf16 autocast)."""
        return self.cast_copy_bytes > 0

    def _projection_inputs(self, n_projections: int) -> int:
        """Copies of a norm's output the projections reading it save: one shared tensor, or under autocast one
        half-precision cast per projection."""
        return n_projections if self.autocast else 1

    def _attention_stored(self, b, Tq, Tk, pairs=None, cross: bool = False):
        s, p = self.spec, self.spec.dtype_bytes
        d, a, kv = s.d_model, s.d_attn, s.d_kv_attn
        mask = 1 if self.dropout else 0
        core = self._core_stored(b, Tq, Tk, pairs, cross)
        if cross:  # Q from the norm; K and V from the encoder output (under autocast each casts it)
            inputs = p * b * Tq * d + (2 * p * b * Tk * d if self.autocast else 0)
        else:
            inputs = self._projection_inputs(1 if s.fused_qkv else 3) * p * b * Tq * d
        return inputs + p * b * (Tq * a + 2 * Tk * kv) + core + p * b * Tq * a + mask * b * Tq * d

    def _fused_core(self, cross: bool) -> bool:
        """The attention core keeps no score tensors (:attr:`fused_memory`; cross-attention also with
        :attr:`fused_cross_memory`)."""
        return self.fused_memory or (cross and self.fused_cross_memory)

    def _fp32_core(self, cross: bool) -> bool:
        """Under autocast, T5's unfused attention core runs in fp32: the fp32 position bias (all zeros for HF's
        cross-attention) promotes it, so its scores and SDPA math's copies of Q, K, V are fp32 (measured on CPU)."""
        return self.autocast and is_seq2seq(self.spec.family) and not self._fused_core(cross)

    def _core_stored(self, b, Tq, Tk, pairs=None, cross: bool = False):
        """Bytes the attention core alone stores for backward (beyond its Q, K, V inputs and its output,
        which the projections around it keep): what selective recomputation frees. An fp32 core
        (:meth:`_fp32_core`) keeps fp32 scores and fp32 copies of Q, K, V in place of the half-precision ones
        (under selective the half-precision inputs stay, the copies go)."""
        s, h, p = self.spec, self.spec.num_heads, self.spec.dtype_bytes
        mask = 1 if self.dropout else 0
        if self._fused_core(cross):
            return 4 * b * h * Tq
        copies = 0
        if self._fp32_core(cross):
            copies, p = (4 - p) * b * (Tq * s.d_attn + 2 * Tk * s.d_kv_attn), 4
        scores = b * Tq * Tk if pairs is None else pairs
        return copies + (p + (mask + p) * mask) * h * scores  # softmax output (+ dropout mask and output)

    def _ffn_stored(self, b, T):
        s, p = self.spec, self.spec.dtype_bytes
        mask = 1 if self.dropout else 0
        inputs = self._projection_inputs(2 if s.gated_ffn else 1) * p * b * T * s.d_model
        # HF's T5 FFN casts the activation to the fp32 down projection's dtype, which autocast casts back and keeps
        round_trip = p * b * T * s.d_ff if self.autocast and is_seq2seq(s.family) else 0
        return inputs + s.ffn_saved_tensors * p * b * T * s.d_ff + round_trip + mask * b * T * s.d_model

    def _norm_bytes(self) -> int:
        """Bytes a norm keeps per element for backward besides its output: its input, the residual stream (fp32
        under autocast), and RMSNorm's fp32 copy."""
        return self._residual_bytes() + (RMS_NORM_EXTRA_BYTES if self.spec.rms_norm else 0)

    def _residual_bytes(self) -> int:
        """Bytes per element of the residual stream (a block's input): fp32 under autocast."""
        return 4 if self.autocast else self.spec.dtype_bytes

    def _stored(self, kind: str, b, E, D, pairs=None):
        s, p, d = self.spec, self.spec.dtype_bytes, self.spec.d_model
        mask = 1 if self.dropout else 0
        nb = self._norm_bytes()
        enc, dec, cross = (None, None, None) if pairs is None else (pairs.encoder, pairs.decoder, pairs.cross)
        if kind in ("gpt", "t5_encoder"):
            return 2 * nb * b * E * d + self._attention_stored(b, E, E, enc) + self._ffn_stored(b, E)
        if kind in ATTENTION_HALVES:  # the norm's input, the attention
            return nb * b * E * d + self._attention_stored(b, E, E, enc)
        if kind in FFN_HALVES:
            return nb * b * E * d + self._ffn_stored(b, E)
        if kind == "t5_decoder":
            attention = self._attention_stored(b, D, D, dec) + self._attention_stored(b, D, E, cross, cross=True)
            return 3 * nb * b * D * d + attention + self._ffn_stored(b, D)
        if kind == "embedding":
            return (IDS_BYTES + mask * d) * b * E
        if kind == "decoder_embedding":
            return (nb + mask) * b * E * d + (IDS_BYTES + mask * d) * b * D
        n = b * (D if is_seq2seq(s.family) else E)
        t5_mask = mask if is_seq2seq(s.family) else 0
        return (nb + p + t5_mask) * n * d + LOSS_BYTES * n * s.vocab_size

    def _peak_extra(self, kind: str, b, E, D, pairs=None):
        s, p, d = self.spec, self.spec.dtype_bytes, self.spec.d_model
        a, h, kv = s.d_attn, s.num_heads, s.d_kv_attn
        if kind in ("embedding", "decoder_embedding"):
            return p * b * (E + (D if kind == "decoder_embedding" else 0)) * d
        if kind == "lm_head":  # forward: the logits and their fp32 copy; backward: two fp32 logit gradients
            n = b * (D if is_seq2seq(s.family) else E)
            return max(p + LOSS_BYTES, 2 * LOSS_BYTES) * n * s.vocab_size + p * n * d

        def attention(Tq, Tk, n_pairs, cross: bool = False):
            if self._fused_core(cross):
                return p * b * (Tq * a + 2 * Tk * kv) + 4 * b * h * Tq
            return 2 * p * b * h * Tq * Tk if n_pairs is None else 2 * p * h * n_pairs

        T = D if kind == "t5_decoder" else E
        own = None if pairs is None else (pairs.decoder if kind == "t5_decoder" else pairs.encoder)
        ffn = (3 if s.gated_ffn else 2) * p * b * T * s.d_ff
        if kind in ATTENTION_HALVES or kind in FFN_HALVES:  # one half's transient only
            return 2 * p * b * T * d + (attention(T, T, own) if kind in ATTENTION_HALVES else ffn)
        transient = np.maximum(attention(T, T, own), ffn)
        if kind == "t5_decoder":  # cross-attention buffers and the encoder-output gradient
            cross = None if pairs is None else pairs.cross
            transient = np.maximum(transient, attention(D, E, cross, cross=True)) + p * b * E * d
        return 2 * p * b * T * d + transient
