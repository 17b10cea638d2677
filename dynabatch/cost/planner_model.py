"""Profiled cost tables behind the planner's and the stage layer's interfaces.

``ProfiledLayerModel(tables)`` speaks the layer-level protocol of ``dynabatch.cost.stages`` (the one
``AnalyticCostModel`` implements: ``stage_cost(kinds, b, E, D)``, ``send_bytes``, ``param_count``,
``model_state_bytes``, ``layer_kinds``), so ``balanced_layout`` and ``StageCostModel`` run on measured
tables. Its kinds map to profiled kinds: ``embedding`` -> the (encoder) embedding, ``gpt`` /
``t5_encoder`` / ``t5_decoder`` -> blocks, ``decoder_embedding`` -> the decoder embedding plus the
encoder's final norm (both sit between the stacks), ``lm_head`` -> the head; a stage with blocks of a
stack also pays that stack's context kind once.

The planner's view, per padded shape, is the bottleneck over the pipeline stages: the largest forward +
backward time, the largest stored activation bytes and the largest transient bytes, each maximised
separately (a conservative reading when different stages are the bottleneck for time and memory); p2p
time is not included. One numba kernel (``_kernels._evaluate_stages``) loops over shapes and stages,
and :func:`bottleneck_costs` wraps it for both entry points:
``StageCostModel(ProfiledLayerModel(tables), layout, device_memory).evaluate`` (stages in layer kinds,
budget from device memory less model states) and ``ProfiledCostModel(tables, stages,
memory_budget_bytes).evaluate`` (stages as profiled ``StageSpec``, budget given).

Per-segment attention: every entry point takes an optional ``pairs``
(:class:`~dynabatch.cost.pairs.AttentionPairs`); with a profile that has attention cores the blocks'
attention is then priced by its pairs (:mod:`dynabatch.cost.segments`), without it exactly as before.

Peak convention: the tables' (and ``CostTables.stage_cost``'s) peak bytes *include* the stored bytes
(``stored + largest per-kind transient``); the planner's and the stage layer's third number
(``peak_extra_bytes``, ``StageCosts.peak_bytes``) is the transient *on top* of the stored bytes,
``peak - stored``.

The planner requires finite outputs, so shapes the tables cannot answer -- beyond the grid, or in a
cell that was not profiled or ran out of memory -- get ``INFEASIBLE`` (1e30) for time and bytes: far
over any memory budget, so the planner drops those runs. Costs stay non-decreasing because the missing
cells always dominate the profiled ones (``max_tokens`` cap and out-of-memory are monotone).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynabatch.cost import _kernels
from dynabatch.cost.segments import bottleneck_costs_pairs, stage_cost_pairs
from dynabatch.cost.tables import GPT2_ANALYTIC_KINDS, T5_ANALYTIC_KINDS, CostTables, StageSpec, model_state_bytes
from dynabatch.core.sequence import is_seq2seq

INFEASIBLE = 1e30
"""Finite stand-in for ``+inf`` (the planner rejects non-finite costs)."""
UNPRICED = 1e20
"""Any time or byte count at or above this came from an ``INFEASIBLE`` price (sums, shares and unit changes of
it included): no real step takes 1e20 seconds or bytes."""


def bottleneck_costs(tables: CostTables, counts, b, e, d, pairs=None, stages=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(time_s, stored_bytes, transient_bytes)`` of the bottleneck over the stages whose kind counts are
    ``counts`` (from :func:`stage_count_arrays`), shaped like ``b``; ``e`` and ``d`` hold as many queries.
    Infeasible shapes get ``INFEASIBLE`` in all three. ``pairs`` (per-segment attention work, with the
    ``StageSpec`` list ``stages``) takes the numpy path of :mod:`dynabatch.cost.segments`."""
    shape = np.shape(b)
    b, e, d = (np.ascontiguousarray(np.asarray(x, dtype=np.float64).ravel()) for x in (b, e, d))
    if not is_seq2seq(tables.family):
        d = np.ones_like(d)
    if pairs is not None:
        out = bottleneck_costs_pairs(tables, stages, b, e, d, pairs.map(lambda x: np.broadcast_to(x, shape).ravel()))
        return tuple(np.where(np.isfinite(o), o, INFEASIBLE).reshape(shape) for o in out)
    cnt_be, cnt_bd, cnt_bed = counts
    a = tables.kernel_arrays()
    out = [np.empty_like(b) for _ in range(3)]
    _kernels._evaluate_stages(a.axis_b, a.axis_e, a.axis_d, a.tab_be, cnt_be, a.tab_bd, cnt_bd, a.tab_bed,
                              cnt_bed, b, e, d, *out)
    return tuple(np.where(np.isfinite(o), o, INFEASIBLE).reshape(shape) for o in out)


def stage_count_arrays(tables: CostTables, stages) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(num_stages, num_kinds) count arrays per kernel table (``_evaluate_stages``' ``cnts_*``) of the
    ``StageSpec`` list ``stages``; validates kinds."""
    counts = [tables.stage_counts(s) for s in stages]
    return tuple(np.ascontiguousarray(np.stack(c)) for c in zip(*counts))


@dataclass(frozen=True)
class ProfiledCostModel:
    """Bottleneck-stage costs of micro-batch shapes from profiled tables, for given stages and budget.

    The same numbers as ``StageCostModel(ProfiledLayerModel(tables), layout, ...).evaluate`` for the
    equivalent layout (one code path, :func:`bottleneck_costs`); this one takes the stages as profiled
    ``StageSpec`` objects and the activation budget directly.
    """

    tables: CostTables
    stages: tuple[StageSpec, ...]
    """The pipeline's stages, first to last (e.g. from ``CostTables.stage_spec``)."""
    memory_budget_bytes: float
    """Activation memory per stage: device memory minus model states minus a margin."""

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("need at least one stage")
        if not (self.memory_budget_bytes > 0 and np.isfinite(self.memory_budget_bytes)):
            raise ValueError(f"memory_budget_bytes must be finite and > 0, got {self.memory_budget_bytes}")
        object.__setattr__(self, "_counts", stage_count_arrays(self.tables, self.stages))  # validates kinds

    @classmethod
    def even_split(cls, tables: CostTables, num_stages: int, memory_budget_bytes: float) -> "ProfiledCostModel":
        """Blocks split as evenly as possible over ``num_stages`` stages (earlier stages get the extra block)."""
        total = sum(tables.num_layers)
        if not 1 <= num_stages <= total:
            raise ValueError(f"num_stages must be in [1, {total}], got {num_stages}")
        bounds = [round(i * total / num_stages) for i in range(num_stages + 1)]
        return cls(tables, tuple(tables.stage_spec(a, z) for a, z in zip(bounds, bounds[1:])), memory_budget_bytes)

    def evaluate(self, b, E, D, pairs=None):  # noqa: N803 - planner's names
        """``(time_s, stored_bytes, transient_bytes)`` float64 arrays shaped like ``b``; ``pairs``: per-segment
        attention work (:mod:`dynabatch.cost.segments`), ``None`` dense."""
        if not (np.size(b) == np.size(E) == np.size(D)):
            raise ValueError(f"b, E, D must have one shape, got {np.shape(b)}, {np.shape(E)}, {np.shape(D)}")
        return bottleneck_costs(self.tables, self._counts, b, E, D, pairs, self.stages)


_LEGACY_KINDS = {
    "causal": (GPT2_ANALYTIC_KINDS, {"gpt": "gpt2_context"}),
    "seq2seq": (T5_ANALYTIC_KINDS, {"t5_encoder": "t5_encoder_context", "t5_decoder": "t5_decoder_context"}),
}
"""Analytic -> profiled kinds of profiles that do not record them (GPT-2 and T5 profiles)."""


def _kind_mapping(tables: CostTables) -> tuple[dict, dict]:
    """(analytic kind -> profiled kinds, block kind -> per-stage context kind) of a profile."""
    model = tables.meta.get("model") or {}
    if model.get("analytic_kinds"):
        return {k: tuple(v) for k, v in model["analytic_kinds"].items()}, dict(model.get("context_kinds") or {})
    return _LEGACY_KINDS[tables.family]


@dataclass(frozen=True)
class LayerModelCost:
    """Costs in the field names of ``dynabatch.cost.stages`` (floats for scalar queries, else arrays)."""

    fwd_time_s: object
    bwd_time_s: object
    stored_activation_bytes: object
    peak_extra_bytes: object
    """Transient bytes above the stored ones (``peak - stored``)."""


@dataclass(frozen=True)
class ProfiledLayerModel:
    """Profiled tables as a layer-level cost model for ``balanced_layout`` / ``StageCostModel``."""

    tables: CostTables

    def layer_kinds(self) -> list[str]:
        n_enc, n_dec = self.tables.num_layers
        if not is_seq2seq(self.tables.family):
            return ["embedding", *["gpt"] * n_enc, "lm_head"]
        return ["embedding", *["t5_encoder"] * n_enc, "decoder_embedding", *["t5_decoder"] * n_dec, "lm_head"]

    def spec(self, kinds) -> StageSpec:
        """The profiled ``StageSpec`` of a stage given in analytic kind names."""
        mapping, context = _kind_mapping(self.tables)
        counts: dict[str, int] = {}
        for kind in kinds:
            if kind not in mapping:
                raise ValueError(f"unknown layer kind {kind!r}; valid for {self.tables.family}: {sorted(mapping)}")
            for name in mapping[kind] + ((context[kind],) if kind in context else ()):
                counts[name] = counts.get(name, 0) + 1
        counts.update({c: 1 for c in context.values() if c in counts})  # once per stage
        return StageSpec.of(**counts)

    def stage_cost(self, kinds, b, E, D=None, pairs=None) -> LayerModelCost:  # noqa: N803
        """Vectorised stage cost; infeasible shapes get ``INFEASIBLE``. ``pairs``: per-segment attention
        work (:mod:`dynabatch.cost.segments`), ``None`` dense."""
        scalar = all(np.ndim(x) == 0 for x in (b, E, D) if x is not None)
        b, e, d = np.broadcast_arrays(*(np.asarray(1.0 if x is None else x, dtype=np.float64) for x in (b, E, D)))
        shape = b.shape
        if pairs is not None:
            out = stage_cost_pairs(self.tables, self.spec(kinds), b, e, d, pairs.broadcast_to(shape))
        else:
            cnt = self.tables.stage_counts(self.spec(kinds))
            a = self.tables.kernel_arrays()
            out = np.empty((4, b.size))
            _kernels._stage_cost_many(a.axis_b, a.axis_e, a.axis_d, a.tab_be, cnt[0], a.tab_bd, cnt[1], a.tab_bed,
                                      cnt[2], np.ascontiguousarray(b.ravel()), np.ascontiguousarray(e.ravel()),
                                      np.ascontiguousarray(d.ravel()), out)
        out = np.where(np.isfinite(out), out, INFEASIBLE)
        fwd, bwd, stored, peak = (x.reshape(shape) for x in out)
        vals = (fwd, bwd, stored, np.where(stored >= INFEASIBLE, INFEASIBLE, peak - stored))
        return LayerModelCost(*(float(v) if scalar else v for v in vals))

    def bottleneck_cost(self, stages, b, E, D=None, pairs=None):  # noqa: N803
        """``StageCostModel.evaluate``'s planner view in one kernel pass: ``(time_s, stored_bytes,
        transient_bytes)`` of the bottleneck over ``stages`` (each a list of layer kinds), broadcast shapes;
        ``pairs``: per-segment attention work (numpy path)."""
        b, e, d = np.broadcast_arrays(*(np.asarray(1.0 if x is None else x, dtype=np.float64) for x in (b, E, D)))
        specs = [self.spec(s) for s in stages]
        counts = stage_count_arrays(self.tables, specs)
        return bottleneck_costs(self.tables, counts, b, e, d, pairs, specs)

    def send_bytes(self, last_kind: str, b, E, D=None):  # noqa: N803
        """Bytes a stage ending in ``last_kind`` sends on: hidden states of E tokens, E + D once the decoder
        has started, none after the head (profile dtype and d_model)."""
        cfg = self.tables.meta.get("config", {})
        d_model = (self.tables.meta.get("model") or {}).get("d_model") or cfg.get("d_model") or cfg.get("n_embd")
        if not d_model:
            raise ValueError("the profile's model config has no d_model / n_embd")
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[self.tables.meta["model"].get("dtype", "float32")]
        b, E = np.asarray(b, dtype=np.float64), np.asarray(E, dtype=np.float64)
        D = np.zeros_like(E) if D is None else np.asarray(D, dtype=np.float64)
        tokens = {"lm_head": 0.0 * E, "decoder_embedding": E + D, "t5_decoder": E + D}.get(last_kind, E)
        out = dtype_bytes * b * tokens * d_model
        return float(out) if np.ndim(out) == 0 else out

    def param_count(self, kind: str) -> int:
        return self.tables.stage_params(self.spec([kind]))

    def model_state_bytes(self, num_params, optimizer: str = "adam") -> float:
        return float(model_state_bytes(int(num_params), optimizer))
