"""Pipeline stages from a layer-level cost model: the stages' layer kinds (:class:`StageLayout`, cut by
:mod:`dynabatch.cost.layer_split`) and their per-micro-batch costs.

:class:`StageCostModel`
then answers, for arrays of padded shapes ``(b, E, D)``, every stage's forward/backward time, stored
and peak activation bytes and the bytes it sends downstream (:meth:`per_stage`, for the simulator),
and the planner's :class:`~dynabatch.plan.costs.MicroBatchCostModel` view (:meth:`evaluate`):
bottleneck-stage fwd + bwd time, and the largest stored / peak bytes of any stage against the
smallest per-stage memory budget (conservative when stages differ).

Both take an optional ``pairs`` (:class:`~dynabatch.cost.pairs.AttentionPairs`): the score pairs of
per-segment (padding-free) attention, passed on to the layer model's ``stage_cost``; without it every
micro-batch is priced with dense ``b x Tq x Tk`` attention, exactly as before.

Any layer-level model with ``stage_cost(kinds, b, E, D)``, ``send_bytes(last_kind, b, E, D)``,
``param_count(kind)``, ``model_state_bytes(n)`` and ``layer_kinds()`` works: the analytic model does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from dynabatch.cost.boundary_moves import boundary_units, held_kinds
from dynabatch.cost.model_states import per_rank_state_bytes
from dynabatch.cost._kernels import _planner_view, _planner_view_plain
from dynabatch.cost.stage_programs import PRICED, Signature, StagePrograms, programs_of, variables
from dynabatch.cost.recompute import RECOMPUTE_MODES, RecomputeTerms, apply_mode, check_policy, choose_modes, select

RECOMPUTE_SUBSET_FITS = 0.5
"""``auto``: when at least this fraction of a call's entries fits without recomputation, the recomputation terms
are priced for the others alone (:meth:`StageCostModel._recomputed_where`; the same values, less work); below it,
gathering and scattering the subset costs more than it saves."""
@dataclass(frozen=True)
class StageLayout:
    """Layer kinds of each pipeline stage, in model order."""

    stages: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if not self.stages or any(len(s) == 0 for s in self.stages):
            raise ValueError(f"every stage needs at least one layer, got {[len(s) for s in self.stages]}")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def describe(self) -> str:
        parts = []
        for s in self.stages:
            counts: dict[str, int] = {}
            for k in s:
                counts[k] = counts.get(k, 0) + 1
            parts.append("+".join(f"{k}x{n}" if n > 1 else k for k, n in counts.items()))
        return " | ".join(parts)


@dataclass(frozen=True)
class StageCosts:
    """Per-stage costs of micro-batches: every array is (S, *shape of the queries)."""

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    stored_bytes: np.ndarray
    peak_bytes: np.ndarray
    send_bytes: np.ndarray
    """Activation bytes stage s sends to stage s + 1 (the gradient coming back is the same size)."""
    recompute: np.ndarray | None = None
    """Activation recomputation each entry is priced with (codes into
    :data:`~dynabatch.schedule.ir.RECOMPUTE_MODES`, :mod:`dynabatch.cost.recompute`); ``None``: none anywhere."""
    load_bytes: np.ndarray | None = None
    """Host inputs a stage loads for the micro-batch (token, segment and position ids, labels), live in its
    buffer slot from ``LOAD`` to ``FREE`` as the validator counts them; ``None``: not priced (0)."""
    moves: np.ndarray | None = None
    """Moving stage boundaries (:mod:`dynabatch.cost.boundary_moves`): ``(M, S - 1)`` ``int8``, each micro-batch's
    side of every boundary, the costs priced with them (:mod:`dynabatch.cost.boundary_prices`); unlike the other
    fields one *row* per micro-batch. ``None``: every micro-batch at the layout's cuts."""


LOAD_BYTES_PER_TOKEN = 4 * 8
"""An upper bound of a stage's loaded inputs per padded token: at most four int64 tensors
(:meth:`~dynabatch.schedule.ir.PipelineSpec.load_tensors`). With one stage there are no messages, and these
are the whole buffer: leaving them out planned a micro-batch 16 kB over a tight budget (found by the H200 runs of 2026-12-04)."""


def in_flight_buffer_bytes(costs: StageCosts) -> np.ndarray:
    """``(S, ...)`` bytes a micro-batch holds in its buffer slot on each stage while in flight: its message
    buffers (:func:`message_buffer_bytes`) and its loaded inputs."""
    buffers = message_buffer_bytes(costs.send_bytes)
    return buffers if costs.load_bytes is None else buffers + costs.load_bytes


@dataclass(frozen=True)
class StageCostModel:
    """Per-stage and bottleneck costs of padded micro-batches for one stage layout."""

    model: object
    """Layer-level cost model (e.g. :class:`~dynabatch.cost.analytic.AnalyticCostModel`)."""
    layout: StageLayout
    device_memory_bytes: float
    """Memory of one device."""
    optimizer: str = "adam"
    memory_margin: float = 0.1
    """Fraction of device memory kept free (allocator fragmentation, workspace)."""
    recompute: str = "none"
    """Activation recomputation policy (:data:`~dynabatch.cost.recompute.RECOMPUTE_POLICIES`): ``none``,
    ``selective`` / ``full`` everywhere, or ``auto``: per micro-batch and stage, the fastest mode that fits
    (:mod:`dynabatch.cost.recompute`). Needs a layer model with ``recompute_terms`` unless ``none``."""
    single_sample_alone: bool = False
    """``auto`` tests one-sample micro-batches as fitting alone (``stored + peak``, no other micro-batch in
    flight) instead of ``S`` in flight: the planner view of ``dynabatch simulate``
    (:class:`~dynabatch.commands.simulate.SingleSampleRelief`), where such a sample runs without recomputation
    whenever it fits alone."""
    zero: int = 0
    """``--zero``: which model states are sharded across the replicas of a stage (:mod:`dynabatch.cost.model_states`)."""
    replicas: int = 1
    """Data-parallel replicas of each stage, over which ``zero`` shards."""
    moving_boundaries: bool = False
    """Stage boundaries that move per micro-batch (:mod:`dynabatch.cost.boundary_moves`, linear layouts): each stage
    holds a copy of the units that may cross its boundaries (their model states count on both stages), and
    :func:`~dynabatch.plan.slice_costs.piece_costs` chooses each micro-batch's side of every boundary."""
    model_state_bytes: tuple[float, ...] = field(init=False)
    """Parameters + gradients + optimizer states of each stage, per rank (the sharded parts divided by ``replicas``)."""
    memory_budget_bytes: float = field(init=False)
    """Activation memory left on the tightest stage."""
    programs: StagePrograms | None = field(init=False, repr=False, compare=False)
    """The layer model's stage costs compiled (:mod:`dynabatch.cost.stage_programs`): a model that shares its layer
    costs over a layout's stages (the analytic model); ``None``: priced by the model's methods."""

    @property
    def equal_micro_batch_counts(self) -> bool:
        """Every replica of a stage must run the same number of micro-batches: ``--zero 2`` reduce-scatters the
        gradients after each micro-batch's backward, a collective the replicas must issue equally often (the
        planner equalizes the counts, :func:`~dynabatch.plan.replicas.equalize_counts`)."""
        return self.zero >= 2 and self.replicas > 1

    def __post_init__(self) -> None:

        check_policy(self.recompute)
        if self.recompute != "none" and not hasattr(self.model, "recompute_terms"):
            raise ValueError(f"--recompute {self.recompute} needs a cost model that prices recomputation; "
                             f"{type(self.model).__name__} does not (use the analytic model, or --recompute none)")

        tied = getattr(self.model, "tied_copy_count", lambda kinds: 0)  # a tied token table's copy on a later stage
        counts = [sum(self.model.param_count(k) for k in s) + tied(s) for s in self._held_stages()]
        states = tuple(per_rank_state_bytes(self.model.model_state_bytes(n, optimizer=self.optimizer), n, self.optimizer,
                                            self.zero, self.replicas) for n in counts)
        object.__setattr__(self, "model_state_bytes", states)
        budget = self.device_memory_bytes * (1 - self.memory_margin) - max(states)
        if budget <= 0:
            worst = int(np.argmax(states))
            raise ValueError(
                f"stage {worst} needs {states[worst] / 2**30:.3f} GiB for model states alone but a device has "
                f"{self.device_memory_bytes / 2**30:.3f} GiB ({self.memory_margin:.0%} kept free); use more stages"
                + (", or shard the states across the replicas (--zero)" if self.zero < 2 else "")
            )
        object.__setattr__(self, "memory_budget_bytes", float(budget))
        programs = programs_of(self.model, self.layout.stages) if getattr(self.model, "shares_layer_costs", False) \
            else None
        object.__setattr__(self, "programs", programs)

    def _held_stages(self) -> tuple[tuple[str, ...], ...]:
        """The layer kinds each stage holds parameters of: its own, and with :attr:`moving_boundaries` the copies of
        the units that may cross its boundaries (:func:`~dynabatch.cost.boundary_moves.held_kinds`)."""
        if not self.moving_boundaries:
            return self.layout.stages
        units = boundary_units(self.layout)
        return tuple(held_kinds(self.layout, s, units) for s in range(self.layout.num_stages))

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    def per_stage(self, b, E, D, pairs=None, modes=None) -> StageCosts:
        """Every stage's costs of micro-batches ``(b, E, D)``; ``pairs``
        (:class:`~dynabatch.cost.pairs.AttentionPairs` shaped like ``b``) prices per-segment attention,
        ``None`` the dense ``b x Tq x Tk``. Activation recomputation as :attr:`recompute` chooses it, or as
        ``modes`` (mode codes broadcast to ``(S, *b.shape)``) says: the costs of a step that ran with them."""
        layers = {} if getattr(self.model, "shares_layer_costs", False) else None
        b, E, D = self._inputs(b, E, D)  # the same arrays for every stage and term (checked once, layers)
        costs = self._priced(b, E, D, pairs, layers)
        if modes is None and self.recompute == "none":
            return costs
        return self._recomputed(costs, b, E, D, pairs, modes, layers)

    def _priced(self, b, E, D, pairs=None, layers: dict | None = None) -> StageCosts:
        """Every stage's costs without recomputation. ``layers``: the layer model's memo of each layer kind's cost
        of these inputs (a model with ``shares_layer_costs``: :meth:`AnalyticCostModel.stage_cost
        <dynabatch.cost.analytic.AnalyticCostModel.stage_cost>`), shared by the stages and the recomputation terms."""
        b, E, D = self._inputs(b, E, D)
        compiled = self._compiled("priced", b, E, D, pairs)
        if compiled is not None:
            return StageCosts(**dict(zip(PRICED, compiled)), load_bytes=self._load_bytes(b, E, D))
        extra = {} if pairs is None else {"pairs": pairs}
        if layers is None and getattr(self.model, "shares_layer_costs", False):
            layers = {}
        if layers is not None:  # a model that shares layer costs: the FLOPs, which StageCosts has not, not summed
            extra.update(layers=layers, flops=False)
        costs = [self.model.stage_cost(list(s), b, E, D, **extra) for s in self.layout.stages]
        return StageCosts(
            fwd_s=_stack((c.fwd_time_s for c in costs), b.shape),
            bwd_s=_stack((c.bwd_time_s for c in costs), b.shape),
            stored_bytes=_stack((c.stored_activation_bytes for c in costs), b.shape),
            peak_bytes=_stack((c.peak_extra_bytes for c in costs), b.shape),
            send_bytes=self._send_bytes(b, E, D, layers),
            load_bytes=self._load_bytes(b, E, D),
        )

    def _recomputed(self, costs: StageCosts, b, E, D, pairs, modes, layers: dict | None = None) -> StageCosts:
        """``costs`` with each entry in its recompute mode (:mod:`dynabatch.cost.recompute`). The layer model's
        terms are scaled like ``costs`` were from the layer model's own numbers (a calibrated model)."""

        if not hasattr(self.model, "recompute_terms"):
            raise ValueError(f"{type(self.model).__name__} does not price activation recomputation")
        bb, EE, DD = self._inputs(b, E, D)
        if modes is not None and not np.any(modes):
            return costs  # every entry ran without recomputation
        fits = None
        if modes is None and self.recompute == "auto":
            fits = self._fits_without_recompute(costs, bb)
            if np.all(fits):
                return costs  # what fits without recomputation stays as it is: the terms are not needed at all
            if bb.ndim == 1 and fits.mean() >= RECOMPUTE_SUBSET_FITS:  # the terms of the entries that need them only
                return self._recomputed_where(costs, bb, EE, DD, pairs, np.flatnonzero(~fits), layers)
        compiled = self._compiled("terms", bb, EE, DD, pairs)
        if compiled is not None:
            terms = RecomputeTerms(**dict(zip(RecomputeTerms.fields(), compiled)))
        else:
            extra = {} if pairs is None else {"pairs": pairs}
            if layers is not None:
                extra["layers"] = layers
            per = [self.model.recompute_terms(list(s), bb, EE, DD, **extra) for s in self.layout.stages]
            terms = RecomputeTerms(**{f: _stack((getattr(t, f) for t in per), bb.shape)
                                      for f in RecomputeTerms.fields()})
        if type(self)._priced is not StageCostModel._priced:  # costs scaled from the layer model's: scale the terms
            raw = StageCostModel._priced(self, b, E, D, pairs, layers)
            time_scale = np.where(raw.fwd_s > 0, costs.fwd_s / np.maximum(raw.fwd_s, 1e-30), 1.0)
            byte_scale = np.where(raw.stored_bytes > 0, costs.stored_bytes / np.maximum(raw.stored_bytes, 1e-30), 1.0)
            terms = RecomputeTerms(**{f: getattr(terms, f) * (time_scale if f.endswith("_s") else byte_scale)
                                      for f in RecomputeTerms.fields()})
        by_mode = [apply_mode(costs, terms, m) for m in range(len(RECOMPUTE_MODES))]
        shape = costs.fwd_s.shape
        if modes is not None:
            codes = np.broadcast_to(np.asarray(modes, dtype=np.int8), shape)
        elif self.recompute == "auto":
            buffers = in_flight_buffer_bytes(costs).max(axis=0)
            in_flight = self._in_flight(bb)
            codes = choose_modes(by_mode, buffers, in_flight, self.memory_budget_bytes)
            # what fits without recomputation under the planner's bound (maxima over stages) stays as it is
            codes = np.where(fits, 0, codes).astype(np.int8)
        else:
            codes = np.full(shape, RECOMPUTE_MODES.index(self.recompute), dtype=np.int8)
        return select(by_mode, codes)

    def _recomputed_where(self, costs: StageCosts, bb, EE, DD, pairs, idx, layers: dict | None) -> StageCosts:  # noqa: N803
        """``auto``'s :meth:`_recomputed` of 1-D entries where only those at ``idx`` do not fit without
        recomputation: the others keep ``costs`` (mode ``none``, as :meth:`_recomputed` leaves them), and the
        recomputation terms and choice are made for ``idx`` alone. Every entry is priced on its own, so the
        values are those of the whole call; on the partition DP's tables most short runs fit and are skipped.
        ``layers``: the layer model's memo of these entries' layer costs, passed on restricted to ``idx``."""
        def take(a):
            return None if a is None else a[:, idx]

        part = StageCosts(*(take(getattr(costs, f.name)) for f in dataclasses.fields(StageCosts)))
        work = None if pairs is None else pairs.broadcast_to(bb.shape)[idx]
        kept = None if layers is None else {
            kind: type(cost)(*(np.asarray(getattr(cost, f.name))[idx] for f in dataclasses.fields(cost)))
            for kind, cost in layers.items() if isinstance(kind, str) and np.ndim(cost.fwd_time_s) == 1}
        sub = self._recomputed(part, bb[idx], EE[idx], None if DD is None else DD[idx], work, None, kept)
        picked = {}
        for name in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes"):
            full = np.array(getattr(costs, name), dtype=np.float64)
            full[:, idx] = getattr(sub, name)
            picked[name] = full
        codes = np.zeros(costs.fwd_s.shape, dtype=np.int8)
        if sub.recompute is not None:
            codes[:, idx] = sub.recompute
        return dataclasses.replace(costs, **picked, recompute=codes if np.any(codes) else None)

    def _compiled(self, what: str, b, E, D, pairs):  # noqa: N803
        """:meth:`StagePrograms.priced <dynabatch.cost.stage_programs.StagePrograms.priced>` (``what="priced"``) or
        ``.terms`` of inputs checked as the model's methods check them; ``None`` without :attr:`programs` or when the
        model cannot be traced."""
        if self.programs is None:
            return None
        b, E, D, pairs = self.model.checked_inputs(b, E, D, pairs)
        return getattr(self.programs, what)(b, E, D, pairs)

    def _in_flight(self, bb):
        """Micro-batches in flight on a stage under ``auto``'s test: ``S``, or 1 for a single sample with
        :attr:`single_sample_alone`."""
        return np.where(bb == 1, 1, self.num_stages) if self.single_sample_alone else self.num_stages

    def _fits_without_recompute(self, costs: StageCosts, bb) -> np.ndarray:
        """Per entry: ``in_flight (max stored + buffers) + max peak <= budget`` with no recomputation (the
        planner's bound, maxima over stages)."""
        buffers = in_flight_buffer_bytes(costs).max(axis=0)
        need = self._in_flight(bb) * (costs.stored_bytes.max(axis=0) + buffers) + costs.peak_bytes.max(axis=0)
        return need <= self.memory_budget_bytes

    def evaluate(self, b, E, D, pairs=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Planner view: (bottleneck fwd + bwd seconds, max stored bytes, max peak bytes) over stages.
        ``pairs``: per-segment attention work as in :meth:`per_stage` (``None``: dense).

        Stored bytes also count the largest stage's message buffers for the micro-batch while it is in
        flight (the activation received and sent, and their gradients: :func:`message_buffer_bytes`), as
        the schedule and the validator count them, so a partition that fits here also fits there (max
        stored + max buffers: the safe side of the largest sum). A layer model with
        ``bottleneck_cost(stages, b, E, D)`` (the profiled tables' fused kernel) answers the rest in one
        call; otherwise it is reduced from :meth:`per_stage`.
        """
        compiled = self._evaluate_compiled(b, E, D, pairs)
        if compiled is not None:
            return compiled
        fused = getattr(self.model, "bottleneck_cost", None)
        if fused is not None and self.recompute == "none":
            t, stored, peak = fused(self.layout.stages, b, E, D, **({} if pairs is None else {"pairs": pairs}))
            inputs = self._inputs(b, E, D)
            buffers = message_buffer_bytes(self._send_bytes(*inputs)) + self._load_bytes(*inputs)
            return t, stored + buffers.max(axis=0), peak
        return self.reduce(self.per_stage(b, E, D, pairs))

    def _evaluate_compiled(self, b, E, D, pairs):  # noqa: N803
        """:meth:`evaluate` through :attr:`programs` (:meth:`evaluate_variables`), ``None`` where that path does not
        apply (no programs, a subclass pricing otherwise, a model not traced)."""
        if not self._compiles():
            return None
        b, E, D = self._inputs(b, E, D)
        b, E, D, pairs = self.model.checked_inputs(b, E, D, pairs)
        signature = Signature.of(D, pairs)
        flat = (b.ravel(), E.ravel(), None if D is None else D.ravel(), None if pairs is None else pairs.ravel())
        out = self.evaluate_variables(variables(*flat, signature), pairs=signature.pairs, calls=signature.calls,
                                      longest=signature.longest)
        return None if out is None else tuple(x.reshape(b.shape) for x in out)

    def _compiles(self) -> bool:
        """Whether :attr:`programs` price this model (a subclass pricing its stages otherwise does not use them)."""
        return self.programs is not None and type(self)._priced is StageCostModel._priced

    def evaluate_variables(self, x: np.ndarray, *, pairs: bool = False, calls: bool = False, longest: bool = False):
        """:meth:`evaluate` of queries given as the columns of ``x``: ``(len(VARIABLES), n)`` float64 rows of
        :data:`~dynabatch.cost.symbolic.VARIABLES` (the decoder row read only by a layout with a decoder; ``pairs``,
        ``calls``, ``longest``: which of those rows the queries have, the others zero), as the planner builds its runs,
        not checked per call. ``None`` where the compiled path does not apply (then :meth:`evaluate`, as in a subclass
        that prices otherwise) or where ``b``, ``E`` or ``D`` is not >= 1 (:meth:`evaluate` says why). One numba pass over the entries (``dynabatch.cost._kernels._planner_view``) makes the recomputation choice
        and :meth:`reduce`, entry by entry (stage by stage where no stage recomputes: ``_planner_view_plain``); under
        ``auto`` the recomputation terms are computed for the entries that do not fit without them only."""
        if type(self).evaluate is not StageCostModel.evaluate or not self._compiles():
            return None
        decoder = self._has_decoder()
        signature = Signature(decoder, pairs, calls, longest)
        b, E, D = x[0], x[1], (x[2] if decoder else None)
        if x.shape[1] and not x[: 3 if decoder else 2].min() >= 1:  # b, E (and D) >= 1; NaN fails too
            return None
        priced = self.programs.rows("priced", x, signature)
        if priced is None:
            return None
        policy = RECOMPUTE_POLICY_CODES[self.recompute]
        load = self._load_row(b, E, D)  # every stage loads the same
        terms = self.programs.rows("terms", x, signature) if policy >= 2 else None
        n = x.shape[1]
        out = [np.empty(n) for _ in range(3)]
        fits = np.empty(n, dtype=np.bool_)
        view = (self.num_stages, self.single_sample_alone, self.memory_budget_bytes, policy, *out, fits)
        if terms is None:
            _planner_view_plain(*priced, load, b, *view)
        else:
            _planner_view(*priced, load, np.arange(n), terms, True, b, *view)
        if policy == 1 and not fits.all():  # auto: the entries that do not fit without recomputation, with terms
            idx = np.flatnonzero(~fits)
            _planner_view(*priced, load, idx, self.programs.rows("terms", x.take(idx, axis=1), signature), True, b, *view)
        return tuple(out)

    def reduce(self, c: StageCosts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The planner view (:meth:`evaluate`) of per-stage costs ``c``: the largest time over the stages, the
        largest stored bytes (+ buffers) and the largest peak, each over the stages (the safe side of the
        largest sum). With a recompute policy, where those maxima do not fit ``S`` in flight the stages chose
        their modes each for its own memory (:mod:`dynabatch.cost.recompute`), and combining the maxima of
        different stages (one that stores much, another that peaks high) would refuse a micro-batch that fits
        on every stage: there stored and peak are the tightest stage's, the one needing the most
        ``S (stored + buffers) + peak``."""
        t = (c.fwd_s + c.bwd_s).max(axis=0)
        buffers = in_flight_buffer_bytes(c).max(axis=0)
        stored, peak = c.stored_bytes.max(axis=0) + buffers, c.peak_bytes.max(axis=0)
        if self.recompute == "none":
            return t, stored, peak
        tight = np.expand_dims(np.argmax(self.num_stages * c.stored_bytes + c.peak_bytes, axis=0), 0)
        over = self.num_stages * stored + peak > self.memory_budget_bytes
        return (t, np.where(over, np.take_along_axis(c.stored_bytes, tight, 0)[0] + buffers, stored),
                np.where(over, np.take_along_axis(c.peak_bytes, tight, 0)[0], peak))

    def _inputs(self, b, E, D):
        """Float arrays ``(b, E, D)``; ``D = None`` for a decoder-only layout (E is the sequence length)."""
        b, E, D = (np.asarray(x, dtype=np.float64) for x in (b, E, D))
        return b, E, (D if self._has_decoder() else None)

    def _has_decoder(self) -> bool:
        return any("t5_decoder" in s for s in self.layout.stages)

    def _load_bytes(self, b, E, D) -> np.ndarray:  # noqa: N803
        """(S, ...) host-input bytes each stage loads (of :meth:`_inputs`' arrays): :meth:`_load_row` on every stage."""
        return _stack([self._load_row(b, E, D)] * self.num_stages, b.shape)

    @staticmethod
    def _load_row(b, E, D) -> np.ndarray:  # noqa: N803
        """Host-input bytes a stage loads per entry (:data:`LOAD_BYTES_PER_TOKEN` a token)."""
        return LOAD_BYTES_PER_TOKEN * (b * (E if D is None else E + D))

    def _send_bytes(self, b, E, D, layers: dict | None = None) -> np.ndarray:
        """(S, ...) activation bytes each stage sends downstream (of :meth:`_inputs`' arrays; ``layers``: the layer
        model's memo of this call, which keeps the checked inputs)."""
        extra = {} if layers is None else {"layers": layers}
        return _stack((self.model.send_bytes(s[-1], b, E, D, **extra) for s in self.layout.stages), b.shape)


RECOMPUTE_POLICY_CODES = {"none": 0, "auto": 1, "selective": 2, "full": 3}
"""``--recompute`` policies as ``_planner_view`` reads them."""


def _stack(values, shape) -> np.ndarray:
    """One float64 row per stage, each broadcast to ``shape`` (written into one array: no broadcast views)."""
    values = list(values)
    out = np.empty((len(values), *tuple(shape)), dtype=np.float64)
    for i, value in enumerate(values):
        out[i] = value
    return out


def message_buffer_bytes(send_bytes) -> np.ndarray:
    """``(S, ...)`` bytes of a micro-batch's message buffers on each stage while it is in flight: the
    activation received from ``s - 1`` and the gradient sent back (``2 send[s - 1]``), the activation
    sent to ``s + 1`` and the gradient received from it (``2 send[s]``)."""
    send = np.asarray(send_bytes, dtype=np.float64)
    received = np.concatenate([np.zeros_like(send[:1]), send[:-1]])
    return 2.0 * (received + send)
