"""``--zero 2``'s equal micro-batch counts in the plan layer (:func:`dynabatch.plan.replicas.equalize_counts`): every
replica of a stage gets as many micro-batches as the one with the most, the samples are covered exactly once, and the
planned step stays close to the free counts' (the figures on 2 and 8 replicas are in docs/benchmarks/zero/)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.stages import StageCostModel
from dynabatch.cost.layer_split import balanced_layout
from dynabatch.data.baselines import BaselineOptions
from dynabatch.data.batching import LengthLimits
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.plan.candidates import baseline_candidates, baseline_plan
from dynabatch.plan.costs import PolynomialCostModel
from dynabatch.plan.global_plan import GlobalPlanner
from dynabatch.plan.replicas import equalize_counts, plan_replicas
from dynabatch.plan.slice_costs import PolynomialSliceCostModel
from dynabatch.plan.step import plan_step


def _heavy_tailed(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    e = np.clip(rng.lognormal(np.log(120), 1.0, n), 4, 1024).astype(np.int64)
    return e, np.zeros_like(e)


def _model(zero: int, replicas: int) -> StageCostModel:
    model = AnalyticCostModel.from_names("gpt-350m", "a100-40gb")
    return StageCostModel(model, balanced_layout(model, 4), 40 * 2**30, zero=zero, replicas=replicas)


def test_equalize_splits_the_costliest_group_of_the_short_replicas():
    groups = [[np.array([0, 1, 2, 3]), np.array([4])], [np.array([5]), np.array([6]), np.array([7]), np.array([8])]]
    out = equalize_counts(groups, lambda gs: [float(g.size) for g in gs])
    assert [len(gs) for gs in out] == [4, 4]
    assert [g.tolist() for g in out[0]] == [[0], [1], [2, 3], [4]]  # halves in place, the costliest split first
    assert sorted(i for gs in out for g in gs for i in g.tolist()) == list(range(9))
    # items that cannot be split or moved (a token slice of one token) still count
    fixed = [[np.array([0, 1, 2])], [np.array([3]), "slice", "slice"]]
    out = equalize_counts(fixed, lambda xs: [1.0] * len(xs), split=lambda x: None if isinstance(x, str) or x.size < 2
                          else (x[:1], x[1:]), movable=lambda x: not isinstance(x, str))
    assert [len(xs) for xs in out] == [3, 3] and out[1][1:] == ["slice", "slice"]


def test_equalize_moves_a_group_when_nothing_is_left_to_split_and_refuses_the_impossible():
    out = equalize_counts([[np.array([0])], [np.array([1]), np.array([2, 3])]], lambda gs: [float(g.size) for g in gs])
    assert [len(gs) for gs in out] == [2, 2]
    with pytest.raises(ValueError, match="same number of micro-batches.*--zero 1"):
        equalize_counts([[np.array([0])], [np.array([1]), np.array([2])]], lambda gs: [1.0] * len(gs))


@pytest.mark.parametrize("replicas", [2, 8])
def test_zero_2_plans_equal_counts_at_a_small_cost(replicas):
    e, d = _heavy_tailed(0, 512)
    free = plan_step(e, d, _model(1, replicas), 4, family="gpt2", num_replicas=replicas)
    equal = plan_step(e, d, _model(2, replicas), 4, family="gpt2", num_replicas=replicas)
    assert len({len(p) for p in free.replicas}) > 1  # the free plan's counts differ, so the test equalizes something
    assert len({len(p) for p in equal.replicas}) == 1
    for plan in (free, equal):
        assert sorted(i for pieces in plan.replicas for p in pieces for i in p.sample_ids) == list(range(e.size))
    assert equal.objective_s == pytest.approx(free.objective_s, rel=0.1)
    # plan_replicas alone equalizes as the cost model asks, and as told
    rp = plan_replicas(e, d, _model(2, replicas), 4, replicas, family="gpt2")
    assert len({p.num_micro_batches for p in rp.replicas}) == 1
    rp = plan_replicas(e, d, _model(2, replicas), 4, replicas, family="gpt2", equal_counts=False)
    assert len({p.num_micro_batches for p in rp.replicas}) > 1


@dataclasses.dataclass(frozen=True)
class _EqualCounts(PolynomialCostModel):
    """The toy cost model under ``--zero 2``."""

    @property
    def equal_micro_batch_counts(self) -> bool:
        return True


def _tiles(step, e) -> None:
    """Every sample once: whole, or as token slices tiling ``[0, L)`` in order on one replica."""
    seen = {}
    for r, pieces in enumerate(step.replicas):
        for p in pieces:
            for i in p.sample_ids:
                seen.setdefault(i, []).append((r, p.token_range))
    assert sorted(seen) == list(range(len(e)))
    for i, parts in seen.items():
        if parts[0][1] is None:
            assert len(parts) == 1
            continue
        assert len({r for r, _ in parts}) == 1
        ranges = [t for _, t in parts]
        assert ranges[0][0] == 0 and ranges[-1][1] == e[i] and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("lengths", [(300, 300, 300), (3000, 300, 300)])
def test_zero_2_halves_token_slices_and_cuts_a_one_sample_micro_batch_into_slices(lengths):
    """Three one-sample micro-batches (or slice chains) on 2 replicas: the counts even out only by cutting along the
    tokens, which the step planner does with the slice model (priced halves); without one it refuses (one line)."""
    e, d = np.array(lengths), np.zeros(3, dtype=np.int64)
    free = plan_step(e, d, PolynomialCostModel(), 4, family="gpt2", num_replicas=2,
                     slice_cost_model=PolynomialSliceCostModel())
    equal = plan_step(e, d, _EqualCounts(), 4, family="gpt2", num_replicas=2,
                      slice_cost_model=PolynomialSliceCostModel())
    assert len({len(p) for p in free.replicas}) > 1 and len({len(p) for p in equal.replicas}) == 1
    _tiles(equal, e)
    assert set(free.sliced_samples) <= set(equal.sliced_samples)
    assert set(equal.sliced_samples) == {p.sample_ids[0] for ps in equal.replicas for p in ps if p.is_slice}
    if lengths == (300, 300, 300):  # three single samples, nothing to halve without slices
        with pytest.raises(ValueError, match="same number of micro-batches .*--zero 1"):
            plan_step(e, d, _EqualCounts(), 4, family="gpt2", num_replicas=2)


@pytest.mark.parametrize("method", ["padding", "length_grouped", "token_budget", "packing", "packing_free",
                                    "packing_free_split"])
def test_zero_2_gives_a_baselines_replicas_equal_counts(method):
    """A baseline under ``--zero 2`` (the cost model asks for equal counts): its micro-batches dealt as at ``--zero 1``,
    then the replicas with fewer cut their costliest ones (rows halved, a packed row's samples halved), so every
    replica of 2 and 8 runs as many, each sample still once, each piece priced by the cost model."""
    e, d = _heavy_tailed(1, 300)
    limits = LengthLimits("gpt2", max_input_len=1024, max_target_len=1024, max_seq_len=1024)
    options = BaselineOptions(samples_per_micro_batch=5, token_budget_tokens=3000, packing_rows=4, packing_free_rows=4,
                              packing_free_split_tokens=3000)  # each deals uneven counts to 2 or 8 replicas
    uneven = 0
    for replicas in (2, 8):
        free = baseline_plan(method, e, d, limits, 4, num_replicas=replicas, options=options)
        model = _model(2, replicas)
        equal = baseline_plan(method, e, d, limits, 4, num_replicas=replicas, options=options, cost_model=model,
                              equal_counts=True)
        uneven += len({len(p) for p in free.replicas}) > 1
        assert len({len(p) for p in equal.replicas}) == 1
        assert sum(map(len, equal.replicas)) >= sum(map(len, free.replicas))
        assert sorted(i for ps in equal.replicas for p in ps for i in p.sample_ids) == list(range(e.size))
        assert all(p.time_s > 0 for ps in equal.replicas for p in ps)
        # the GlobalPlanner (what train, plan and simulate run) evens a baseline's counts as its cost model asks
        batch = GlobalBatch(0, tuple(TokenizedSample("t", np.zeros(a, np.int32), np.zeros(b, np.int32))
                                     for a, b in zip(e, d)))
        for zero, same in ((2, True), (1, len({len(p) for p in free.replicas}) == 1)):
            planned = GlobalPlanner(method, limits, 4, replicas, _model(zero, replicas), options).plan(batch).plan
            assert (len({len(p) for p in planned.replicas}) == 1) == same
    assert uneven  # the free deal was uneven somewhere, so evening was tested


@pytest.mark.parametrize("replicas", [2, 8])
def test_zero_2_evens_the_dynamic_methods_baseline_candidates(replicas):
    """Under ``--zero 2`` the dynamic method's baseline candidates are evened as a baseline method's plans are, so they
    compete with the DP's plan (whichever is chosen runs equal counts); a setting that cannot be evened is left out."""
    e, d = _heavy_tailed(2, 300)
    limits = LengthLimits("gpt2", max_input_len=1024, max_target_len=1024, max_seq_len=1024)
    free = baseline_candidates(e, d, limits, 4, num_replicas=replicas)
    equal = baseline_candidates(e, d, limits, 4, num_replicas=replicas, equal_counts=True)
    assert any(len({len(p) for p in c.plan.replicas}) > 1 for c in free)
    assert equal and all(len({len(p) for p in c.plan.replicas}) == 1 for c in equal)
    assert {c.label for c in equal} <= {c.label for c in free}
    for c in equal:
        assert sorted(i for ps in c.plan.replicas for p in ps for i in p.sample_ids) == list(range(e.size))
    batch = GlobalBatch(0, tuple(TokenizedSample("t", np.zeros(a, np.int32), np.zeros(b, np.int32))
                                 for a, b in zip(e, d)))
    chosen = GlobalPlanner("dynamic", limits, 4, replicas, _model(2, replicas)).plan(batch)
    assert len({len(p) for p in chosen.plan.replicas}) == 1
    # one-sample micro-batches, fewer than two a replica: no cutting evens them, so the setting is left out
    e3, d3 = np.array([900, 800, 700]), np.zeros(3, np.int64)
    options = BaselineOptions(token_budget_tokens=1024)
    one = {c.label: c for c in baseline_candidates(e3, d3, limits, 4, num_replicas=2, methods=["token_budget"],
                                                   options=options)}
    assert sorted(len(p) for p in one["token_budget=1024"].plan.replicas) == [1, 2]
    evened = [c.label for c in baseline_candidates(e3, d3, limits, 4, num_replicas=2, methods=["token_budget"],
                                                   options=options, equal_counts=True)]
    assert "token_budget=1024" not in evened and evened == [k for k in one if k != "token_budget=1024"]
