"""Activation recomputation in the cost model and the planner (dynabatch.cost.recompute): what each mode
costs, which mode ``auto`` picks, and that the choice reaches the per-rank plans."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.hardware import hardware_spec
from dynabatch.cost.model_specs import model_spec
from dynabatch.cost.stages import StageCostModel
from dynabatch.cost.layer_split import balanced_layout
from dynabatch.plan.step import plan_step

B = np.array([1.0, 4.0, 16.0, 64.0])
E = np.array([512.0, 512.0, 1024.0, 2048.0])
D = np.array([64.0, 128.0, 128.0, 256.0])


def _model(name: str, policy: str, memory_gib: float = 40.0, stages: int = 2) -> StageCostModel:
    layer = AnalyticCostModel(model_spec(name), hardware_spec("a100-40gb"))
    return StageCostModel(layer, balanced_layout(layer, stages), memory_gib * 2**30, recompute=policy)


@pytest.mark.parametrize("name", ["gpt-1.3b", "t5-large", "llama3.2-1b"])
def test_modes_trade_time_for_memory(name):
    """selective and full add backward time (full more) and store less (full least); forwards are unchanged."""
    costs = {p: _model(name, p).per_stage(B, E, D) for p in ("none", "selective", "full")}
    none, sel, full = costs["none"], costs["selective"], costs["full"]
    assert none.recompute is None and (sel.recompute == 1).all() and (full.recompute == 2).all()
    np.testing.assert_array_equal(none.fwd_s, full.fwd_s)
    assert (none.bwd_s < sel.bwd_s).all() and (sel.bwd_s < full.bwd_s).all()
    assert (sel.stored_bytes < none.stored_bytes).all() and (full.stored_bytes < sel.stored_bytes).all()
    # full keeps about one hidden state per block on the first stage (the last also keeps the head's logits)
    assert (full.stored_bytes[0] < 0.25 * none.stored_bytes[0]).all()
    assert (full.bwd_s - none.bwd_s <= none.fwd_s).all()  # at most one extra forward


def test_full_stores_the_block_inputs():
    """A stage of blocks only (a middle stage) stores exactly its blocks' input hidden states under full."""
    layer = AnalyticCostModel(model_spec("gpt-1.3b"), hardware_spec("a100-40gb"))
    layout = balanced_layout(layer, 4)
    model = StageCostModel(layer, layout, 80 * 2**30, recompute="full")
    c = model.per_stage(B, E, D)
    blocks = sum(k == "gpt" for k in layout.stages[1])
    assert set(layout.stages[1]) == {"gpt"}
    expected = blocks * layer.spec.dtype_bytes * B * E * layer.spec.d_model
    np.testing.assert_allclose(c.stored_bytes[1], expected, rtol=1e-12)


def test_auto_is_none_where_memory_does_not_bind():
    """With room to spare, auto prices every micro-batch exactly as no recomputation (plans unchanged)."""
    auto, none = _model("t5-large", "auto", 1000.0), _model("t5-large", "none", 1000.0)
    b, e, d = B[:3], E[:3], D[:3]  # (64, 2048, 256) with dense attention needs more than 1000 GiB
    a, n = auto.per_stage(b, e, d), none.per_stage(b, e, d)
    assert a.recompute is None
    for f in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes"):
        np.testing.assert_array_equal(getattr(a, f), getattr(n, f))
    for x, y in zip(auto.evaluate(b, e, d), none.evaluate(b, e, d)):
        np.testing.assert_array_equal(x, y)


def test_auto_picks_the_fastest_mode_that_fits():
    """Per micro-batch and stage: the first of none, selective, full whose memory bound fits; entries that fit
    nowhere get the mode needing the least memory."""
    model = _model("gpt-1.3b", "auto", 16.0)
    by_mode = [_model("gpt-1.3b", p, 16.0).per_stage(B, E, D) for p in ("none", "selective", "full")]
    chosen = model.per_stage(B, E, D)
    buffers = np.max(2.0 * (np.concatenate([np.zeros_like(by_mode[0].send_bytes[:1]), by_mode[0].send_bytes[:-1]])
                            + by_mode[0].send_bytes), axis=0)
    need = [2 * (c.stored_bytes + buffers) + c.peak_bytes for c in by_mode]
    codes = chosen.recompute
    assert codes is not None and len(set(codes.ravel().tolist())) >= 2  # this budget makes it choose
    for s in range(2):
        for k in range(len(B)):
            fits = [bool(n[s, k] <= model.memory_budget_bytes) for n in need]
            expected = fits.index(True) if any(fits) else int(np.argmin([n[s, k] for n in need]))
            assert codes[s, k] == expected
            assert chosen.bwd_s[s, k] == by_mode[expected].bwd_s[s, k]


@pytest.mark.parametrize("pairs", [False, True])
def test_auto_prices_the_terms_of_the_entries_that_need_them_alone(monkeypatch, pairs):
    """When most entries fit without recomputation, auto prices the recomputation terms of the others only
    (StageCostModel._recomputed_where): every array, the chosen modes included, is exactly that of pricing every
    entry's terms, and the entries that fit keep the costs of no recomputation."""
    import dynabatch.cost.stages as stages
    from dynabatch.cost.pairs import AttentionPairs

    rng = np.random.default_rng(3)
    b = np.concatenate([rng.integers(1, 4, 40), rng.integers(48, 96, 8)]).astype(float)  # 8 of 48 too big
    e, d = rng.integers(64, 2048, 48).astype(float), rng.integers(8, 256, 48).astype(float)
    work = AttentionPairs(0.6 * b * e * e, 0.6 * b * d * d, 0.6 * b * d * e, (np.ceil(b / 2),) * 3, (0.8 * e, 0.8 * d))
    model = _model("t5-large", "auto", 24.0, stages=4)
    kw = {"pairs": work} if pairs else {}
    subset, subset_view = model.per_stage(b, e, d, **kw), model.evaluate(b, e, d, **kw)
    monkeypatch.setattr(stages, "RECOMPUTE_SUBSET_FITS", 2.0)  # never: every entry's terms priced
    whole, whole_view = model.per_stage(b, e, d, **kw), model.evaluate(b, e, d, **kw)
    assert whole.recompute is not None and 0 < (whole.recompute.max(axis=0) > 0).mean() <= 0.5
    for f in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes", "recompute"):
        np.testing.assert_array_equal(getattr(subset, f), getattr(whole, f))
    for x, y in zip(subset_view, whole_view):
        np.testing.assert_array_equal(x, y)
    none = _model("t5-large", "none", 24.0, stages=4).per_stage(b, e, d, **kw)
    fits = whole.recompute.max(axis=0) == 0
    np.testing.assert_array_equal(subset.bwd_s[:, fits], none.bwd_s[:, fits])


def test_evaluate_takes_the_tightest_stage():
    """With recomputation each stage fits on its own: the planner view is the stage needing the most memory,
    and it fits the budget exactly when every stage does."""
    from dynabatch.cost.stages import in_flight_buffer_bytes

    model = _model("gpt-1.3b", "auto", 16.0)
    c = model.per_stage(B, E, D)
    t, stored, peak = model.evaluate(B, E, D)
    np.testing.assert_allclose(t, (c.fwd_s + c.bwd_s).max(axis=0))
    buffers = in_flight_buffer_bytes(c).max(axis=0)
    every_stage_fits = (2 * (c.stored_bytes + buffers) + c.peak_bytes <= model.memory_budget_bytes).all(axis=0)
    fits = 2 * stored + peak <= model.memory_budget_bytes
    assert fits.tolist() == every_stage_fits.tolist() and fits[:2].all() and not fits[-1]


def test_recomputation_lets_long_samples_fit_and_reaches_the_plans():
    """A batch whose longest samples do not fit whole is refused without recomputation; with auto it is planned,
    the long samples recompute, and the lowered per-rank plans carry each micro-batch's mode."""
    from dynabatch.plan.slice_costs import piece_costs
    from dynabatch.schedule.step import lower_step
    from dynabatch.schedule.ir import PipelineSpec

    e = np.array([2048] * 4 + [256] * 24)
    d = np.zeros_like(e)
    with pytest.raises(ValueError, match="alone needs"):
        plan_step(e, d, _model("gpt-1.3b", "none", 12.0, 4), 4, family="causal")
    model = _model("gpt-1.3b", "auto", 12.0, 4)
    plan = plan_step(e, d, model, 4, family="causal")
    shapes = [p.shape for p in plan.replicas[0]]
    costs = piece_costs(model, None, shapes, [0] * len(shapes), ())
    assert costs.recompute is not None
    long_ = [k for k, s in enumerate(shapes) if s[1] == 2048]
    assert all(costs.recompute[0, k] > 0 for k in long_)
    spec = PipelineSpec.gpt(4, model.model.spec.d_model)
    plans = lower_step([shapes], spec, policy="1f1b", costs=[costs])
    for rank, p in plans.items():
        assert p.recompute == tuple(("none", "selective", "full")[int(x)] for x in costs.recompute[p.stage]) or (
            not p.recompute and not costs.recompute[p.stage].any())


def test_fixed_policy_needs_a_model_that_prices_it():
    """A layer model without recompute_terms (profiled tables) refuses selective/full with one line."""
    layer = AnalyticCostModel(model_spec("gpt-1.3b"), hardware_spec("a100-40gb"))

    class NoTerms:
        def __getattr__(self, name):
            if name == "recompute_terms":
                raise AttributeError(name)
            return getattr(layer, name)

    with pytest.raises(ValueError, match="prices recomputation"):
        StageCostModel(NoTerms(), balanced_layout(layer, 2), 40 * 2**30, recompute="full")
    with pytest.raises(ValueError, match="unknown recompute policy"):
        StageCostModel(layer, balanced_layout(layer, 2), 40 * 2**30, recompute="sometimes")


def test_calibrated_model_keeps_the_policy():
    from dynabatch.cost.online import CalibratedStageCostModel

    base = _model("t5-large", "full")
    cal = CalibratedStageCostModel.of(base, memory_scale=(1.5, 1.5))
    assert cal.recompute == "full" and cal.base.recompute == "full"
    a, b = cal.per_stage(B, E, D), base.per_stage(B, E, D)
    np.testing.assert_allclose(a.stored_bytes, 1.5 * b.stored_bytes)
    assert dataclasses.replace(a, stored_bytes=b.stored_bytes).recompute.tolist() == b.recompute.tolist()


def test_select_picks_as_np_choose():
    """select (nested np.where) takes every entry from the mode its code names, exactly as np.choose does, and
    refuses a code out of range."""
    from dynabatch.cost.recompute import select

    rng = np.random.default_rng(2)
    c = _model("gpt-1.3b", "none", 16.0).per_stage(B, E, D)
    by_mode = [dataclasses.replace(c, bwd_s=c.bwd_s * (1 + m), stored_bytes=c.stored_bytes / (1 + m),
                                   peak_bytes=c.peak_bytes + m) for m in range(3)]
    codes = rng.integers(0, 3, c.fwd_s.shape).astype(np.int8)
    out = select(by_mode, codes)
    for f in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes"):
        np.testing.assert_array_equal(getattr(out, f), np.choose(codes, [getattr(x, f) for x in by_mode]))
    assert out.recompute is codes or np.array_equal(out.recompute, codes)
    assert select(by_mode, np.zeros_like(codes)).recompute is None
    with pytest.raises(ValueError, match="mode codes"):
        select(by_mode, np.full_like(codes, 3))
