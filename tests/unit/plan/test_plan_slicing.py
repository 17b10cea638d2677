"""Token-slicing DP: optimal vs brute force, kernels vs pure-Python twins, memory, cost models, decisions."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.plan import _slicing_kernels as K
from dynabatch.plan.slice_costs import (
    AnalyticSliceCostModel,
    PolynomialSliceCostModel,
    SliceCostModel,
    causal_pairs,
    slice_stage_costs,
)
from dynabatch.plan.slicing import MAX_GRID_POINTS, SlicePlan, plan_slices, slice_long_samples
from reference import slicing_reference as ref  # tests/ is on sys.path via its conftest.py

# Small-number model where slicing, its overhead and the memory limit all matter for L <= 12.
TOY = dict(
    overhead_s=1.0,
    time_per_token_s=0.5,
    time_per_pair_s=0.07,
    stored_per_token_bytes=10.0,
    stored_per_pair_bytes=3.0,
    peak_per_token_bytes=4.0,
    peak_per_pair_bytes=2.0,
    peak_per_context_token_bytes=1.0,
)


def toy(budget=1e18, **changes) -> PolynomialSliceCostModel:
    return PolynomialSliceCostModel(memory_budget_bytes=budget, **{**TOY, **changes})


def whole_memory(cost, length, b=1):
    _, stored, peak = ref.slice_cost(cost, b, length, 0)
    return stored + peak


def random_matrix(rng, n, integer_times, infeasible=0.2):
    """(n + 1, n + 1) slice times indexed [end, start], inf above the diagonal and at random cells."""
    T = np.full((n + 1, n + 1), np.inf)
    ends, starts = np.tril_indices(n + 1, k=-1)
    vals = rng.integers(1, 9, ends.size).astype(float) if integer_times else rng.random(ends.size) + 0.1
    vals[rng.random(ends.size) < infeasible] = np.inf
    T[ends, starts] = vals
    return T


def check_plan(plan: SlicePlan, cost, reserved=0.0):
    """Slices cover [0, L) on the grid; times and memory match the cost model; objective adds up."""
    x = plan.boundaries
    assert x[0] == 0 and x[-1] == plan.length and np.all(np.diff(x) > 0)
    assert np.all(x[:-1] % plan.granularity == 0)
    assert plan.slice_lengths.sum() == plan.length and plan.contexts.tolist() == x[:-1].tolist()
    b = np.full(plan.num_slices, plan.batch_size)
    t, stored, peak = cost.evaluate(b, plan.slice_lengths, plan.contexts)
    np.testing.assert_allclose(plan.times_s, t, rtol=1e-12)
    np.testing.assert_allclose(plan.stored_bytes, stored, rtol=1e-12)
    # the chain's real timeline: slice j's backward runs with slices 0..j kept (stored + held: buffers, context copies)
    # (or, for a model taken from a pipeline's stage model, that timeline on every stage as the validator counts it)
    held = cost.held_bytes(b, plan.slice_lengths, plan.contexts) if hasattr(cost, "held_bytes") else 0.0
    timeline = getattr(cost, "chain_memory", lambda *_: None)(plan.batch_size, plan.slice_lengths, plan.contexts)
    expected = np.cumsum(stored + held) + peak if timeline is None else timeline
    np.testing.assert_allclose(plan.memory_bound_bytes, expected + reserved, rtol=1e-12)
    assert np.all(plan.memory_bound_bytes <= cost.memory_budget_bytes)
    total = float(np.cumsum(plan.times_s)[-1])
    assert plan.objective_s == pytest.approx(total + (plan.num_stages - 1) * plan.times_s.max(), rel=1e-12)


# --------------------------------------------------------------------------- kernels vs twins


@pytest.mark.parametrize("seed", range(6))
def test_solve_slices_kernel_matches_twin(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 14))
    T = random_matrix(rng, n, integer_times=seed % 2 == 0, infeasible=0.0 if seed < 2 else 0.3)
    for num_stages, tol, max_slices in itertools.product((1, 2, 4, 8), (0.0, 0.05, 0.5), (n, 1, 2, 4)):
        path, obj, tried = K._solve_slices(T, num_stages, tol, max_slices)
        ref_path, ref_obj, ref_tried = ref.solve_slices(T, num_stages, tol, max_slices)
        assert path.tolist() == ref_path
        assert obj == ref_obj and tried == ref_tried


@pytest.mark.parametrize("seed", range(4))
def test_small_kernels_match_twins(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 12))
    T = random_matrix(rng, n, integer_times=True)
    rows = T.tolist()
    for max_slices in (n, 1, 3):
        assert K._min_max_value(T, max_slices) == ref.min_max_value(rows, max_slices)
        for cap in (np.inf, 4.0, 7.0):
            s, m, path = K._min_sum_path(T, cap, max_slices)
            assert (s, m, path.tolist()) == ref.min_sum_path(rows, cap, max_slices)
    for tol in (0.0, 0.1, 1.0):
        assert K._cap_candidates(T, 2.0, 7.0, tol).tolist() == ref.cap_candidates(rows, 2.0, 7.0, tol)


# --------------------------------------------------------------------------- plan_slices vs brute force


@pytest.mark.parametrize("granularity", [1, 3])
@pytest.mark.parametrize("limited", [False, True])
def test_plan_is_optimal_over_all_boundary_sets(granularity, limited):
    rng = np.random.default_rng([granularity, int(limited)])
    for trial in range(8):
        length = int(rng.integers(1, 13))
        num_stages = int(rng.choice([1, 2, 4, 8]))
        batch_size = int(rng.integers(1, 3))
        cost = toy(time_per_pair_s=float(rng.choice([0.02, 0.07, 0.3])))
        max_slices, reserved = None, 0.0
        if limited:  # a budget the whole sequence breaks, some reserved memory, sometimes a slice cap
            reserved = 5.0
            budget = 0.8 * whole_memory(cost, length, batch_size) + reserved
            cost = toy(budget=budget, time_per_pair_s=cost.time_per_pair_s)
            max_slices = int(rng.integers(2, 6)) if trial % 2 else None
        want, bounds = ref.brute_force_slices(length, cost, num_stages, batch_size, granularity, max_slices, reserved)
        if want == np.inf:
            with pytest.raises(ValueError, match=f"length {length}"):
                plan_slices(length, cost, num_stages, batch_size=batch_size, granularity=granularity,
                            max_slices=max_slices, reserved_bytes=reserved)
            continue
        plan = plan_slices(length, cost, num_stages, batch_size=batch_size, granularity=granularity,
                           max_slices=max_slices, reserved_bytes=reserved)
        assert plan.objective_s == pytest.approx(want, rel=1e-12), (trial, length, bounds, plan.boundaries)
        check_plan(plan, cost, reserved)
        if max_slices is not None:
            assert plan.num_slices <= max_slices
        if limited and length >= 2 * granularity:
            assert plan.unsliced_objective_s == np.inf


def test_brute_force_cases_exercise_slicing_and_memory():
    """The toy model really slices at L = 12 and the tight budget really binds."""
    free = plan_slices(12, toy(), 4)
    assert free.num_slices > 2 and free.objective_s < free.unsliced_objective_s
    budget = 0.8 * whole_memory(toy(), 12)
    tight = plan_slices(12, toy(budget=budget), 1)
    assert tight.num_slices > 1 and tight.unsliced_objective_s == np.inf


# --------------------------------------------------------------------------- realistic behaviour


def test_long_sequence_on_four_stages_is_sliced():
    cost = PolynomialSliceCostModel()
    plan = plan_slices(4096, cost, 4, granularity=64)
    check_plan(plan, cost)
    assert plan.num_slices >= 4
    assert plan.objective_s < 0.6 * plan.unsliced_objective_s and plan.speedup > 1.6
    # later slices see more context, so they are not longer than earlier ones (up to the grid)
    assert plan.slice_lengths[-1] <= plan.slice_lengths[0]
    one_stage = plan_slices(4096, cost, 1, granularity=64)
    assert one_stage.num_slices == 1 and one_stage.objective_s == one_stage.unsliced_objective_s


def test_sequence_too_big_to_fit_whole_is_sliced_to_fit():
    base = PolynomialSliceCostModel()
    _, stored, peak = ref.slice_cost(base, 1, 8192, 0)
    cost = PolynomialSliceCostModel(memory_budget_bytes=stored + 0.3 * peak)
    plan = plan_slices(8192, cost, 4, granularity=128)
    check_plan(plan, cost)
    assert plan.unsliced_objective_s == np.inf and plan.speedup == np.inf
    assert plan.num_slices > 1
    capped = plan_slices(8192, cost, 4, granularity=128, max_slices=3)
    check_plan(capped, cost)
    assert capped.num_slices <= 3 and capped.objective_s >= plan.objective_s


def test_impossible_budget_raises_naming_length_and_budget():
    base = PolynomialSliceCostModel()
    first = whole_memory(base, 64)
    cost = PolynomialSliceCostModel(memory_budget_bytes=0.5 * first)  # not even 64 tokens at context 0
    with pytest.raises(ValueError, match=r"length 4096 .*budget of .* GiB.*past token 0"):
        plan_slices(4096, cost, 4, granularity=64)
    _, stored, _ = ref.slice_cost(base, 1, 4096, 0)
    cost = PolynomialSliceCostModel(memory_budget_bytes=0.9 * stored)  # the last tokens never fit
    with pytest.raises(ValueError, match=r"length 4096 .*no slice reaches past token [1-9]"):
        plan_slices(4096, cost, 4, granularity=64)
    fits_sliced = PolynomialSliceCostModel(memory_budget_bytes=stored + 0.3 * ref.slice_cost(base, 1, 4096, 0)[2])
    with pytest.raises(ValueError, match="max_slices=1"):
        plan_slices(4096, fits_sliced, 4, granularity=64, max_slices=1)


def test_reserved_memory_tightens_the_plan():
    cost = PolynomialSliceCostModel()
    _, stored, peak = ref.slice_cost(cost, 2, 4096, 0)
    free = plan_slices(4096, cost, 2, batch_size=2, granularity=256)
    reserved = cost.memory_budget_bytes - stored - 0.3 * peak
    tight = plan_slices(4096, cost, 2, batch_size=2, granularity=256, reserved_bytes=reserved)
    check_plan(tight, cost, reserved)
    assert tight.unsliced_objective_s == np.inf and tight.objective_s >= free.objective_s


def test_tolerance_trades_exactness_for_fewer_caps():
    cost = PolynomialSliceCostModel()
    exact = plan_slices(4096, cost, 8, granularity=32)
    for tol in (0.01, 0.1):
        approx = plan_slices(4096, cost, 8, granularity=32, cap_tolerance=tol)
        assert exact.objective_s <= approx.objective_s <= exact.objective_s + tol * 7 * exact.times_s.max() + 1e-12
        assert approx.num_cap_candidates_tried <= exact.num_cap_candidates_tried


def test_granularity_grid_and_short_tail():
    cost = PolynomialSliceCostModel()
    plan = plan_slices(1000, cost, 8, granularity=96)
    check_plan(plan, cost)
    assert set(plan.boundaries[1:-1].tolist()) <= set(range(96, 1000, 96))
    single = plan_slices(50, cost, 4, granularity=64)  # granularity above the length: one slice
    assert single.boundaries.tolist() == [0, 50] and single.objective_s == single.unsliced_objective_s


def test_deterministic():
    cost = PolynomialSliceCostModel()
    a = plan_slices(3000, cost, 4, granularity=16, cap_tolerance=0.01)
    b = plan_slices(3000, cost, 4, granularity=16, cap_tolerance=0.01)
    assert a.boundaries.tolist() == b.boundaries.tolist() and a.objective_s == b.objective_s
    assert a.num_cap_candidates_tried == b.num_cap_candidates_tried


# --------------------------------------------------------------------------- cost models


def test_polynomial_model_contract():
    cost = PolynomialSliceCostModel()
    assert isinstance(cost, SliceCostModel)
    bounds = np.array([0, 100, 350, 1024])
    s, c = np.diff(bounds), bounds[:-1]
    assert causal_pairs(s, c).sum() == 1024 * 1025 / 2  # causal pairs telescope
    t, stored, _ = cost.evaluate(np.ones(3, dtype=np.int64), s, c)
    t0, stored0, _ = cost.evaluate(np.array([1]), np.array([1024]), np.array([0]))
    assert stored.sum() == pytest.approx(stored0[0], rel=1e-12)  # prefix bound is exact here
    assert t.sum() == pytest.approx(t0[0] + 2 * cost.overhead_s, rel=1e-12)
    with pytest.raises(ValueError, match="overhead_s"):
        PolynomialSliceCostModel(overhead_s=-1.0)


GPT = AnalyticCostModel.from_names("gpt-350m", "a100-80gb")
LLAMA = AnalyticCostModel.from_names("llama3-8b", "a100-80gb")  # GQA: K/V 8 of 32 heads wide, gated MLP
STAGE = ("embedding", "gpt", "gpt", "lm_head")


@pytest.mark.parametrize(
    "options", [{}, {"flash_attention": True}, {"recompute": True}, {"dropout": False, "flash_attention": True}]
)
@pytest.mark.parametrize("attention", ["dense", "causal"])
@pytest.mark.parametrize("base", [GPT, LLAMA], ids=["gpt", "llama"])
def test_analytic_slice_at_zero_context_is_the_unsliced_stage(options, attention, base):
    model = AnalyticCostModel(base.spec, base.hardware, **options)
    sliced = AnalyticSliceCostModel(model, STAGE, 40 * 2**30, attention=attention)
    b, s = np.array([1, 2, 4, 3]), np.array([1, 100, 700, 2048])
    t, stored, peak = sliced.evaluate(b, s, np.zeros_like(s))
    whole = model.stage_cost(list(STAGE), b, s)
    np.testing.assert_allclose(t, whole.fwd_time_s + whole.bwd_time_s, rtol=1e-12)
    np.testing.assert_allclose(stored, whole.stored_activation_bytes, rtol=1e-12)
    np.testing.assert_allclose(peak, whole.peak_extra_bytes, rtol=1e-12)
    np.testing.assert_allclose(sliced.fwd_flops(b, s, 0 * s), whole.fwd_flops, rtol=1e-12)
    # more context never costs less
    more = sliced.evaluate(b, s, s)
    assert all(np.all(x >= y) for x, y in zip(more, (t, stored, peak)))


@pytest.mark.parametrize("GPT", [GPT, LLAMA], ids=["gpt", "llama"])
def test_analytic_slices_add_up_to_the_unsliced_flops(GPT):  # noqa: N803 - the module's GPT, or a Llama
    bounds = np.array([0, 300, 800, 1200, 1500, 2048])
    s, c, b = np.diff(bounds), bounds[:-1], np.ones(5, dtype=np.int64)
    L, spec = 2048, GPT.spec
    whole = GPT.stage_cost(list(STAGE), 1, L).fwd_flops
    causal = AnalyticSliceCostModel(GPT, STAGE, 40 * 2**30, attention="causal")
    assert causal.fwd_flops(b, s, c).sum() == pytest.approx(whole, rel=1e-12)
    dense = AnalyticSliceCostModel(GPT, STAGE, 40 * 2**30)
    skipped = 2 * 4 * spec.num_heads * spec.d_kv * (L * L - (s * (c + s)).sum())  # 2 blocks, masked blocks
    assert dense.fwd_flops(b, s, c).sum() == pytest.approx(whole - skipped, rel=1e-12)
    assert skipped > 0
    # stored activations: exact for the causal share, an over-estimate of the prefix for dense
    _, st_causal, _ = causal.evaluate(b, s, c)
    _, st_whole, _ = causal.evaluate(1, L, 0)
    assert st_causal.sum() == pytest.approx(float(st_whole), rel=1e-12)
    _, st_dense, _ = dense.evaluate(b, s, c)
    assert st_dense.sum() < float(st_whole)


@pytest.mark.parametrize("preset, hardware", [("gpt-350m", "a100-80gb"), ("llama3-8b", "a100-80gb")])
def test_a_samples_slices_cost_its_whole_cost_on_every_stage(preset, hardware):
    """Causal pricing, each stage its own ratio: on every stage of a split whose last stage holds the output head
    (a cost that grows with the slice's own tokens only), a sample's slices' attention and layers add up to its
    unsliced cost (within the slices' fixed costs, kernel launches, a small share at 4,096-token slices); their
    passes over the context's keys and values come on top. The bottleneck stage's ratio on every stage overprices
    the head's stage."""
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.cost.layer_split import balanced_layout

    base = AnalyticCostModel.from_names(preset, hardware, flash_attention=True)
    stages = StageCostModel(base, balanced_layout(base, 4), base.hardware.memory_bytes)
    sliced = AnalyticSliceCostModel.from_stage_model(stages, ref_length=32768)
    assert sliced.attention == "causal"  # flash_attention: whole samples skip the blocks above the diagonal
    length, k = 32768, 8  # long slices: their fixed costs (kernel launches) stay a small share
    bounds = np.round(np.arange(k + 1) * length / k).astype(np.int64)
    s, c, b = np.diff(bounds), bounds[:-1], np.ones(k, dtype=np.int64)
    whole = stages.per_stage(np.ones(1), np.array([float(length)]), np.zeros(1))
    whole_s = (whole.fwd_s + whole.bwd_s)[:, 0]

    def summed(model):
        costs = slice_stage_costs(stages.per_stage(b.astype(float), s.astype(float), np.zeros(k)), model, b, s, c)
        return (costs.fwd_s + costs.bwd_s).sum(axis=1)

    attention_only = dataclasses.replace(sliced, context_passes=False)  # the causal share alone
    np.testing.assert_allclose(summed(attention_only), whole_s, rtol=0.03)
    bottleneck_only = dataclasses.replace(attention_only, stages=None)  # no per-stage ratios
    assert np.max(summed(bottleneck_only) / whole_s) > 1.1
    # the passes over the context's keys and values come on top, on the stages with attention blocks
    extra = summed(sliced) - summed(attention_only)
    assert np.all(extra > 0) and np.all(extra < 0.1 * whole_s)


def test_slices_priced_by_pairs_take_the_stage_models_per_pair_cost():
    """With attention pairs (the padding-free runtime, simulate), a slice's time is the stage model's own price of
    its score pairs with the context, ``b s (2c + s)`` under causal pricing (times its passes over the context's keys
    and values, which pairs do not count), not the unsliced cost scaled by the analytic ratio; its memory is the
    ratio-scaled one either way."""
    from dynabatch.cost.pairs import AttentionPairs
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.plan.slice_costs import piece_costs
    from dynabatch.schedule.chains import links_for

    def stage_model(hardware):
        base = AnalyticCostModel.from_names("gpt-350m", hardware, flash_attention=True)
        return StageCostModel(base, balanced_layout(base, 2), base.hardware.memory_bytes)

    # the slice model's analytic ratio weighs attention as an A100 does; the stage model prices as a CPU does
    stages, sliced = stage_model("cpu"), AnalyticSliceCostModel.from_stage_model(stage_model("a100-80gb"), ref_length=4096)
    s, c = np.array([1024, 1024, 2048]), np.array([0, 1024, 2048])
    shapes = [(1, int(x), 0) for x in s]
    zeros = np.zeros(3)
    own = AttentionPairs((s * s).astype(float), zeros, zeros)  # what units_pairs gives a slice: its own square
    got = piece_costs(stages, sliced, shapes, c, links_for([3]), own)
    want = stages.per_stage(np.ones(3), s.astype(float), zeros, AttentionPairs((s * (2 * c + s)).astype(float), zeros, zeros))
    # times the passes over the context's keys and values, which the pairs do not count: each stage's slice model
    # with them over without them (1 for the unsliced piece)
    passes = []
    for kinds in sliced.stages.layout.stages:
        own = dataclasses.replace(sliced, stage_kinds=tuple(kinds), stages=None)
        passes.append(own.evaluate(1, s, c)[0] / dataclasses.replace(own, context_passes=False).evaluate(1, s, c)[0])
    passes = np.array(passes)
    assert np.all(passes[:, 0] == 1.0) and np.all(passes[:, 1:] > 1.0)
    np.testing.assert_allclose(got.fwd_s, want.fwd_s * passes, rtol=1e-12)
    np.testing.assert_allclose(got.bwd_s, want.bwd_s * passes, rtol=1e-12)
    assert np.all(got.fwd_s[:, 1:] > stages.per_stage(np.ones(2), s[1:].astype(float), zeros[1:], AttentionPairs(
        (s[1:] ** 2).astype(float), zeros[1:], zeros[1:])).fwd_s)  # the context costs
    ratio = piece_costs(stages, sliced, shapes, c, links_for([3]), None)
    assert np.max(np.abs(ratio.fwd_s / (want.fwd_s * passes) - 1)) > 0.05  # the ratio's A100 weighting would price them apart
    np.testing.assert_allclose(got.stored_bytes, ratio.stored_bytes, rtol=1e-12)
    np.testing.assert_allclose(got.peak_bytes, ratio.peak_bytes, rtol=1e-12)


def test_analytic_adapter_validates_and_plans():
    with pytest.raises(ValueError, match="decoder-only"):
        AnalyticSliceCostModel(AnalyticCostModel.from_names("t5-base", "a100-80gb"), ("t5_encoder",), 1e9)
    with pytest.raises(ValueError, match="valid kinds"):
        AnalyticSliceCostModel(GPT, ("gpt", "t5_decoder"), 1e9)
    with pytest.raises(ValueError, match="attention"):
        AnalyticSliceCostModel(GPT, ("gpt",), 1e9, attention="flash")
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.cost.layer_split import balanced_layout

    stages = StageCostModel(GPT, balanced_layout(GPT, 4), GPT.hardware.memory_bytes)
    cost = AnalyticSliceCostModel.from_stage_model(stages)
    assert cost.memory_budget_bytes == stages.memory_budget_bytes and "gpt" in cost.stage_kinds
    plan = plan_slices(2048, cost, 4, granularity=64)
    check_plan(plan, cost)
    assert plan.num_slices > 2 and plan.speedup > 1.5


# --------------------------------------------------------------------------- decisions and errors


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("stages", [1, 2])
def test_planned_chain_fits_the_validators_accounting(stages, recompute):
    """What the DP lets through fits as the runtime's validator counts a chain (:func:`slice_stage_costs` plus the
    in-flight buffers): each slice keeps its concatenated context keys/values and its loaded inputs until its
    backward. Counted without them, gpt2-tiny at 0.0145 GiB planned slices [0, 320, 512] 3% over the budget and
    the run stopped when the validator refused the schedule. Under ``--recompute full`` the slices are priced
    recomputed, as they run (they were priced storing everything, so such budgets refused the sample)."""
    from dynabatch.training.config import TrainConfig
    from dynabatch.cost.stages import in_flight_buffer_bytes
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.models.families import run_cost_model
    from dynabatch.models.presets import build_config
    from dynabatch.training.trainer import planner_cost_model

    config = build_config("gpt2-tiny", vocab_size=384)  # the byt5 tokenizer's vocabulary, as `train` builds it
    layer_model = run_cost_model(config, "cpu")
    multi_slice = 0
    for gib in np.linspace(0.006, 0.02, 57):
        cfg = TrainConfig(model="gpt2-tiny", stages=stages, memory_gib=float(gib), recompute=recompute, slice_long=True)
        try:  # too small for the model states, or for the sample however sliced
            stage_model = planner_cost_model(cfg, config, balanced_layout(layer_model, stages))
            slicer = AnalyticSliceCostModel.from_stage_model(stage_model, ref_length=512)
            plan = plan_slices(512, slicer, stages, granularity=16)
        except ValueError:
            continue
        s, c = plan.slice_lengths, plan.contexts
        ones = np.ones(len(s))
        costs = slice_stage_costs(stage_model.per_stage(ones, s.astype(float), np.zeros(len(s))), slicer, ones, s, c)
        kept = costs.stored_bytes + in_flight_buffer_bytes(costs)  # (S, k)
        timeline = (np.cumsum(kept, axis=1) + costs.peak_bytes).max(axis=0)  # every stage, as the validator
        np.testing.assert_allclose(plan.memory_bound_bytes, timeline, rtol=1e-9)
        assert timeline.max() <= stage_model.memory_budget_bytes
        multi_slice += plan.num_slices > 1
    assert multi_slice >= 2  # the sweep reaches budgets where the sample runs as a chain
    assert slicer.model.recompute == (recompute == "full")



def test_tightening_excludes_a_chain_the_validator_refuses():
    """Under ``--recompute full`` the DP's per-slice bound put a whole 270-token gpt2-tiny sample at 26.5 MiB and the
    validator's timeline at 27.5 MiB against a 27.4 MiB budget. Each re-solve tightened the budget by the 0.07 MiB
    overrun alone, so the DP picked the same single slice eight times and ``train --slice-long --recompute full
    --memory-gib 0.04`` stopped ("no slicing ... after 8 tightenings"). A re-solve must exclude the refused chain."""
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.models.families import run_cost_model
    from dynabatch.models.presets import build_config
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.trainer import planner_cost_model

    config = build_config("gpt2-tiny", vocab_size=8192)  # the builtin tokenizer's vocabulary
    cfg = TrainConfig(model="gpt2-tiny", memory_gib=0.04, recompute="full", slice_long=True)
    stage_model = planner_cost_model(cfg, config, balanced_layout(run_cost_model(config, "cpu"), 1))
    slicer = AnalyticSliceCostModel.from_stage_model(stage_model, ref_length=512, attention="causal")
    whole = slicer.chain_memory(1, np.array([270]), np.array([0]))
    assert whole[0] > slicer.memory_budget_bytes  # the validator refuses it whole
    plan = plan_slices(270, slicer, 1, granularity=16)
    assert plan.num_slices > 1
    assert slicer.chain_memory(1, plan.slice_lengths, plan.contexts).max() <= slicer.memory_budget_bytes


def test_the_bound_counts_the_stage_whose_memory_binds():
    """The slice model prices the slowest stage (gpt2-mini over 2 stages: the embedding and three blocks); the
    memory binds on the other (a block and the LM head, whose logits grow with the slice). The DP's bound let
    through slices the validator refused, and the tightenings then refused every slice:
    ``train --model gpt2-mini --stages 2 --slice-long --memory-gib 0.06`` stopped ("no slice reaches past
    token 224") for a 427-token sample that three slices run within the budget."""
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.models.families import run_cost_model
    from dynabatch.models.presets import build_config
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.trainer import planner_cost_model

    config = build_config("gpt2-mini", vocab_size=8192)  # the builtin tokenizer's vocabulary
    cfg = TrainConfig(model="gpt2-mini", stages=2, memory_gib=0.06, slice_long=True)
    stage_model = planner_cost_model(cfg, config, balanced_layout(run_cost_model(config, "cpu"), 2))
    slicer = AnalyticSliceCostModel.from_stage_model(stage_model, ref_length=512, attention="causal")
    assert "lm_head" not in slicer.stage_kinds
    plan = plan_slices(427, slicer, 2, granularity=16)
    check_plan(plan, slicer)
    assert plan.num_slices > 1
    assert plan.memory_bound_bytes.max() <= slicer.memory_budget_bytes
    np.testing.assert_allclose(plan.memory_bound_bytes, slicer.chain_memory(1, plan.slice_lengths, plan.contexts))

def test_slice_long_samples_picks_bubble_and_memory_samples():
    base = PolynomialSliceCostModel()
    lengths = np.array([200] * 40 + [6000, 300, 9000, 6000])
    _, stored, peak = ref.slice_cost(base, 1, 9000, 0)
    cost = PolynomialSliceCostModel(memory_budget_bytes=stored + 0.5 * peak)  # 9000 does not fit whole
    decision = slice_long_samples(lengths, cost, 4, granularity=64)
    assert decision.sample_indices.tolist() == [40, 42, 43]
    assert decision.reasons == ("bubble", "memory", "bubble")
    assert decision.plan_of(40) is decision.plan_of(43) and decision.plan_of(0) is None
    assert decision.plan_of(42).unsliced_objective_s == np.inf
    for i, plan in zip(decision.sample_indices, decision.plans):
        assert plan.length == lengths[i] and plan.num_slices > 1
    # one stage: no bubble to fight, only the sample that does not fit is sliced
    assert slice_long_samples(lengths, cost, 1, granularity=64).reasons == ("memory",)
    # a large step estimate makes every bubble small
    big = slice_long_samples(lengths, cost, 4, granularity=64, step_time_s=100.0)
    assert big.sample_indices.tolist() == [42]
    with pytest.raises(ValueError, match="sample 1: sequence of length 9000"):
        slice_long_samples([100, 9000], PolynomialSliceCostModel(memory_budget_bytes=0.9 * stored), 4, granularity=64)
    # what the partition planner can run whole (with activation recomputation) is never forced, nor refused
    whole = slice_long_samples(lengths, cost, 1, granularity=64, fits_whole=lengths == 9000)
    assert whole.sample_indices.tolist() == []
    assert slice_long_samples([100, 9000], PolynomialSliceCostModel(memory_budget_bytes=0.9 * stored), 1,
                              granularity=64, fits_whole=np.array([True, True])).sample_indices.tolist() == []


class _BadCost:
    memory_budget_bytes = 1e9

    def evaluate(self, b, s, c):
        return np.full(s.shape, np.nan), np.zeros(s.shape), np.zeros(s.shape)


def test_argument_errors():
    cost = PolynomialSliceCostModel()
    for kwargs, match in [
        ({"length": 0}, "length"),
        ({"num_stages": 0}, "num_stages"),
        ({"batch_size": 1.5}, "batch_size"),
        ({"granularity": 0}, "granularity"),
        ({"max_slices": 0}, "max_slices"),
        ({"cap_tolerance": -0.1}, "cap_tolerance"),
        ({"reserved_bytes": np.inf}, "reserved_bytes"),
        ({"length": MAX_GRID_POINTS * 4 + 1, "granularity": 4}, "MAX_GRID_POINTS"),
    ]:
        args = {"length": 100, "num_stages": 4, **kwargs}
        with pytest.raises(ValueError, match=match):
            plan_slices(args.pop("length"), cost, args.pop("num_stages"), **args)
    with pytest.raises(ValueError, match="time_s must be finite"):
        plan_slices(10, _BadCost(), 2)
    with pytest.raises(ValueError, match="lengths"):
        slice_long_samples([], cost, 4)
    with pytest.raises(ValueError, match="bubble_fraction"):
        slice_long_samples([10], cost, 4, bubble_fraction=0)


def test_the_passes_over_the_context_make_the_dp_cut_fewer_longer_slices():
    """Each slice reads, joins and writes back its context's keys and values in every attention block
    (``CONTEXT_KV_PASSES``), work its score pairs do not count and that grows with the context: priced, the DP
    stops cutting where a slice's passes cost more than the bubble it removes. Unpriced, a CPU model cut an
    8,192-token sample into 40 slices, each one's passes unpaid for."""
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.plan.slice_costs import CONTEXT_KV_PASSES

    base = AnalyticCostModel.from_names("gpt-350m", "cpu", flash_attention=True)
    stages = StageCostModel(base, balanced_layout(base, 2), base.hardware.memory_bytes)
    priced = AnalyticSliceCostModel.from_stage_model(stages, ref_length=8192)
    unpriced = dataclasses.replace(priced, context_passes=False)
    with_passes, without = plan_slices(8192, priced, 2, granularity=16), plan_slices(8192, unpriced, 2, granularity=16)
    assert with_passes.num_slices < without.num_slices
    assert with_passes.slice_lengths.min() > without.slice_lengths.min()
    # the op: (5 + 7) passes of b c a_kv elements per attention block, nothing at c = 0
    op = priced.context_op(np.array([1.0, 2.0]), np.array([0.0, 1000.0]))
    spec = base.spec
    np.testing.assert_allclose(op.bytes * (1 + op.bwd_factor),
                               [0.0, sum(CONTEXT_KV_PASSES) * 2 * spec.dtype_bytes * 2 * 1000 * spec.d_kv_attn])
    assert list(op.launches) == [0.0, 3.0]
    t_ctx0 = priced.evaluate(1, 512, 0)[0]
    assert t_ctx0 == pytest.approx(unpriced.evaluate(1, 512, 0)[0], rel=1e-12)
