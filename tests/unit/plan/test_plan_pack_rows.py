"""Row packing in the planner (``plan_step(pack_rows="auto")``): best-fit-decreasing rows (the kernel and its twin:
``tests/unit/data/test_baselines.py``), rows as units of the partition DP priced by their attention pairs,
and plans whose row groups hold every sample exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch.cost.pairs import AttentionPairs, row_pairs
from dynabatch.plan.costs import PolynomialCostModel
from dynabatch.plan.partition import plan_partition
from dynabatch.plan.rowpack import pack_units
from dynabatch.plan.step import plan_step
from dynabatch.core.sequence import is_seq2seq


@pytest.mark.parametrize("family", ["causal", "seq2seq"])
def test_pack_units_fill_rows_within_capacity(family):
    rng = np.random.default_rng(1)
    e, d = rng.integers(1, 200, 80), rng.integers(1, 40, 80)
    cap = (256, 64)
    units = pack_units(e, d, family, cap)
    flat = sorted(i for row in units.rows for i in row)
    assert flat == list(range(80))
    for row, ue, ud, pairs in zip(units.rows, units.input_lens, units.target_lens, units.pairs):
        if family == "causal":
            assert ue == sum(e[i] + d[i] for i in row) and ud == 0
        else:
            assert (ue, ud) == (sum(e[i] for i in row), sum(d[i] for i in row))
        assert len(row) == 1 or (ue <= cap[0] and (family == "causal" or ud <= cap[1]))
        assert tuple(pairs) == row_pairs([row], e, d, family)
    assert len(units.rows) < 80  # short samples share rows


def _check_rows(plan, e, d, family):
    """Every sample in exactly one row of one micro-batch; rows fit the planned shape; pairs as priced."""
    seen = []
    for r in range(len(plan.replicas)):
        for piece, group in zip(plan.replicas[r], plan.to_row_groups(r)):
            assert group.rows == piece.row_samples and len(group.rows) == piece.shape[0]
            for row in group.rows:
                seen += row
                if family == "causal":
                    assert sum(e[i] + d[i] for i in row) <= piece.shape[1]
                else:
                    assert sum(e[i] for i in row) <= piece.shape[1] and sum(d[i] for i in row) <= piece.shape[2]
            if piece.pairs is not None:
                assert piece.pairs == pytest.approx(row_pairs(group.rows, e, d, family))
    assert sorted(seen) == list(range(len(e)))


def _repriced(plan, cost, e, d, family) -> float:
    """The plan's objective with every micro-batch priced by its per-segment attention pairs."""
    pieces = plan.replicas[0]
    rows = np.array([row_pairs(p.row_samples, e, d, family) for p in pieces])
    shapes = np.array([p.shape for p in pieces], dtype=np.float64)
    t, _, _ = cost.evaluate(shapes[:, 0], shapes[:, 1], shapes[:, 2], pairs=AttentionPairs(*rows.T))
    return float(t.sum() + (plan.num_stages - 1) * t.max())


@pytest.mark.parametrize("family", ["causal", "seq2seq"])
def test_planner_packs_short_samples_when_it_is_cheaper(family):
    """Many short samples of mixed lengths and a few long ones, a large per-micro-batch overhead: packed rows
    beat one sample per row by a clear margin under the same per-segment pricing."""
    rng = np.random.default_rng(0)
    short = rng.integers(8, 120, 120)
    e = np.concatenate([short, [900, 1000]]).astype(np.int64)
    d = np.maximum(1, e // 6) if family == "seq2seq" else np.zeros_like(e)
    cost = PolynomialCostModel(overhead_s=5e-3, memory_budget_bytes=64 * 2**30)
    off = plan_step(e, d, cost, 4, family=family)
    auto = plan_step(e, d, cost, 4, family=family, pack_rows="auto")
    _check_rows(auto, e, d, family)
    _check_rows(off, e, d, family)
    assert any(p.rows is not None for p in auto.replicas[0])
    assert all(p.rows is None and p.pairs is None for p in off.replicas[0])
    assert auto.objective_s == pytest.approx(_repriced(auto, cost, e, d, family), rel=1e-9)
    assert auto.objective_s < 0.95 * _repriced(off, cost, e, d, family)


def test_pack_rows_off_is_the_dense_planner_and_auto_handles_replicas():
    rng = np.random.default_rng(3)
    e, d = rng.integers(10, 400, 200), rng.integers(1, 60, 200)
    cost = PolynomialCostModel()
    off = plan_step(e, d, cost, 4, family="seq2seq", pack_rows="off")
    part = plan_partition(e, d, cost, 4, family="seq2seq")
    assert sorted(p.time_s for p in off.replicas[0]) == sorted(part.times_s.tolist())
    auto = plan_step(e, d, cost, 4, family="seq2seq", pack_rows="auto", num_replicas=2)
    _check_rows(auto, e, d, "seq2seq")
    assert len(auto.replicas) == 2 and all(auto.replicas)
    with pytest.raises(ValueError, match="pack_rows"):
        plan_step(e, d, cost, 4, family="seq2seq", pack_rows="yes")


@pytest.mark.parametrize("family", ["causal", "seq2seq"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_flat_rows_lay_every_micro_batch_out_as_one_row_of_real_tokens(family, replicas):
    """``pack_rows="flat"``: each micro-batch is one row of all its samples, shaped ``(1, sum e, sum d)`` (no pad),
    priced at that shape with its summed pairs and its longest segments, within the memory limit."""
    rng = np.random.default_rng(7)
    e = rng.integers(8, 400, 150)
    d = rng.integers(1, 60, 150) if family == "seq2seq" else np.zeros(150, dtype=np.int64)
    cost = PolynomialCostModel(overhead_s=2e-3, memory_budget_bytes=2.0e9)
    plan = plan_step(e, d, cost, 4, family=family, pack_rows="flat", num_replicas=replicas)
    _check_rows(plan, e, d, family)
    lens = e + d if family == "causal" else e
    for r in range(replicas):
        pieces = plan.replicas[r]
        assert len(pieces) > 3
        for p in pieces:
            ids = list(p.sample_ids)
            assert p.row_samples == (tuple(ids),)
            want = (1, int(lens[ids].sum()), 0) if family == "causal" else (1, int(e[ids].sum()), int(d[ids].sum()))
            assert p.shape == want
            assert p.longest == ((int(lens[ids].max()), 0) if family == "causal" else (int(e[ids].max()), int(d[ids].max())))
        pairs = plan.pairs(r)
        shapes = np.array([p.shape for p in pieces], dtype=np.float64)
        t, stored, peak = cost.evaluate(shapes[:, 0], shapes[:, 1], shapes[:, 2], pairs=pairs)
        assert t == pytest.approx([p.time_s for p in pieces], rel=1e-9)
        assert (4 * stored + peak <= cost.memory_budget_bytes).all()
        assert [tuple(x) for x in np.stack(pairs.longest, axis=1).astype(int)] == [p.longest for p in pieces]


def test_flat_rows_need_pair_pricing_and_bound_real_tokens():
    rng = np.random.default_rng(8)
    e, d = rng.integers(8, 300, 80), rng.integers(1, 40, 80)
    cost = PolynomialCostModel()
    with pytest.raises(ValueError, match="unit_pairs"):
        plan_partition(e, d, cost, 2, family="seq2seq", flat_rows=True)
    from dynabatch.cost.pairs import sample_pairs

    plan = plan_partition(e, d, cost, 2, family="seq2seq", flat_rows=True, max_tokens=1000,
                          unit_pairs=sample_pairs(e, d, "seq2seq"))
    assert (plan.shapes[:, 0] == 1).all() and (plan.shapes[:, 1:].sum(axis=1) <= 1000).all()
    assert plan.padded_tokens == int(e.sum() + d.sum())  # nothing padded
    groups = plan.to_row_groups()
    assert all(len(g.rows) == 1 for g in groups)
    assert sorted(i for g in groups for i in g.rows[0]) == list(range(80))



@pytest.mark.parametrize("family", ["causal", "seq2seq"])
def test_flat_rows_hold_at_most_one_row_of_the_limits(family):
    """``flat_row``: every flat micro-batch holds at most ``(input, target)`` tokens (a causal model's total), or the
    step's longest sample's where that is longer; without it the same step forms larger flat rows."""
    rng = np.random.default_rng(11)
    e = rng.integers(8, 200, 120)
    d = rng.integers(1, 50, 120) if family == "seq2seq" else np.zeros(120, dtype=np.int64)
    e[0] = 700  # one sample longer than the limit: its own row, no error
    cost = PolynomialCostModel(overhead_s=20e-3, memory_budget_bytes=8.0e9)  # a high per-micro-batch cost: big runs
    free = plan_step(e, d, cost, 2, family=family, pack_rows="flat")
    cap = (512, 128) if family == "seq2seq" else (512, 0)
    bounded = plan_step(e, d, cost, 2, family=family, pack_rows="flat", flat_row=cap)
    _check_rows(bounded, e, d, family)
    lens = e + d if family == "causal" else e
    limit = (max(cap[0], int(lens.max())), max(cap[1], int(d.max())) if family == "seq2seq" else 0)  # (700, 128)
    assert all(p.shape[1] <= limit[0] and p.shape[2] <= limit[1] for p in bounded.replicas[0])
    assert any(p.shape[1] > limit[0] for p in free.replicas[0])  # unbounded, the same step forms larger rows
    assert len(bounded.replicas[0]) > len(free.replicas[0])
    auto = plan_step(e, d, cost, 2, family=family, pack_rows="auto", flat_row=cap)  # auto's flat candidate too
    _check_rows(auto, e, d, family)


def test_flat_row_limit_is_per_device_type():
    from dynabatch.plan.step import FLAT_ROW_LIMITS, flat_row_limit

    assert FLAT_ROW_LIMITS["cpu"] == 1.0
    assert flat_row_limit("cpu", "seq2seq", 1024, 256) == (1024, 256)
    assert flat_row_limit("cpu", "causal", 2048, 0) == (2048, 0)
    assert flat_row_limit("cuda", "seq2seq", 1024, 256) is None  # not measured there: unbounded
    rng = np.random.default_rng(3)
    e, d = rng.integers(8, 300, 40), rng.integers(1, 40, 40)
    from dynabatch.cost.pairs import sample_pairs

    with pytest.raises(ValueError, match="flat_rows=True"):
        plan_partition(e, d, PolynomialCostModel(), 2, family="seq2seq", max_row=(512, 64),
                       unit_pairs=sample_pairs(e, d, "seq2seq"))
    with pytest.raises(ValueError, match=r"sample \d+ \(input_len=\d+, target_len=\d+\) is longer than a flat row"):
        plan_partition(e, d, PolynomialCostModel(), 2, family="seq2seq", flat_rows=True, max_row=(100, 64),
                       unit_pairs=sample_pairs(e, d, "seq2seq"))

def test_bias_is_priced_on_the_longest_segment():
    """The T5 stages build the position bias for the longest segment of a row, not the row: a flat row of eight
    128-token samples pays eight 128^2 bias windows' worth less than one 1024-token sample."""
    from dynabatch.cost.analytic import AnalyticCostModel
    from dynabatch.cost.hardware import hardware_spec
    from dynabatch.cost.model_specs import model_spec

    model = AnalyticCostModel(model_spec("t5-large"), hardware_spec("cpu"))
    kinds = ["t5_encoder"] * 2
    flat = AttentionPairs(8 * 128.0**2, 0.0, 0.0)
    fwd_row, _ = model.context_cost(kinds, 1, 1024, 1, flat)
    fwd_flat, _ = model.context_cost(kinds, 1, 1024, 1, AttentionPairs(8 * 128.0**2, 0.0, 0.0, longest=(128, 1)))
    fwd_one, _ = model.context_cost(kinds, 1, 1024, 1, AttentionPairs(1024.0**2, 0.0, 0.0))
    assert fwd_flat < fwd_row / 4 and fwd_row < fwd_one  # the bias window, then the masks (pairs)
    with pytest.raises(ValueError, match="longest"):
        AttentionPairs(1.0, 0.0, 0.0, longest=(1.0,))


def test_packing_with_token_slices_keeps_slices_whole_samples():
    from dynabatch.plan.slice_costs import PolynomialSliceCostModel

    rng = np.random.default_rng(5)
    e = np.concatenate([rng.integers(8, 100, 60), [3000]]).astype(np.int64)
    d = np.zeros_like(e)
    cost = PolynomialCostModel(overhead_s=2e-3)
    plan = plan_step(e, d, cost, 4, family="causal", pack_rows="auto", slice_cost_model=PolynomialSliceCostModel())
    seen = [i for p in plan.replicas[0] if not p.is_slice for row in p.row_samples for i in row]
    assert sorted(seen + list(plan.sliced_samples)) == list(range(len(e)))


def test_device_default_is_auto_on_cuda_and_off_elsewhere():
    """``--pack-rows device`` (the default): auto on CUDA (measured on an H200), off on CPU and in plan/simulate."""
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.config.resolve import Found, decide, lower
    from dynabatch.plan.step import DEFAULT_PACK_ROWS

    def pack_rows_on(choice: str, device_type: str | None) -> str:  # the resolver's rule, in the planner's spelling
        found = Found(cuda_available=None if device_type is None else device_type == "cuda")
        return lower("pack_rows", decide(TrainConfig(pack_rows=choice), "pack_rows", found))

    assert TrainConfig().pack_rows == DEFAULT_PACK_ROWS == "device"
    assert [pack_rows_on("device", d) for d in ("cuda", "cpu", None)] == ["auto", "off", "off"]
    assert [pack_rows_on(v, "cuda") for v in ("auto", "off", "flat")] == ["auto", "off", "flat"]
    TrainConfig(attention="dense")  # the default is not refused with the dense path (the planner turns it off)


@pytest.mark.parametrize("pack_rows", ["auto", "off", "flat", "device"])
def test_trainer_planner_runs_packed_rows(toy_data, pack_rows):
    """The runtime planner passes ``TrainConfig.pack_rows`` (``device`` resolved: off on this CPU) to
    plan_step: its collated micro-batches hold every sample of the global batch exactly once (several per row
    when packed), priced per segment. (Baseline candidates off: this is about the DP's plan.)"""
    from dynabatch.training.config import TrainConfig
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model

    t5 = is_seq2seq(toy_data.family)
    name = "t5-tiny" if t5 else "gpt2-tiny"
    cfg = TrainConfig(model=name, stages=2, global_batch_tokens=4096, max_input_len=128, max_target_len=32,
                      memory_gib=4.0, pack_rows=pack_rows, plan_candidates="off")  # the DP's own plan
    model = build_model(name, vocab_size=toy_data.tokens.vocab_size)
    cost_model = planner_cost_model(cfg, model.config, layout_for(model, 2))
    limits = LengthLimits("t5" if t5 else "gpt2", max_input_len=128, max_target_len=32, max_seq_len=128)
    planner = StepPlanner(GlobalBatcher(toy_data, limits, token_budget=4096), cfg, cost_model, toy_data.tokens)
    planned = planner()
    rows = [row for mb in planned.replica_micro_batches[0] for row in mb.sample_ids]
    assert sorted(i for row in rows for i in row) == list(range(len(planned.batch)))
    assert planner.pack_rows == ("off" if pack_rows == "device" else pack_rows)
    assert (max(len(r) for r in rows) > 1) == (planner.pack_rows != "off")  # short toy samples: packing pays here
    if pack_rows == "flat":
        assert all(len(mb.sample_ids) == 1 for mb in planned.replica_micro_batches[0])
        # on CPU a flat row holds at most the length limits (FLAT_ROW_LIMITS), as a packing_free row
        assert planner.flat_row == ((128, 32) if t5 else (128, 0))
        for shape in planned.shapes[0]:
            assert shape[1] <= 128 and shape[2] <= 32
    assert planned.predicted_step_s > 0


@pytest.mark.parametrize("family", ["causal", "seq2seq"])
@pytest.mark.parametrize("seed", range(3))
def test_auto_is_never_predicted_slower_than_the_plan_it_starts_from(family, seed):
    """``pack_rows="auto"`` plans the step ``off``'s ways too and keeps another plan only when it scores lower, so
    on heavy-tailed batches its plan never scores above ``off``'s: under the default score (the step formula
    with every piece priced by its pairs) against the dense planner's plan priced that way, and under a caller's
    score (the padding-free step formula, fill-and-drain weights tried) against ``off`` with and without
    per-segment pricing (the trainer plans ``off`` with it), one and two replicas."""
    from dynabatch.plan.formula import formula_price
    from dynabatch.plan.step import _priced_objective, with_pairs

    rng = np.random.default_rng(seed)
    n = 160
    long = rng.random(n) < 0.15  # 85% short (median ~200 tokens), 15% over [256, 1024]
    total = np.where(long, rng.integers(256, 1025, n), np.clip(rng.lognormal(np.log(200), 0.6, n), 8, 1024))
    total = total.astype(np.int64)
    d = np.maximum(1, total // 8)  # targets (a decoder-only model plans inputs + targets as one sequence)
    e = total - d
    cost = PolynomialCostModel(overhead_s=2e-3, memory_budget_bytes=64 * 2**30)
    for replicas in (1, 2):
        off = plan_step(e, d, cost, 4, family=family, num_replicas=replicas)
        auto = plan_step(e, d, cost, 4, family=family, num_replicas=replicas, pack_rows="auto")
        assert _priced_objective(auto, cost) <= _priced_objective(with_pairs(off, e, d), cost)
        score = formula_price(cost, e, d)
        auto = plan_step(e, d, cost, 4, family=family, num_replicas=replicas, pack_rows="auto", score=score)
        for segments in (False, True):
            off = plan_step(e, d, cost, 4, family=family, num_replicas=replicas, score=score,
                            segment_pricing=segments)
            assert score(auto) <= score(off)


def test_trainer_score_of_many_plans_is_each_plans_own():
    """The trainer's score prices all the plans plan_step asks about at once (``score.many``: one cost-model call
    for every piece): each plan's score is the one it gets alone, for one and two replicas."""
    import os

    from dynabatch.commands.common import add_workload_arguments, resolve
    from dynabatch.training.step_score import simulated_step_time
    import argparse

    heavy = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "heavy_tail_1024.npz")
    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    w = resolve(p.parse_args(["--model", "t5", "--lengths", heavy]))
    z = np.load(heavy)
    e, d = z["input_len"][:120].astype(np.int64), z["target_len"][:120].astype(np.int64)
    score = simulated_step_time(w.cost_model, None, 40 * 2**30, (e, d))
    plans = [plan_step(e, d, w.cost_model, 4, family="t5", num_replicas=r, pack_rows=m)
             for r in (1, 2) for m in ("off", "auto", "flat")]
    assert score.many(plans) == [score(p) for p in plans]
