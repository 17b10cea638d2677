"""Token-slice cost models (TeraPipe, arXiv 2102.07988): what one slice of a decoder-only sequence costs.

A slice of ``s`` new tokens after ``c`` context tokens attends to ``c + s`` keys; its cost on the bottleneck
pipeline stage is ``evaluate(b, s, c) -> (time_s, stored_bytes, peak_bytes)`` (:class:`SliceCostModel`).
:class:`PolynomialSliceCostModel` is a closed form for tests and exploration; :class:`AnalyticSliceCostModel`
prices a stage's layers with :class:`~dynabatch.cost.analytic.AnalyticCostModel`'s own kernels, so the two cannot
drift apart, and says what else the runtime holds per slice (``held_bytes``: in-flight buffers and the
concatenated context keys/values). :func:`slice_stage_costs` and :func:`piece_costs` turn a step's slices into
the per-stage costs the schedule, the simulator and the validator use. The DP that cuts a sequence into slices
is :mod:`dynabatch.plan.slicing`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from dynabatch.cost.model_specs import BLOCK_HALVES, CAUSAL_ATTENTION_KINDS
from dynabatch.cost.roofline import Op, memory_op
from dynabatch.plan.boundary_choice import with_moves
from dynabatch.plan.costs import PolynomialCostModel, check_non_negative_fields
from dynabatch.core.sequence import is_seq2seq
from dynabatch.cost.stages import StageCosts, in_flight_buffer_bytes

CONTEXT_KV_PASSES = (5, 7)
"""Passes over the context's keys and values (each ``b c a_kv`` elements) that one slice makes per attention
block besides its attention core's reads, forward and backward, counted from the runtime
(:mod:`dynabatch.models.slice_kv`, :mod:`dynabatch.models.context_attention`). Forward: the cache joins context
and own keys (read, write: 2), the context call reads them (1), and the context the next slice sees is joined
again (2). Backward: the context call's backward reads them and writes their gradient (2), the two key sets'
gradients are joined (2), and the gradient handed to the previous slice adds the carried one (read 2, write 1).
The slices of one sample make these passes over a context that grows with every slice, so cutting it finer
costs memory traffic the attention pairs do not show; with each slice's fixed cost (kernel launches), it decides
how many slices pay: gpt2-d256-8k on one CPU thread ran a 2,048-token sample 1.16x slower in 16 slices than in 8
and 1.56x in 32 (``docs/benchmarks/token_slicing/slice_attention_2cpu_20261207.md``)."""
CONTEXT_KV_LAUNCHES = 3
"""Kernels of the forward passes (the joins and the context call's reads); the backward's scale with its passes."""

if TYPE_CHECKING:
    from dynabatch.cost.analytic import AnalyticCostModel
    from dynabatch.cost.stages import StageCosts

SLICE_BLOCKS = ("gpt", *BLOCK_HALVES["gpt"])
"""A decoder block and its halves (a stage boundary inside a block, :data:`~dynabatch.cost.model_specs.BLOCK_HALVES`)."""
SLICE_KINDS = ("embedding", *SLICE_BLOCKS, "lm_head")
"""Layer kinds a decoder-only stage may hold."""


# --------------------------------------------------------------------------- cost interface


@runtime_checkable
class SliceCostModel(Protocol):
    """Time and activation memory of one token slice on the bottleneck pipeline stage.

    Contract: ``evaluate(b, s, c)`` takes int64 arrays of one shape (``s >= 1`` new tokens of ``b``
    samples after ``c >= 0`` context tokens already processed; attention is ``s x (c + s)``, causal
    within the slice) and returns float64 arrays of that shape, finite and ``>= 0``: the forward +
    backward time, the activation bytes the slice itself stores until its backward (its own keys and
    values included; the context's belong to the earlier slices) and the transient bytes while it runs
    (including gradient buffers for the context's keys and values). ``c = 0`` is the unsliced sequence
    of length ``s``. Stored bytes must be sub-additive along the sequence,
    ``stored(b, c, 0) + stored(b, s, c) <= stored(b, c + s, 0)``, for the memory bound to be sound.
    """

    memory_budget_bytes: float
    """Activation memory available per stage (device memory left after model states)."""

    def evaluate(self, b: np.ndarray, s: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(time_s, stored_bytes, peak_bytes)`` of slices of ``s`` tokens after ``c`` context tokens."""
        ...


def causal_pairs(s, c):
    """(query, key) pairs a causal mask allows in a slice: ``s c + s (s + 1) / 2``; sums to ``L (L + 1) / 2``."""
    s = np.asarray(s, dtype=np.float64)
    return s * np.asarray(c, dtype=np.float64) + s * (s + 1.0) / 2.0


_MB = PolynomialCostModel()  # the micro-batch polynomial whose constants a slice shares


@dataclass(frozen=True)
class PolynomialSliceCostModel:
    """Analytic slice cost, polynomial in ``(b, s, c)``; defaults: one stage of 6 GPT blocks, d = 768.

    With ``pairs = b (s c + s (s + 1) / 2)`` (causal pairs, so the slices of a sequence add up to the
    unsliced sequence exactly) and ``tokens = b s``::

        time   = overhead + time_per_token * tokens + time_per_pair * pairs
        stored = stored_per_token * tokens + stored_per_pair * pairs
        peak   = peak_per_token * tokens + peak_per_pair * pairs + peak_per_context_token * b c

    The last term is the gradient buffers of the context's keys and values. Constants as in
    :class:`~dynabatch.plan.costs.PolynomialCostModel` (1e14 FLOP/s, Korthikanti et al. 2022).
    """

    memory_budget_bytes: float = _MB.memory_budget_bytes
    """Activation memory per stage in bytes (default 16 GiB)."""
    overhead_s: float = _MB.overhead_s
    """Fixed time per slice: kernel launches, p2p latency, small-slice inefficiency."""
    time_per_token_s: float = _MB.time_per_token_s
    """Linear layers, fwd + bwd, per token (own keys/values included)."""
    time_per_pair_s: float = _MB.time_per_token_pair_s
    """Attention core, fwd + bwd, per causal (query, key) pair."""
    stored_per_token_bytes: float = _MB.stored_per_token_bytes
    """Korthikanti Eq. 1 linear term per token (own keys/values included)."""
    stored_per_pair_bytes: float = _MB.stored_per_token_pair_bytes
    """Softmax output, dropout mask and output per pair (0: flash)."""
    peak_per_token_bytes: float = _MB.peak_per_token_bytes
    """Transient backward buffers per token."""
    peak_per_pair_bytes: float = _MB.peak_per_token_pair_bytes
    """Attention-score gradient of one layer per pair."""
    peak_per_context_token_bytes: float = 6 * 2 * 2 * 768
    """Gradients of the context's keys and values, 16-bit, for every layer of the stage."""

    def __post_init__(self) -> None:
        check_non_negative_fields(self)

    def evaluate(self, b, s, c) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b = np.asarray(b, dtype=np.float64)
        tokens = b * np.asarray(s, dtype=np.float64)
        pairs = b * causal_pairs(s, c)
        time_s = self.overhead_s + self.time_per_token_s * tokens + self.time_per_pair_s * pairs
        stored = self.stored_per_token_bytes * tokens + self.stored_per_pair_bytes * pairs
        context = b * np.asarray(c, dtype=np.float64)
        peak = self.peak_per_token_bytes * tokens + self.peak_per_pair_bytes * pairs
        return time_s, stored, peak + self.peak_per_context_token_bytes * context


@dataclass(frozen=True)
class AnalyticSliceCostModel:
    """Slice costs of one decoder-only stage from :class:`~dynabatch.cost.analytic.AnalyticCostModel`.

    A ``gpt`` block on a slice runs the analytic model's own kernel list with query length ``s`` and key
    length ``T_k``: projections, FFN, norms and residuals on the ``s`` new tokens; ``QK^T``, softmax,
    dropout and ``AV`` (or the fused kernel) over ``s x T_k`` scores. ``attention="dense"``:
    ``T_k = c + s``, what an eager kernel with a key/value cache computes (the analytic model does not
    exploit causal masks either); the slices of a sequence then do *less* attention work than the
    unsliced square, ``sum_j s_j (c_j + s_j) <= L^2``. ``attention="causal"``: ``T_k = 2 c + s``, the
    slice's causal share ``(c + s)^2 - c^2`` of the square, so slices add up to the unsliced cost
    exactly (linear FLOPs and attention FLOPs alike). Either way ``c = 0`` is the unsliced stage cost.

    Stored bytes are the block's (Korthikanti) activations at ``(s, T_k)`` minus the context's keys and
    values (stored by earlier slices); with recomputation only the block input ``p b s d``. Peak bytes
    are the largest layer's backward buffers at ``(s, T_k)`` (recomputation adds the block's stored
    activations, as in the analytic model) plus the gradients of the context's keys and values,
    ``2 p b c a_kv`` per block of the stage (``a_kv``: the key/value width, narrower under GQA). ``embedding`` and ``lm_head`` cost per token (length ``s``).
    Cached keys/values the kernels read (``p b h c d_kv`` per GEMM) count in the kernels' bytes.
    The ``gpt`` kernels come from the analytic model's own (private) kernel builders, so the two models
    cannot drift apart; tests pin ``c = 0`` to ``stage_cost`` exactly.
    """

    model: "AnalyticCostModel"
    """Layer-level model of a decoder-only (causal) transformer."""
    stage_kinds: tuple[str, ...]
    """Layer kinds of the bottleneck stage, e.g. ``("embedding",) + ("gpt",) * 6``."""
    memory_budget_bytes: float
    """Activation memory of that stage in bytes."""
    attention: str = "dense"
    """``dense`` (keys ``c + s``, eager kernels) or ``causal`` (keys ``2 c + s``, the causal share)."""
    buffer_bytes_per_token: float = 0.0
    """In-flight buffers a slice holds per token until its backward: loaded inputs and message buffers
    (:func:`~dynabatch.cost.stages.in_flight_buffer_bytes`, the largest stage's; :meth:`held_bytes`)."""
    context_passes: bool = True
    """Price the passes over the context's keys and values (:meth:`context_op`); ``False``: the attention core's
    work alone (:meth:`context_time_ratios` divides by that)."""
    stages: object = field(default=None, repr=False, compare=False)
    """The :class:`~dynabatch.cost.stages.StageCostModel` it was taken from (:meth:`from_stage_model`), for
    :meth:`chain_memory`; ``None``: the chain is checked on this stage's own numbers."""
    _counts: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        family = getattr(getattr(self.model, "spec", None), "family", None)
        if is_seq2seq(family):
            raise ValueError(f"token slicing needs a decoder-only model (a causal spec), got {family!r}")
        kinds = tuple(self.stage_kinds)
        if not kinds:
            raise ValueError("stage_kinds needs at least one layer kind, got an empty sequence")
        bad = sorted(set(kinds) - set(SLICE_KINDS))
        if bad:
            raise ValueError(f"unknown layer kinds {bad} for a sliced stage; valid kinds: {', '.join(SLICE_KINDS)}")
        if not set(kinds) & set(SLICE_BLOCKS):
            raise ValueError(f"a sliced stage needs at least one 'gpt' block (or half of one), got {kinds}")
        if self.attention not in ("dense", "causal"):
            raise ValueError(f"attention must be 'dense' or 'causal', got {self.attention!r}")
        budget = self.memory_budget_bytes
        if not (np.isfinite(budget) and budget > 0):
            raise ValueError(f"memory_budget_bytes must be finite and > 0, got {budget}")
        object.__setattr__(self, "stage_kinds", kinds)
        object.__setattr__(self, "_counts", tuple(Counter(kinds).items()))

    @classmethod
    def from_stage_model(cls, stages, *, ref_length: int = 2048, attention: str | None = None) -> "AnalyticSliceCostModel":
        """The slowest stage (fwd + bwd of one sample of ``ref_length`` tokens) of a
        :class:`~dynabatch.cost.stages.StageCostModel`, with that model's memory budget. Under its ``full``
        recompute policy the slices' blocks are priced recomputed, as the runtime runs them; under ``auto`` and
        ``selective`` without (the safe side: a slice's mode there is chosen for its own shape).

        ``attention``: ``causal`` where the kernel that runs a whole sample skips the blocks above the causal
        diagonal (fused attention: the padding-free runtime's ``is_causal`` calls, whose slices compute their
        causal share, :mod:`dynabatch.models.context_attention`; the analytic model's ``flash_attention``),
        so that a sample's slices cost what it costs whole; ``dense`` where the whole sample computes its full
        square (4-D masks, eager kernels) and a slice only its ``s (c + s)`` rectangle. ``None``: ``causal``
        if the stage model's analytic model has ``flash_attention``, else ``dense``."""
        if attention is None:
            attention = "causal" if getattr(stages.model, "flash_attention", False) else "dense"

        per = stages.per_stage(np.array([1.0]), np.array([float(ref_length)]), np.array([0.0]))
        slowest = int(np.argmax((per.fwd_s + per.bwd_s)[:, 0]))
        buffers = float(in_flight_buffer_bytes(per)[:, 0].max()) / ref_length  # linear in tokens (decoder-only)
        model = stages.model
        if getattr(stages, "recompute", "none") == "full" and hasattr(model, "recompute"):  # slices recompute too
            model = dataclasses.replace(model, recompute=True)
        return cls(model, tuple(stages.layout.stages[slowest]), stages.memory_budget_bytes, attention,
                   buffer_bytes_per_token=buffers, stages=stages)

    def chain_memory(self, b: int, s: np.ndarray, c: np.ndarray) -> np.ndarray | None:
        """(k,) a chain's memory while each of its slices (``s`` tokens after ``c``) runs its backward, as the
        runtime's validator counts it (:func:`slice_stage_costs` of :attr:`stages`, with recompute modes and
        in-flight buffers): the kept bytes of it and every earlier slice plus its peak, the largest over the
        stages. ``None`` without :attr:`stages`."""
        if self.stages is None:
            return None

        bb, ss = np.full(len(s), float(b)), np.asarray(s, dtype=np.float64)
        costs = slice_stage_costs(self.stages.per_stage(bb, ss, np.zeros_like(ss)), self, bb, ss, c, memory_only=True)
        kept = costs.stored_bytes + in_flight_buffer_bytes(costs)  # (S, k)
        return (np.cumsum(kept, axis=1) + costs.peak_bytes).max(axis=0)

    def stage_time_ratios(self, b, s, c) -> np.ndarray | None:
        """(S, M) ``t(b, s, c) / t(b, s, 0)`` on each stage of :attr:`stages` (its own layer kinds; 1 on a
        stage without an attention block, whose cost does not grow with the context), or ``None`` without
        :attr:`stages`. The bottleneck stage's ratio misprices the others: gpt2-d256 on 2 CPU stages (5 blocks |
        3 blocks and the head) priced the 40 slices of an 8,192-token sample 58% above the whole sample on the
        second stage, whose head grows with ``s`` alone."""
        return self._stage_ratios(b, s, c, lambda own: own.evaluate(b, s, np.zeros_like(c))[0])

    def context_time_ratios(self, b, s, c) -> np.ndarray | None:
        """(S, M) per stage of :attr:`stages`: a slice's time with its passes over the context's keys and values
        (:data:`CONTEXT_KV_PASSES`) over its time without them (1 on a stage without an attention block, and where
        ``c = 0``). :func:`piece_costs` scales a stage model's price of a slice's score pairs by it: the pairs count
        the attention core's work, not these passes. ``None`` without :attr:`stages`."""
        return self._stage_ratios(
            b, s, c, lambda own: dataclasses.replace(own, context_passes=False).evaluate(b, s, c)[0])

    def _stage_ratios(self, b, s, c, reference) -> np.ndarray | None:
        """(S, M) ``t(b, s, c) / reference(own)`` with each stage's own model (1 on a stage without attention)."""
        if self.stages is None:
            return None
        rows = []
        for own in self._stage_models:
            if own is None:
                rows.append(np.ones(np.broadcast(b, s, c).shape))
                continue
            t1, t0 = own.evaluate(b, s, c)[0], reference(own)
            rows.append(np.where(t0 > 0, t1 / np.maximum(t0, 1e-30), 1.0))
        return np.array(rows)

    @functools.cached_property
    def _stage_models(self) -> tuple["AnalyticSliceCostModel | None", ...]:
        """This model on each stage of :attr:`stages` (its own layer kinds), ``None`` for a stage without an
        attention block; built once (a model is immutable)."""
        return tuple(dataclasses.replace(self, stage_kinds=tuple(kinds), stages=None)
                     if set(kinds) & set(SLICE_BLOCKS) else None for kinds in self.stages.layout.stages)

    def keys(self, s, c):
        """The key length a slice's attention is priced at: ``c + s`` (``dense``) or ``2c + s`` (``causal``, the
        causal share of the square in the square's units)."""
        return c + s if self.attention == "dense" else 2.0 * c + s

    def _block_ops(self, kind: str, b, s, c) -> list:
        """The analytic kernels of a block (``gpt``) or block half on a slice of ``s`` tokens after ``c``: with an
        attention half, also the passes over the context's keys and values (:meth:`context_op`)."""
        m = self.model
        context = [self.context_op(b, c)] if self.context_passes else []
        attention = m._attention_ops(b, s, self.keys(s, c), True) + context if kind != "gpt_mlp" else []
        return attention + (m._ffn_ops(b, s) if kind != "gpt_attn" else [])

    def context_op(self, b, c) -> Op:
        """The passes one attention block makes over the ``c`` context tokens' keys and values
        (:data:`CONTEXT_KV_PASSES`), as one memory-bound kernel with its backward factor; nothing (no bytes, no
        launch) where ``c = 0``, so an unsliced micro-batch keeps the analytic model's own price."""
        spec = self.model.spec
        fwd, bwd = CONTEXT_KV_PASSES
        launches = np.where(np.asarray(c) > 0, float(CONTEXT_KV_LAUNCHES), 0.0)
        op = memory_op(fwd * 2.0 * spec.dtype_bytes * np.asarray(b, dtype=np.float64) * c * spec.d_kv_attn)
        return dataclasses.replace(op, bwd_factor=bwd / fwd, launches=launches)

    def evaluate(self, b, s, c) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        b, s, c = (np.asarray(x, dtype=np.float64) for x in np.broadcast_arrays(b, s, c))
        m, spec = self.model, self.model.spec
        p, d, a, h, kv = spec.dtype_bytes, spec.d_model, spec.d_attn, spec.num_heads, spec.d_kv_attn  # kv: K/V width (GQA)
        keys = self.keys(s, c)
        time = np.zeros_like(s)
        stored = np.zeros_like(s)
        peak = np.zeros_like(s)
        num_blocks = 0
        for kind, count in self._counts:
            if kind in SLICE_BLOCKS:  # a whole block: both halves; a half (gpt_attn / gpt_mlp): its own
                attends, mlp = kind != "gpt_mlp", kind != "gpt_attn"
                ops = self._block_ops(kind, b, s, c)
                fwd = sum(m._op_time(op) for op in ops)
                bwd = sum(m._op_time(op) * op.bwd_factor for op in ops)
                st = (2 if kind == "gpt" else 1) * m._norm_bytes() * b * s * d  # each half's norm input
                transient = []
                if attends:
                    st = st + m._attention_stored(b, s, keys) - 2 * p * b * (keys - s) * kv
                    if m.fused_memory:
                        transient.append(p * b * (s * a + 2 * keys * kv) + 4 * b * h * s)
                    else:
                        transient.append(2 * p * b * h * s * keys)
                if mlp:
                    st = st + m._ffn_stored(b, s)
                    transient.append((3 if spec.gated_ffn else 2) * p * b * s * spec.d_ff)
                pk = 2 * p * b * s * d + (np.maximum(*transient) if len(transient) == 2 else transient[0])
                if m.recompute:
                    bwd = bwd + fwd
                    pk = pk + st
                    st = m._residual_bytes() * b * s * d
                num_blocks += count * attends
            else:
                cost = m.layer_cost(kind, b, s)
                fwd, bwd, st, pk = cost.fwd_time_s, cost.bwd_time_s, cost.stored_activation_bytes, cost.peak_extra_bytes
            time = time + count * (fwd + bwd)
            stored = stored + count * st
            peak = np.maximum(peak, pk)
        peak = peak + num_blocks * 2 * p * b * c * kv
        return time, stored, peak

    def context_kv_bytes(self, b, c) -> np.ndarray:
        """Keys and values of ``c`` context tokens over the stage's blocks: what the runtime's attention
        saves once more per slice (it concatenates context and own keys/values, then keeps the result for
        its backward), on top of :meth:`evaluate`'s stored bytes, which count a cache appended in place."""
        b, c = (np.asarray(x, dtype=np.float64) for x in np.broadcast_arrays(b, c))
        spec = self.model.spec
        blocks = sum(n for kind, n in self._counts if kind in CAUSAL_ATTENTION_KINDS)
        return blocks * 2.0 * spec.dtype_bytes * b * c * spec.d_kv_attn

    def held_bytes(self, b, s, c) -> np.ndarray:
        """What the runtime holds for a slice until its backward besides :meth:`evaluate`'s stored bytes: its
        in-flight buffers (:attr:`buffer_bytes_per_token`) and the concatenated context keys/values
        (:meth:`context_kv_bytes`); the planner's memory bound (:func:`plan_slices`) and the validator's
        (:func:`slice_stage_costs`) both count them."""
        b, s, c = (np.asarray(x, dtype=np.float64) for x in np.broadcast_arrays(b, s, c))
        return self.buffer_bytes_per_token * b * s + self.context_kv_bytes(b, c)

    def fwd_flops(self, b, s, c) -> np.ndarray:
        """Forward GEMM and attention-core FLOPs of the stage on the slice (the analytic model's accounting)."""
        b, s, c = (np.asarray(x, dtype=np.float64) for x in np.broadcast_arrays(b, s, c))
        m = self.model
        total = np.zeros_like(s)
        for kind, count in self._counts:
            if kind in SLICE_BLOCKS:
                total = total + count * sum(op.flops for op in self._block_ops(kind, b, s, c))
            else:
                total = total + count * m.layer_cost(kind, b, s).fwd_flops
        return total


def slice_stage_costs(costs: "StageCosts", slice_model: SliceCostModel, b, s, c, *,
                      memory_only: bool = False) -> "StageCosts":
    """Per-stage costs of token slices for the runtime's schedule and memory checks: the unsliced costs
    of ``(b, s)`` (``costs``, every micro-batch) scaled, where ``c > 0``, by the slice cost model's ratio
    ``t(b, s, c) / t(b, s, 0)`` for times (each stage's own where the model gives them,
    ``stage_time_ratios``, else the bottleneck stage's) and stored bytes, plus the carried keys/values: the context's
    key/value gradients in the peak, and, when the model says (``context_kv_bytes``), the concatenated
    context keys/values each slice's attention keeps for its backward in the stored bytes (the
    bottleneck stage's, on every stage: the safe side). Ordinary micro-batches (``c = 0``) keep their costs.
    ``memory_only``: the caller reads the bytes alone (or prices the times itself, :func:`piece_costs`), and
    times keep the bottleneck stage's ratio (the per-stage ratios price every stage twice, which the memory
    bounds of every candidate slice would pay for nothing)."""

    if slice_model is None:
        raise ValueError("token slices need a slice cost model (slice_long)")
    bi, si, ci = (np.asarray(x, dtype=np.int64) for x in (b, s, c))
    t1, st1, pk1 = slice_model.evaluate(bi, si, ci)
    t0, st0, pk0 = slice_model.evaluate(bi, si, np.zeros_like(ci))
    time_ratio = np.where(t0 > 0, t1 / np.maximum(t0, 1e-30), 1.0)  # (M,): the bottleneck stage's
    per_stage = None if memory_only else getattr(slice_model, "stage_time_ratios", None)
    ratios = per_stage(bi, si, ci) if per_stage is not None else None
    if ratios is not None and ratios.shape == costs.fwd_s.shape:  # (S, M): each stage its own
        time_ratio = ratios
    stored_ratio = np.where(st0 > 0, st1 / np.maximum(st0, 1e-30), 1.0)
    kv = getattr(slice_model, "context_kv_bytes", None)
    copies = kv(bi, ci) if kv is not None else 0.0
    return StageCosts(
        fwd_s=costs.fwd_s * time_ratio,
        bwd_s=costs.bwd_s * time_ratio,
        stored_bytes=costs.stored_bytes * stored_ratio + copies,
        peak_bytes=costs.peak_bytes + np.maximum(pk1 - pk0, 0.0),
        send_bytes=costs.send_bytes,
        recompute=costs.recompute,
        load_bytes=costs.load_bytes,
    )


def piece_costs(stage_model, slice_model, shapes, contexts, links, pairs=None,
                moves: np.ndarray | str | None = "stage_sums") -> "StageCosts":
    """Per-stage costs of one replica's micro-batches of padded ``shapes`` ``(M, 3)`` under ``stage_model`` (a
    :class:`~dynabatch.cost.stages.StageCostModel`); with slice ``links``, later slices priced with their
    ``contexts`` (:func:`slice_stage_costs`); ``pairs`` (:class:`~dynabatch.cost.pairs.AttentionPairs`, (M,))
    prices per-segment attention. What the trainer's planner and ``dynabatch simulate`` price a step with.

    Moving stage boundaries (:attr:`StageCostModel.moving_boundaries <dynabatch.cost.stages.StageCostModel.
    moving_boundaries>`): a chooser's name (:data:`~dynabatch.plan.boundary_choice.MOVE_CHOOSERS`, default
    ``"stage_sums"``) picks each micro-batch's side of every boundary the layout lets a unit cross (the slices of a
    chain on one row) and returns the costs with those moves (:attr:`StageCosts.moves`); an ``(M, S - 1)`` array
    prices those moves (another model's choice: what the step runs); ``None`` prices the layout's cuts
    (micro-batches of several replicas priced in one call, each replica's moves chosen after,
    :func:`~dynabatch.plan.boundary_choice.with_moves`). A model without moving boundaries ignores a chooser's
    name."""
    arr = np.asarray(shapes, dtype=np.float64).reshape(-1, 3)
    contexts = np.asarray(contexts, dtype=np.float64).reshape(-1)
    costs = stage_model.per_stage(arr[:, 0], arr[:, 1], arr[:, 2], pairs)
    timed_pairs = pairs
    if links:
        keys = getattr(slice_model, "keys", None)
        priced = pairs is not None and keys is not None
        costs = slice_stage_costs(costs, slice_model, arr[:, 0], arr[:, 1], contexts, memory_only=priced)
        if priced:  # times from the slices' own score pairs; memory as scaled above (score bytes counted once)
            timed_pairs = slice_context_pairs(pairs, arr, contexts, keys)
            timed = stage_model.per_stage(arr[:, 0], arr[:, 1], arr[:, 2], timed_pairs)
            ratios = getattr(slice_model, "context_time_ratios", None)
            passes = ratios(arr[:, 0], arr[:, 1], contexts) if ratios is not None else None
            scale = passes if passes is not None and passes.shape == timed.fwd_s.shape else 1.0
            costs = dataclasses.replace(costs, fwd_s=timed.fwd_s * scale, bwd_s=timed.bwd_s * scale)
    if moves is None or (isinstance(moves, str) and not getattr(stage_model, "moving_boundaries", False)):
        return costs
    return with_moves(stage_model, costs, arr, timed_pairs, links, moves)


def slice_context_pairs(pairs, shapes: np.ndarray, contexts: np.ndarray, keys):
    """``pairs`` with each token slice's score pairs counted with its context: ``b s keys(s, c)`` for ``s``
    tokens after ``c`` (:meth:`AnalyticSliceCostModel.keys`: ``2c + s`` where whole samples run causal kernels,
    the causal share in the full-square units whole samples are counted in, so a sample's slices add up to
    its whole count; ``c + s`` on the dense path). The stage model then prices their attention with its own
    (calibrated) per-pair cost, not the analytic model's weighting. Pieces with ``c = 0`` keep their pairs."""
    b, s = shapes[:, 0], shapes[:, 1]
    sliced = contexts > 0
    encoder = np.where(sliced, b * s * keys(s, contexts), np.asarray(pairs.encoder, dtype=np.float64))
    return dataclasses.replace(pairs, encoder=encoder)
