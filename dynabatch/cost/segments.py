"""Per-segment (padding-free) attention on profiled tables.

A profile with attention cores (:mod:`dynabatch.cost.attention_cores`) prices a block whose attention
computes ``P`` score pairs (:class:`~dynabatch.cost.pairs.AttentionPairs`) as

    block(b, E, P) = block(b, E) - core(b, E) + core_eq(P)

for forward time, backward time and stored bytes, and likewise for the block's transient (``peak -
stored``). ``core_eq`` is the core table at the *equivalent dense shape*: as many queries and keys as the
micro-batch and exactly ``P`` pairs. For self-attention over ``n = b T`` tokens that is ``b' = n^2 / P``
rows of ``L = P / n`` tokens (the pair-weighted mean segment length: 32 segments of 64 tokens in one
2048-token row are priced as ``core(32, 64)``); for cross-attention with ``b D`` queries and ``b E`` keys,
``b' = b^2 D E / P`` rows of ``D' = P / (b E)`` queries and ``E' = P / (b D)`` keys. The table's own
scheme then carries both the per-token terms (reading Q, K, V) and the per-pair ones (scores, softmax),
which a plain density factor would scale together. Beyond the grid's largest ``b`` the core is
extrapolated linearly from the last two ``b`` (the tables' own affine reading along ``b``); lengths below the grid are clamped up (an upper
bound, as everywhere in the tables), keeping the token count; where the equivalent shape falls in an
unprofiled cell the core is scaled by the density ``P / (b Tq Tk)``. A core with fewer pairs is never
priced above the dense one (the change is clipped at 0), and results are clipped at 0.

With ``pairs.calls`` (one SDPA call per group of equal-length segments) each call beyond the first adds
the core's fixed per-call cost, read off the table as its intercept along ``b`` at the shortest lengths.

The per-stage context kinds (masks, T5's position bias: ``*_context``) are looked up at one row of the
micro-batch's longest segment when the pairs know it (:attr:`AttentionPairs.longest`): the padding-free
stages build the bias for the longest segment, and their per-group masks are small. Without it they keep
the dense shape, an upper bound. Profiles without cores price pairs as dense. These are
Python-level numpy passes over the stage kernels (``_kernels._stage_cost_many``), one per layer kind:
meant for pricing planned micro-batches (simulation, the packing planner), not the partition DP's fused
dense lookups, which are unchanged.
"""

from __future__ import annotations

import numpy as np

from dynabatch.cost import _kernels
from dynabatch.cost.pairs import AttentionPairs
from dynabatch.cost.tables import CostTables, StageSpec


def attention_cores(tables: CostTables) -> dict[str, dict[str, str]]:
    """``{block kind: {role: core kind}}`` recorded by the profile (empty for profiles without cores)."""
    cores = (tables.meta.get("model") or {}).get("attention_cores") or {}
    return {block: dict(roles) for block, roles in cores.items()
            if block in tables.kinds and all(k in tables.kinds for k in roles.values())}


def kind_values(tables: CostTables, kind: str, b, e, d) -> np.ndarray:
    """(4, n) forward s, backward s, stored bytes and peak bytes (peak includes stored) of one ``kind``
    layer at each shape of the float64 arrays ``b, e, d``; ``+inf`` where the tables cannot answer."""
    a = tables.kernel_arrays()
    cnt = tables.stage_counts(StageSpec.of(**{kind: 1}))
    out = np.empty((4, b.size))
    _kernels._stage_cost_many(a.axis_b, a.axis_e, a.axis_d, a.tab_be, cnt[0], a.tab_bd, cnt[1], a.tab_bed, cnt[2],
                              np.ascontiguousarray(b, dtype=np.float64), np.ascontiguousarray(e, dtype=np.float64),
                              np.ascontiguousarray(d, dtype=np.float64), out)
    return out


def equivalent_shape(role: str, b, e, d, pairs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The dense ``(b', E', D')`` with the micro-batch's queries, keys and exactly ``pairs`` pairs for an
    attention core of ``role`` (``encoder``, ``decoder`` or ``cross``; module docstring)."""
    b, e, d = (np.asarray(x, dtype=np.float64) for x in (b, e, d))
    if role == "encoder":
        n = b * e
        p = np.clip(pairs, 1.0, n * e)
        return n * n / p, p / n, d
    if role == "decoder":
        n = b * d
        p = np.clip(pairs, 1.0, n * d)
        return n * n / p, e, p / n
    if role == "cross":
        nq, nk = b * d, b * e
        p = np.clip(pairs, 1.0, nq * e)
        return nq * nk / p, p / nq, p / nk
    raise ValueError(f"unknown attention role {role!r}; valid: encoder, decoder, cross")


def _dense_pairs(role: str, b, e, d) -> np.ndarray:
    return {"encoder": b * e * e, "decoder": b * d * d, "cross": b * d * e}[role]


def core_delta(tables: CostTables, core: str, role: str, b, e, d, pairs: AttentionPairs) -> np.ndarray:
    """(4, n) change of forward s, backward s, stored bytes and transient bytes when one block's ``role``
    core computes ``pairs`` instead of the dense pairs of ``(b, e, d)``."""
    dense = kind_values(tables, core, b, e, d)
    dense[3] -= dense[2]  # transient
    p, calls = pairs.role(role)
    p_dense = _dense_pairs(role, b, e, d)
    bq, eq, dq = equivalent_shape(role, b, e, d, p)
    # lengths below the grid: clamped up with the tokens kept (more pairs: an upper bound)
    e_c, d_c = np.maximum(eq, tables.axis_e[0]), np.maximum(dq, tables.axis_d[0])
    shrink = {"encoder": eq / e_c, "decoder": dq / d_c, "cross": np.minimum(eq / e_c, dq / d_c)}[role]
    ours = _along_b(tables, core, bq * shrink, e_c, d_c)
    density = np.divide(p, p_dense, out=np.ones_like(p), where=p_dense > 0)
    bad = ~np.isfinite(ours).all(axis=0)
    ours[:, bad] = dense[:, bad] * np.minimum(density[bad], 1.0)
    ours[:, p <= 0] = 0.0
    delta = np.minimum(ours - dense, 0.0)  # fewer pairs never cost more than the dense core
    delta[:, p >= p_dense] = 0.0  # dense already: no change (and no interpolation noise)
    if calls is not None:  # every further call pays the core's fixed cost again
        delta[:2] += np.maximum(calls - 1.0, 0.0) * call_cost(tables, core)[:, None]
    return delta


def call_cost(tables: CostTables, core: str) -> np.ndarray:
    """(2,) forward and backward seconds one call of ``core`` costs beyond its work: the table's intercept
    along ``b`` at the shortest lengths, ``2 core(1) - core(2)`` (0 when the table shows none)."""
    b = tables.axis_b[:2].astype(np.float64)
    one = np.ones(2)
    v = kind_values(tables, core, b, one * tables.axis_e[0], one * tables.axis_d[0])
    slope = (v[:2, 1] - v[:2, 0]) / (b[1] - b[0])
    return np.maximum(v[:2, 0] - slope * b[0], 0.0)


def _along_b(tables: CostTables, core: str, b, e, d) -> np.ndarray:
    """(4, n) forward, backward, stored and transient bytes of ``core`` at ``(b, e, d)``; beyond the grid's
    largest ``b`` extrapolated linearly from its last two ``b`` (the tables' affine-in-``b`` reading)."""
    axis = tables.axis_b
    top, prev = float(axis[-1]), float(axis[-2])
    inside = np.minimum(b, top)
    out = kind_values(tables, core, inside, e, d)
    over = b > top
    if over.any():
        low = kind_values(tables, core, np.full(int(over.sum()), prev), e[over], d[over])
        slope = (out[:, over] - low) / (top - prev)
        out[:, over] += slope * (b[over] - top)
    out[3] -= out[2]
    return out


def stage_cost_pairs(tables: CostTables, stage: StageSpec, b, e, d, pairs: AttentionPairs) -> np.ndarray:
    """(4, n) ``CostTables.stage_cost`` numbers (fwd s, bwd s, stored bytes, peak bytes including stored)
    of ``stage`` for micro-batches whose attention computes ``pairs``; ``+inf`` columns are infeasible."""
    counts = tables.stage_counts(stage)  # validates kinds
    a = tables.kernel_arrays()
    names = (*a.kinds_be, *a.kinds_bd, *a.kinds_bed)
    count = dict(zip(names, np.concatenate(counts).tolist()))
    cores = attention_cores(tables)
    b, e, d = (np.ascontiguousarray(np.asarray(x, dtype=np.float64).ravel()) for x in (b, e, d))
    pairs = pairs.map(lambda x: np.ascontiguousarray(np.broadcast_to(x, b.shape).ravel()))
    fwd, bwd, stored, transient = (np.zeros(b.size) for _ in range(4))
    with np.errstate(invalid="ignore"):  # shapes off the grid are inf (inf - inf = nan): infeasible, below
        for kind in names:
            c = count[kind]
            if c == 0:
                continue
            v = kind_values(tables, kind, *_lookup_shape(kind, b, e, d, pairs))
            v[3] -= v[2]  # transient
            for role, core in cores.get(kind, {}).items():
                v += core_delta(tables, core, role, b, e, d, pairs)
            np.maximum(v, 0.0, out=v)
            fwd, bwd, stored = fwd + c * v[0], bwd + c * v[1], stored + c * v[2]
            transient = np.maximum(transient, v[3])
    out = np.stack([fwd, bwd, stored, stored + transient])
    out[:, ~np.isfinite(out).all(axis=0)] = np.inf
    return out


def _lookup_shape(kind: str, b, e, d, pairs: AttentionPairs):
    """Where the tables are read for ``kind``: a context kind at one row of the longest segment (module
    docstring), every other kind at the micro-batch's shape."""
    if pairs.longest is None or not kind.endswith("_context"):
        return b, e, d
    longest_e, longest_d = (np.ascontiguousarray(np.maximum(x, 1.0)) for x in pairs.longest)
    return np.ones_like(b), np.minimum(longest_e, e), np.minimum(longest_d, np.maximum(d, 1.0))


def bottleneck_costs_pairs(tables: CostTables, stages, b, e, d, pairs: AttentionPairs):
    """``(time_s, stored_bytes, transient_bytes)`` of the bottleneck over ``stages`` (``StageSpec`` list), as
    ``_kernels._evaluate_stages`` reduces them, for micro-batches with attention ``pairs``; shaped like ``b``,
    ``+inf`` where infeasible."""
    shape = np.shape(b)
    per_stage = [stage_cost_pairs(tables, s, b, e, d, pairs) for s in stages]  # each (4, n)
    t = np.max([c[0] + c[1] for c in per_stage], axis=0)
    stored = np.max([c[2] for c in per_stage], axis=0)
    with np.errstate(invalid="ignore"):  # inf - inf on infeasible shapes, set to inf below
        transient = np.max([c[3] - c[2] for c in per_stage], axis=0)
    bad = ~np.isfinite(t)
    for x in (stored, transient):
        x[bad] = np.inf
    return tuple(x.reshape(shape) for x in (t, stored, transient))
