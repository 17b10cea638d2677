"""Cost tables on synthetic profiles: exactness on the grid, monotonicity, out-of-grid rules,
numba kernels against their pure-Python twins, stage composition, model-state bytes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dynabatch.cost import _kernels as K
from dynabatch.cost.planner_model import INFEASIBLE, ProfiledCostModel
from dynabatch.cost.tables import CostTables, StageSpec, model_state_bytes
from reference import cost_reference as ref  # tests/ is on sys.path via its conftest.py

B = [1, 2, 4, 8, 16]
E = [16, 32, 64, 128, 256]
D = [8, 32, 128]
GPT2 = {"gpt2_embedding": ("b", "E"), "gpt2_context": ("b", "E"), "gpt2_block": ("b", "E"), "gpt2_head": ("b", "E")}
T5 = {"t5_encoder_embedding": ("b", "E"), "t5_encoder_context": ("b", "E"), "t5_encoder_block": ("b", "E"),
      "t5_encoder_final": ("b", "E"), "t5_decoder_embedding": ("b", "D"), "t5_decoder_context": ("b", "E", "D"),
      "t5_decoder_block": ("b", "E", "D"), "t5_head": ("b", "D")}


def cost(kind: str, b: float, e: float, d: float) -> tuple[float, float, float, float]:
    """Smooth, monotone synthetic costs: overhead + linear + quadratic terms, distinct per kind."""
    k = 1 + sum(map(ord, kind)) % 7
    n = e + d
    fwd = 1e-4 * k + 1e-6 * k * b * n + 1e-9 * b * (e * e + d * d + e * d)
    bwd = 0.0 if kind.endswith("context") else 2 * fwd
    stored = 1000.0 * k * b * n + 4.0 * b * e * e
    return fwd, bwd, stored, 1.5 * stored + 4096 * k


def synthetic_profile(family: str = "gpt2", fn=cost, max_tokens: float = math.inf, oom_at=None) -> dict:
    kinds = GPT2 if family == "gpt2" else T5
    axes = {"b": B, "E": E, **({"D": D} if family == "t5" else {})}
    layers = {}
    for kind, dims in kinds.items():
        grids = [axes[x] for x in dims]
        shape = tuple(len(g) for g in grids)
        status = np.full(shape, "ok", dtype=object)
        vals = np.full((4, *shape), None, dtype=object)
        for idx in np.ndindex(*shape):
            v = dict(zip(dims, (g[i] for g, i in zip(grids, idx))))
            b, e, d = v["b"], v.get("E", 0), v.get("D", 0)
            if b * max(e, d) > max_tokens or (oom_at is not None and b >= oom_at[0] and max(e, d) >= oom_at[1]):
                status[idx] = "skipped" if b * max(e, d) > max_tokens else "oom"
                continue
            vals[(slice(None), *idx)] = fn(kind, b, e, d)
        layers[kind] = {"dims": list(dims), "num_params": 1000 + len(kind),
                        "tied_params": 500 if ("embedding" in kind or "head" in kind) else 0,
                        "status": status.tolist(), **{m: vals[i].tolist() for i, m in
                                                      enumerate(("fwd_s", "bwd_s", "stored_bytes", "peak_bytes"))}}
    config = ({"n_layer": 4, "n_embd": 64} if family == "gpt2" else
              {"num_layers": 3, "num_decoder_layers": 3, "d_model": 64})
    return {"format": "dynabatch.profile", "version": 1, "num_threads": 1, "axes": axes, "layers": layers,
            "model": {"name": f"{family}-synthetic", "family": family, "dtype": "float32", "config": config},
            "settings": {"max_tokens": max_tokens if math.isfinite(max_tokens) else None},
            "p2p": {"backend": "gloo", "sizes_bytes": [1024, 65536, 1048576], "send_s": [1e-4, 2e-4, 1.2e-3]}}


@pytest.fixture(scope="module", params=["gpt2", "t5"])
def tables(request) -> CostTables:
    return CostTables.from_profile(json.loads(json.dumps(synthetic_profile(request.param))))


def grid_points(t: CostTables, dims):
    axes = {"b": t.axis_b, "E": t.axis_e, "D": t.axis_d}
    for idx in np.ndindex(*(len(axes[x]) for x in dims)):
        v = dict(zip(dims, (axes[x][i] for x, i in zip(dims, idx))))
        yield idx, v["b"], v.get("E", 16.0), v.get("D", 8.0)


def test_exact_on_grid_points(tables):
    for kind, table in tables.kinds.items():
        for idx, b, e, d in grid_points(tables, table.dims):
            got = tables.layer_cost(kind, b, e, d)
            want = table.values[(slice(None), *idx)]
            assert got.fwd_s == want[0] and got.bwd_s == want[1] and got.stored_bytes == want[2]
            assert got.peak_bytes == pytest.approx(want[3], rel=1e-12)


def test_log_log_exact_for_power_laws_and_linear_in_b():
    def power(kind, b, e, d):
        v = (3.0 + 2.0 * b) * e**2 * (d if d else 1.0) ** 1.5
        return v, v, v, v

    t = CostTables.from_profile(synthetic_profile("t5", fn=power))
    rng = np.random.default_rng(0)
    for _ in range(200):
        b, e, d = rng.uniform(1, 16), rng.uniform(16, 256), rng.uniform(8, 128)
        assert t.layer_cost("t5_encoder_block", b, e).fwd_s == pytest.approx((3 + 2 * b) * e**2, rel=1e-9)
        assert t.layer_cost("t5_decoder_block", b, e, d).fwd_s == pytest.approx((3 + 2 * b) * e**2 * d**1.5, rel=1e-9)


def test_interpolation_is_close_for_transformer_like_costs(tables):
    rng = np.random.default_rng(1)
    for _ in range(200):
        b, e, d = rng.uniform(1, 16), rng.uniform(16, 256), rng.uniform(8, 128)
        for kind, tol in (("gpt2_block", 0.05), ("t5_encoder_block", 0.05), ("t5_decoder_block", 0.1)):
            if kind in tables.kinds:  # x2 grid steps; the decoder axis D steps x4
                want = cost(kind, b, e, d if kind.startswith("t5_dec") else 0)
                got = tables.layer_cost(kind, b, e, d)
                assert got.fwd_s == pytest.approx(want[0], rel=tol)
                assert got.stored_bytes == pytest.approx(want[2], rel=tol)


@pytest.mark.parametrize("axis", ["b", "E", "D"])
def test_monotone_where_data_is_monotone(tables, axis):
    rng = np.random.default_rng(2)
    stage = tables.stage_spec(0, sum(tables.num_layers))
    if axis == "D" and tables.family == "causal":  # no decoder axis: D must not change anything
        a, b = tables.stage_cost(stage, 4, 64, 8), tables.stage_cost(stage, 4, 64, 128)
        assert (a.fwd_s, a.bwd_s, a.stored_bytes, a.peak_bytes) == (b.fwd_s, b.bwd_s, b.stored_bytes, b.peak_bytes)
        return
    for _ in range(20):
        q = {"b": rng.uniform(1, 16), "E": rng.uniform(16, 256), "D": rng.uniform(8, 128)}
        top = {"b": 16, "E": 256, "D": 128}[axis]
        prev = None
        for x in np.linspace(1 if axis == "b" else 1.0, top, 60):
            q[axis] = x
            c = tables.stage_cost(stage, q["b"], q["E"], q["D"])
            now = np.array([c.fwd_s, c.bwd_s, c.stored_bytes, c.peak_bytes])
            if prev is not None:
                assert np.all(now >= prev * (1 - 1e-12))
            prev = now


def test_out_of_grid_raises_or_clamps(tables):
    stage = tables.stage_spec(0, 1)
    with pytest.raises(ValueError, match="beyond the profiled grid"):
        tables.stage_cost(stage, 17, 64, 32)
    with pytest.raises(ValueError, match="E=257"):
        tables.stage_cost(stage, 2, 257, 32)
    with pytest.raises(ValueError, match="positive"):
        tables.stage_cost(stage, 0, 64, 32)
    with pytest.raises(ValueError, match="unknown layer kinds"):
        tables.stage_cost(StageSpec.of(nope=1), 2, 64, 32)
    # Below the grid: clamped to the first grid value (an upper bound).
    assert tables.stage_cost(stage, 2, 3, 8) == tables.stage_cost(stage, 2, 16, 8)
    # The kernels answer +inf beyond the grid and for NaN queries instead of raising.
    table = next(iter(tables.kinds.values())).values[0]
    assert K._interp2(tables.axis_b, tables.axis_e, table, 17.0, 64.0) == math.inf
    assert K._interp2(tables.axis_b, tables.axis_e, table, 2.0, 1e9) == math.inf
    assert K._interp2(tables.axis_b, tables.axis_e, table, math.nan, 64.0) == math.inf


def test_missing_cells_are_infeasible_but_grid_points_next_to_them_are_exact():
    t = CostTables.from_profile(synthetic_profile("gpt2", max_tokens=1024, oom_at=(8, 128)))
    block = t.kinds["gpt2_block"].values
    assert np.isnan(block[0, B.index(16), E.index(128)])  # 16 * 128 > 1024: skipped
    assert np.isnan(block[0, B.index(8), E.index(128)])  # oom
    assert not t.layer_cost("gpt2_block", 12, 100).feasible  # corner (16, 128) missing
    assert not t.layer_cost("gpt2_block", 6, 100).feasible  # corner (8, 128) oom
    assert t.layer_cost("gpt2_block", 3, 100).feasible
    c = t.layer_cost("gpt2_block", 8, 64)  # grid point whose upper neighbours are missing
    assert c.feasible and c.fwd_s == block[0, B.index(8), E.index(64)]
    model = ProfiledCostModel(t, (t.stage_spec(0, 4),), 1e9)
    time_s, stored, transient = model.evaluate(np.array([3, 12]), np.array([100, 100]), np.zeros(2))
    assert time_s[1] == stored[1] == transient[1] == INFEASIBLE and time_s[0] < 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernels_match_reference(seed):
    rng = np.random.default_rng(seed)
    ab, ae, ad = (np.sort(rng.choice(np.arange(1, 300), n, replace=False)).astype(np.float64) for n in (4, 6, 5))
    t2 = rng.uniform(0, 10, (4, 6)) * (rng.random((4, 6)) > 0.1)  # some zeros: linear fallback
    t2[rng.random((4, 6)) < 0.1] = np.nan  # holes
    t3 = rng.uniform(0.1, 10, (4, 6, 5))
    t3[rng.random((4, 6, 5)) < 0.05] = np.nan
    for _ in range(500):
        b, e, d = rng.uniform(0, ab[-1] * 1.1), rng.uniform(0, ae[-1] * 1.1), rng.uniform(0, ad[-1] * 1.1)
        if rng.random() < 0.2:  # exact grid coordinates
            b, e, d = rng.choice(ab), rng.choice(ae), rng.choice(ad)
        for got, want in ((K._interp2(ab, ae, t2, b, e), ref.interp2(ab, ae, t2.tolist(), b, e)),
                          (K._interp3(ab, ae, ad, t3, b, e, d), ref.interp3(ab, ae, ad, t3.tolist(), b, e, d))):
            assert got == pytest.approx(want, rel=1e-12, abs=1e-300) or (math.isinf(got) and math.isinf(want))


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_stage_kernel_matches_reference(family):
    t = CostTables.from_profile(synthetic_profile(family, max_tokens=2048))
    a = t.kernel_arrays()
    rng = np.random.default_rng(3)
    total = sum(t.num_layers)
    for _ in range(200):
        start = int(rng.integers(0, total))
        counts = t.stage_counts(t.stage_spec(start, int(rng.integers(start + 1, total + 1))))
        b, e, d = rng.uniform(0.5, 16), rng.uniform(4, 256), rng.uniform(4, 128)
        args = (a.axis_b, a.axis_e, a.axis_d, a.tab_be, counts[0], a.tab_bd, counts[1], a.tab_bed, counts[2], b, e, d)
        got = K._stage_cost(*args)
        want = ref.stage_cost(*args)
        assert got == pytest.approx(want, rel=1e-12) or (math.isinf(got[0]) and math.isinf(want[0]))


def test_p2p_kernel_matches_reference_and_extrapolates_bandwidth(tables):
    for n in [0, 10, 1024, 5000, 65536, 500000, 1048576, 4e6, 1e9]:
        assert K._p2p_time(tables.p2p_sizes, tables.p2p_times, float(n)) == pytest.approx(
            ref.p2p_time(tables.p2p_sizes.tolist(), tables.p2p_times.tolist(), float(n)), rel=1e-12)
    assert tables.p2p_time(0) == tables.p2p_time(1024) == 1e-4
    slope = (1.2e-3 - 2e-4) / (1048576 - 65536)
    assert tables.p2p_time(2 * 1048576) == pytest.approx(1.2e-3 + slope * 1048576)
    with pytest.raises(ValueError):
        tables.p2p_time(-1)


def test_stage_cost_is_sum_of_layer_costs(tables):
    rng = np.random.default_rng(4)
    total = sum(tables.num_layers)
    for start in range(total):
        for stop in range(start + 1, total + 1):
            stage = tables.stage_spec(start, stop)
            b, e, d = rng.uniform(1, 16), rng.uniform(16, 256), rng.uniform(8, 128)
            layers = [(tables.layer_cost(u.kind, b, e, d), u.count) for u in stage.uses]
            got = tables.stage_cost(stage, b, e, d)
            assert got.fwd_s == pytest.approx(sum(c.fwd_s * n for c, n in layers), rel=1e-12)
            assert got.bwd_s == pytest.approx(sum(c.bwd_s * n for c, n in layers), rel=1e-12)
            stored = sum(c.stored_bytes * n for c, n in layers)
            assert got.stored_bytes == pytest.approx(stored, rel=1e-12)
            transient = max(c.peak_bytes - c.stored_bytes for c, _ in layers)
            assert got.peak_bytes == pytest.approx(stored + transient, rel=1e-12)


def test_stage_specs_cover_the_model():
    g = CostTables.from_profile(synthetic_profile("gpt2"))
    assert g.stage_spec(0, 4).counts() == {"gpt2_embedding": 1, "gpt2_context": 1, "gpt2_block": 4, "gpt2_head": 1}
    assert g.stage_spec(1, 3).counts() == {"gpt2_context": 1, "gpt2_block": 2}
    t = CostTables.from_profile(synthetic_profile("t5"))
    assert t.stage_spec(0, 2).counts() == {"t5_encoder_embedding": 1, "t5_encoder_context": 1, "t5_encoder_block": 2}
    assert t.stage_spec(2, 4).counts() == {"t5_encoder_context": 1, "t5_encoder_block": 1, "t5_encoder_final": 1,
                                           "t5_decoder_embedding": 1, "t5_decoder_context": 1, "t5_decoder_block": 1}
    assert t.stage_spec(4, 6).counts() == {"t5_decoder_context": 1, "t5_decoder_block": 2, "t5_head": 1}
    with pytest.raises(ValueError):
        t.stage_spec(3, 3)


def test_model_state_bytes_and_tied_parameters():
    assert model_state_bytes(1000, "adam") == 16000
    assert model_state_bytes(1000, "sgd") == 8000
    assert model_state_bytes(1000, "adam_mixed") == 16000
    with pytest.raises(ValueError, match="valid: adam"):
        model_state_bytes(10, "lion")
    g = CostTables.from_profile(synthetic_profile("gpt2"))
    whole = g.stage_spec(0, 4)
    n = {k: 1000 + len(k) for k in GPT2}
    # embedding and head share the tied token embedding (500 params here): counted once in one stage
    assert g.stage_params(whole) == n["gpt2_embedding"] + n["gpt2_context"] + 4 * n["gpt2_block"] + n["gpt2_head"] - 500
    assert g.stage_params(g.stage_spec(3, 4)) == n["gpt2_context"] + n["gpt2_block"] + n["gpt2_head"]
    assert g.stage_model_state_bytes(whole, "adam") == 16 * g.stage_params(whole)


def test_profile_validation():
    p = synthetic_profile("gpt2")
    with pytest.raises(ValueError, match="not a dynabatch profile"):
        CostTables.from_profile({**p, "format": "x"})
    with pytest.raises(ValueError, match="version"):
        CostTables.from_profile({**p, "version": 99})
    bad = json.loads(json.dumps(p))
    bad["layers"]["gpt2_block"]["fwd_s"][0][0] = None
    with pytest.raises(ValueError, match="marked 'ok'"):
        CostTables.from_profile(bad)


def test_planner_adapter_is_the_bottleneck_stage():
    t = CostTables.from_profile(synthetic_profile("t5"))
    model = ProfiledCostModel.even_split(t, 3, 1e9)
    b, e, d = np.array([1, 3, 7]), np.array([20, 100, 200]), np.array([10, 50, 100])
    time_s, stored, transient = model.evaluate(b, e, d)
    for i in range(3):
        costs = [t.stage_cost(s, b[i], e[i], d[i]) for s in model.stages]
        assert time_s[i] == pytest.approx(max(c.fwd_s + c.bwd_s for c in costs), rel=1e-12)
        assert stored[i] == pytest.approx(max(c.stored_bytes for c in costs), rel=1e-12)
        assert transient[i] == pytest.approx(max(c.peak_bytes - c.stored_bytes for c in costs), rel=1e-12)


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_layer_model_adapter_runs_the_stage_layer(family):
    from dynabatch.cost.planner_model import ProfiledLayerModel
    from dynabatch.cost.stages import StageCostModel, in_flight_buffer_bytes, message_buffer_bytes
    from dynabatch.cost.layer_split import balanced_layout

    t = CostTables.from_profile(synthetic_profile(family))
    lm = ProfiledLayerModel(t)
    layout = balanced_layout(lm, 2, ref_shape=(4, 64, 32))
    assert sum(k in ("gpt", "t5_encoder", "t5_decoder") for s in layout.stages for k in s) == sum(t.num_layers)
    model = StageCostModel(lm, layout, device_memory_bytes=1e12)
    b, e, d = np.array([1.0, 3.0, 20.0]), np.array([20.0, 100.0, 100.0]), np.array([10.0, 50.0, 50.0])
    time_s, stored, transient = model.evaluate(b, e, d if family == "t5" else np.zeros(3))
    per = model.per_stage(b, e, d if family == "t5" else np.zeros(3))
    assert np.all(message_buffer_bytes(per.send_bytes).max(axis=0)[:2] > 0)  # the first sends, the last receives
    buffers = in_flight_buffer_bytes(per).max(axis=0)  # message buffers and loaded inputs
    for i in range(2):  # the third shape is beyond the b axis: infeasible
        costs = [t.stage_cost(lm.spec(s), b[i], e[i], d[i]) for s in layout.stages]
        assert time_s[i] == pytest.approx(max(c.fwd_s + c.bwd_s for c in costs), rel=1e-12)
        assert stored[i] == pytest.approx(max(c.stored_bytes for c in costs) + buffers[i], rel=1e-12)
        assert transient[i] == pytest.approx(max(c.peak_bytes - c.stored_bytes for c in costs), rel=1e-12)
    assert time_s[2] >= INFEASIBLE and stored[2] == INFEASIBLE


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_stage_layer_and_planner_adapter_share_one_path(family):
    """``StageCostModel(ProfiledLayerModel)`` answers through the fused kernel: equal to reducing its own
    ``per_stage`` over stages, and to ``ProfiledCostModel`` on the same stages."""
    from dynabatch.cost.planner_model import ProfiledLayerModel
    from dynabatch.cost.stages import StageCostModel, in_flight_buffer_bytes
    from dynabatch.cost.layer_split import balanced_layout

    t = CostTables.from_profile(synthetic_profile(family, max_tokens=2048))
    lm = ProfiledLayerModel(t)
    model = StageCostModel(lm, balanced_layout(lm, 3, ref_shape=(4, 64, 32)), device_memory_bytes=1e12)
    rng = np.random.default_rng(5)
    b, e, d = rng.integers(1, 20, 500), rng.integers(4, 300, 500), rng.integers(4, 150, 500)
    d = d if family == "t5" else np.zeros(500)
    fused = model.evaluate(b, e, d)
    per = model.per_stage(b, e, d)
    buffers = in_flight_buffer_bytes(per).max(axis=0)  # the planner view counts message buffers and loads too
    reduced = ((per.fwd_s + per.bwd_s).max(axis=0), per.stored_bytes.max(axis=0) + buffers, per.peak_bytes.max(axis=0))
    feasible = reduced[1] < INFEASIBLE
    assert 0 < feasible.sum() < 500
    for got, want in zip(fused, reduced):
        np.testing.assert_array_equal(got[feasible], want[feasible])
        assert np.all(got[~feasible] == INFEASIBLE)
    planner = ProfiledCostModel(t, tuple(lm.spec(s) for s in model.layout.stages), model.memory_budget_bytes)
    for got, want, extra in zip(planner.evaluate(b, e, d), fused, (0.0, buffers, 0.0)):
        np.testing.assert_array_equal(got + extra, want)
