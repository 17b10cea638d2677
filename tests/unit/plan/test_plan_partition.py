"""Partition DP: optimal vs brute force, kernels vs pure-Python twins, limits, plans, error messages."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dynabatch.data.baselines import RowGroup
from dynabatch.data.collate import collate_causal, collate_seq2seq
from dynabatch.data.sample import TokenizedSample
from dynabatch.plan import _kernels as K
from dynabatch.plan.costs import MicroBatchCostModel, PolynomialCostModel
from dynabatch.plan.partition import PartitionPlan, plan_partition
from reference import plan_reference as ref  # tests/ is on sys.path via its conftest.py

COST = PolynomialCostModel()


def random_lengths(rng, n, family):
    e = rng.integers(1, 400, n)
    d = rng.integers(1, 60, n) if family == "t5" else rng.integers(1, 200, n)
    return e.astype(np.int64), d.astype(np.int64)


def random_bands(rng, n, w_max, integer_times):
    """Monotone rows: times non-decreasing in the run length, as the planner guarantees."""
    steps = rng.integers(0, 4, (n, w_max)) if integer_times else rng.random((n, w_max))
    T = np.cumsum(steps, axis=1).astype(np.float64) + 1.0
    L = np.array([rng.integers(1, min(w_max, j + 1) + 1) for j in range(n)], dtype=np.int64)
    return T, L


def padded(e, d, family):
    return (e, d) if family == "t5" else (e + d, np.zeros_like(e))


def brute_force_plan(e, d, family, cost, num_stages, in_flight, max_samples=None, max_tokens=None):
    """Best ``sum + (S-1) max`` over contiguous partitions of samples already in planner order."""
    E, D = padded(e, d, family)
    n = len(e)
    best = np.inf
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [k + 1 for k, c in enumerate(cuts) if c] + [n]
        times, ok = [], True
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            b, me, md = hi - lo, E[lo:hi].max(), D[lo:hi].max()
            t, s, p = (float(x[0]) for x in cost.evaluate(np.array([b]), np.array([me]), np.array([md])))
            ok &= in_flight * s + p <= cost.memory_budget_bytes
            ok &= max_samples is None or b <= max_samples
            ok &= max_tokens is None or b * (me + md) <= max_tokens
            times.append(t)
        if ok:
            total = 0.0
            for t in times:
                total += t
            best = min(best, total + (num_stages - 1) * max(times))
    return best


# --------------------------------------------------------------------------- kernels vs twins


@pytest.mark.parametrize("seed", range(6))
def test_solve_partition_kernel_matches_twin(seed):
    rng = np.random.default_rng(seed)
    n, w_max = int(rng.integers(1, 40)), int(rng.integers(1, 12))
    T, L = random_bands(rng, n, w_max, integer_times=seed % 2 == 0)
    for num_stages, tol in itertools.product((1, 2, 4, 8), (0.0, 0.05, 0.5)):
        lengths, obj, tried = K._solve_partition(T, L, num_stages, tol)
        ref_lengths, ref_obj, ref_tried = ref.solve_partition(T, L, num_stages, tol)
        assert lengths.tolist() == ref_lengths
        assert obj == ref_obj and tried == ref_tried


@pytest.mark.parametrize("seed", range(4))
def test_small_kernels_match_twins(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 30))
    e, d = rng.integers(0, 500, n), rng.integers(0, 50, n)
    ends = np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)).astype(np.int64)
    w_lo = int(rng.integers(1, 5))
    w_hi = w_lo + int(rng.integers(1, 8))
    w_lo = rng.integers(1, 5, ends.size)  # each end its own lengths
    w_hi = w_lo + rng.integers(1, 8, ends.size)
    per_end = [ref.run_shapes(e, d, [j], lo, hi) for j, lo, hi in zip(ends.tolist(), w_lo.tolist(), w_hi.tolist())]
    runs = [(j, w, me, md) for j, (bs, es, ds) in zip(ends.tolist(), per_end)
            for w, me, md in zip(bs[0], es[0], ds[0]) if w > 0]  # (end, length, longest e, longest d) run by run
    cum_e, cum_d = np.concatenate(([0], np.cumsum(e))), np.concatenate(([0], np.cumsum(d)))
    prefix = np.concatenate([np.zeros((1, 3)), np.cumsum(rng.random((n, 3)), axis=0)])
    rows_at = np.array([4, 0, 2, 7, 5, 3, 1, 6])  # where each of b, E, D, 3 pair sums, 2 longest goes
    for flat, pairs, skip in itertools.product((False, True), (np.zeros((0, 3)), prefix), (None, 2)):
        at = rows_at.copy()
        if skip is not None:
            at[skip] = -1  # not written: stays zero
        counts, x = K._band_runs(e, d, cum_e, cum_d, pairs, flat, ends, w_lo, w_hi, at, 9)
        assert x.shape == (9, len(runs))
        b, E, D, longest_e, longest_d = (x[r] for r in rows_at[[0, 1, 2, 6, 7]])
        assert counts.tolist() == [sum(w > 0 for w in bs[0]) for bs, _, _ in per_end]
        assert longest_e.tolist() == [me for _, _, me, _ in runs]
        assert longest_d.tolist() == [md for _, _, _, md in runs]
        run_ends = np.array([j for j, _, _, _ in runs], dtype=np.int64)
        widths = np.array([w for _, w, _, _ in runs], dtype=np.int64)
        starts = run_ends + 1 - widths
        if skip is not None:
            assert not D.any()
        elif flat:
            assert D.tolist() == [int(d[i : j + 1].sum()) for i, j in zip(starts, run_ends)]
        else:
            assert D.tolist() == longest_d.tolist()
        if flat:
            assert b.tolist() == [1] * b.size
            assert E.tolist() == [int(e[i : j + 1].sum()) for i, j in zip(starts, run_ends)]
        else:
            assert (b.tolist(), E.tolist()) == (widths.tolist(), longest_e.tolist())
        sums = x[rows_at[3:6]].T
        if pairs.size:
            assert np.array_equal(sums, pairs[run_ends + 1] - pairs[starts])
        else:
            assert not sums.any()
        assert not x[8].any()  # a row nothing goes to
    times, fits = rng.random(b.size), rng.random(b.size) < 0.8
    num_fit, slowest = K._band_fits(counts, times, fits)
    q = 0
    for k, c in enumerate(counts):
        row_fits, row_times = fits[q : q + c], times[q : q + c]
        assert num_fit[k] == (c if row_fits.all() else int(np.argmin(row_fits)))
        assert slowest[k] == np.where(row_fits, row_times, 0.0).max(initial=0.0)
        q += c
    table = np.full((n, 3), -1.0)
    K._scatter_band(table, ends, w_lo, counts, times)
    written = 0
    for (j, w, _, _), t in zip(runs, times):
        if w <= 3:
            assert table[j, w - 1] == t
            written += 1
    assert (table != -1.0).sum() == written
    T, L = random_bands(rng, n, 6, integer_times=True)
    assert K._min_max_dp(T, L) == ref.min_max_dp(T.tolist(), L.tolist())
    for tol in (0.0, 0.1, 1.0):
        want = ref.cap_candidates(T.tolist(), L.tolist(), 2.0, 9.0, tol)
        assert K._cap_candidates(T, L, 2.0, 9.0, tol).tolist() == want


def test_next_band_ends_double_or_stop_past_the_bound():
    """A band doubles without a bound, and where its times are flat; under a bound it stops a margin past where its
    times, a line, reach it, if that is sooner (never before its next length, never past ``max_w``)."""
    counts = np.array([4, 4, 1, 4, 4])
    w_lo, w_hi = np.array([5, 5, 5, 5, 5]), np.array([9, 9, 6, 9, 9])
    line = 1.0 + 0.5 * np.arange(5, 9)  # t = 1 + w / 2: reaches 7 at w = 12, 10 at w = 18
    times = np.concatenate([line, np.full(4, 2.0), [3.0], line, line])
    doubled = [17, 17, 11, 17, 17]
    assert K._next_band_ends(counts, times, w_lo, w_hi, np.inf, 100, 0.1).tolist() == doubled
    assert K._next_band_ends(counts, times, w_lo, w_hi, 10.0, 100, 0.1).tolist() == doubled  # 19.8: past doubling
    got = K._next_band_ends(counts, times, w_lo, w_hi, 7.0, 100, 0.1)
    assert got.tolist() == [int(np.ceil(12 * 1.1)) + 1, 17, 11, 15, 15]
    assert K._next_band_ends(counts, times, w_lo, w_hi, 7.0, 12, 0.1).tolist() == [13, 13, 11, 13, 13]
    assert K._next_band_ends(counts, times, w_lo, w_hi, 1.0, 100, 0.1).tolist() == [10, 17, 11, 10, 10]
    for rise in (1.0 + 1e-12 * np.arange(4), 1e-300 * np.arange(4)):  # reaching the bound far out (7e300: no overflow)
        flat = np.concatenate([rise, np.full(4, 2.0), [3.0], line, line])
        assert K._next_band_ends(counts, flat, w_lo, w_hi, 7.0, 100, 0.1)[0] == 17


@pytest.mark.parametrize("seed", range(8))
def test_exact_dp_equals_brute_force_on_bands(seed):
    rng = np.random.default_rng(200 + seed)
    n = int(rng.integers(1, 11))
    T, L = random_bands(rng, n, int(rng.integers(1, n + 1)), integer_times=seed % 2 == 1)
    for num_stages in (1, 2, 3, 5):
        lengths, obj, _ = K._solve_partition(T, L, num_stages, 0.0)
        best, _ = ref.brute_force_partition(T.tolist(), L.tolist(), num_stages)
        assert obj == pytest.approx(best, rel=1e-12)
        assert sum(lengths) == n


@pytest.mark.parametrize("one_call", [False, True])
@pytest.mark.parametrize("first_band", [1, 3, 16])
def test_candidate_runs_match_a_direct_loop(monkeypatch, first_band, one_call):
    """Bands grown by doubling equal the longest run (all suffixes within limits) found run by run; so do those
    of every run priced in one call (``ONE_CALL_RUNS``)."""
    from dynabatch.plan import partition

    monkeypatch.setattr(partition, "FIRST_BAND", first_band)
    monkeypatch.setattr(partition, "ONE_CALL_RUNS", 10**9 if one_call else 0)
    rng = np.random.default_rng(300 + first_band)
    e, d = np.sort(rng.integers(1, 300, 90)), rng.integers(1, 40, 90)
    cost = PolynomialCostModel(memory_budget_bytes=6e9)
    limits = partition._Limits(cost.memory_budget_bytes, 3, 70, 20000)
    perm = np.arange(90)
    bands: list = []
    T, L = partition._candidate_runs(partition._Runs(e, d, None, False), cost, limits, perm, e, d, bands)
    for j in range(90):
        w = 0
        while w < min(j + 1, 70):
            b, me, md = w + 1, e[j - w : j + 1].max(), d[j - w : j + 1].max()
            t, s, p = cost.evaluate(np.array([b]), np.array([me]), np.array([md]))
            if 3 * s[0] + p[0] > cost.memory_budget_bytes or b * (me + md) > 20000:
                break
            assert T[j, w] == t[0]
            stored, peak = partition._run_bytes(bands, np.array([j]), np.array([w + 1]))
            assert (stored[0], peak[0]) == (s[0], p[0])  # the bytes of the same call, found in its band
            w += 1
        assert L[j] == w, j
    assert np.isnan(partition._run_bytes(bands, np.array([5]), np.array([7]))[0][0])  # never priced: longer than j + 1
    assert L.max() > 2 * first_band and L.max() < 70  # several doubling rounds ran, limits bind


class _Counting:
    """A cost model that counts the runs it prices."""

    def __init__(self, inner):
        self.inner, self.priced = inner, 0
        self.memory_budget_bytes = inner.memory_budget_bytes

    def evaluate(self, b, E, D, pairs=None):  # noqa: N803
        self.priced += int(np.size(b))
        return self.inner.evaluate(b, E, D)


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_pruned_runs_leave_the_plan_as_it_was(monkeypatch, family):
    """Runs slower than ``U / W`` (``U``: the DP's plan on the first band) are not priced, and every plan, at every
    stage count and fill-and-drain weight and from a table shared by the weights, is the one planned without
    pruning (the bound made infinite)."""
    from dynabatch.plan import partition

    monkeypatch.setattr(partition, "FIRST_BAND", 8)
    monkeypatch.setattr(partition, "ONE_CALL_RUNS", 0)
    rng = np.random.default_rng([11, len(family)])
    cost = PolynomialCostModel(memory_budget_bytes=1e18, overhead_s=2e-3)
    for trial in range(4):
        e, d = flan_like(rng, 150) if family == "t5" else random_lengths(rng, 150, family)
        for num_stages in (2, 4):
            shared: dict = {}
            plans = [plan_partition(e, d, cost, num_stages, family=family, fill_scale=s, runs_cache=shared,
                                    prune_fill_scale=0.25) for s in (1.0, 0.5, 0.25)]
            with monkeypatch.context() as m:
                m.setattr(partition, "_plan_bound", lambda *args: np.inf)
                expected = [plan_partition(e, d, cost, num_stages, family=family, fill_scale=s)
                            for s in (1.0, 0.5, 0.25)]
            for got, want in zip(plans, expected):
                assert got.objective_s == want.objective_s
                assert np.array_equal(got.order, want.order) and np.array_equal(got.boundaries, want.boundaries)
        pruned, full = _Counting(cost), _Counting(cost)
        plan_partition(e, d, pruned, 4, family=family)
        with monkeypatch.context() as m:
            m.setattr(partition, "_plan_bound", lambda *args: np.inf)
            plan_partition(e, d, full, 4, family=family)
        assert pruned.priced < 0.7 * full.priced, (trial, pruned.priced, full.priced)


def test_a_table_pruned_for_a_larger_weight_is_priced_again_for_a_smaller_one(monkeypatch):
    """A table shared by calls (``runs_cache``) was pruned under its first call's weight; a later call with a
    smaller fill-and-drain weight (whose plans may hold slower runs) prices its runs again."""
    from dynabatch.plan import partition

    monkeypatch.setattr(partition, "FIRST_BAND", 8)
    monkeypatch.setattr(partition, "ONE_CALL_RUNS", 0)
    e, d = flan_like(np.random.default_rng(5), 150)
    cost = _Counting(PolynomialCostModel(memory_budget_bytes=1e18, overhead_s=2e-3))
    shared: dict = {}
    plan_partition(e, d, cost, 4, family="t5", runs_cache=shared)
    first = cost.priced
    # a larger weight: reused (its bound U / W, for the same plan, is no larger: m + (sum - m) / W falls with W)
    large = plan_partition(e, d, cost, 4, family="t5", fill_scale=2.0, runs_cache=shared)
    assert cost.priced == first
    small = plan_partition(e, d, cost, 4, family="t5", fill_scale=0.25, runs_cache=shared)
    assert cost.priced > first
    with monkeypatch.context() as m:
        m.setattr(partition, "_plan_bound", lambda *args: np.inf)
        for got, scale in ((large, 2.0), (small, 0.25)):
            want = plan_partition(e, d, cost, 4, family="t5", fill_scale=scale)
            assert np.array_equal(got.boundaries, want.boundaries) and got.objective_s == want.objective_s


# --------------------------------------------------------------------------- planner vs brute force

BUDGETS = {"none": 1e18, "tight": 2.0e9}
BOUNDS = {"none": {}, "samples": {"max_samples": 3}, "tokens": {"max_tokens": 1200}}


@pytest.mark.parametrize("family", ["t5", "gpt2"])
@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("bound", list(BOUNDS))
def test_plan_is_optimal_over_contiguous_partitions(family, budget, bound):
    cost = PolynomialCostModel(memory_budget_bytes=BUDGETS[budget], overhead_s=2e-3)
    rng = np.random.default_rng([7, len(family), list(BUDGETS).index(budget), list(BOUNDS).index(bound)])
    for trial in range(6):
        n = int(rng.integers(1, 13))
        e, d = random_lengths(rng, n, family)
        if bound == "tokens":  # every sample must fit alone
            e, d = np.minimum(e, 900), np.minimum(d, 100)
        num_stages = int(rng.choice([1, 2, 4]))
        plan = plan_partition(e, d, cost, num_stages, family=family, cap_tolerance=0.0, **BOUNDS[bound])
        want = brute_force_plan(e[plan.order], d[plan.order], family, cost, num_stages, num_stages, **BOUNDS[bound])
        assert plan.objective_s == pytest.approx(want, rel=1e-12), (trial, n)
        check_plan(plan, e, d, cost, **BOUNDS[bound])


def check_plan(plan: PartitionPlan, e, d, cost, max_samples=None, max_tokens=None):
    n = len(e)
    flat = [i for mb in plan.micro_batches for i in mb]
    assert sorted(flat) == list(range(n)), "every sample exactly once"
    assert flat == plan.order.tolist()
    E, D = padded(e, d, plan.family)
    for mb, (b, me, md) in zip(plan.micro_batches, plan.shapes.tolist()):
        assert b == len(mb) and me == E[list(mb)].max() and md == D[list(mb)].max()
    t, s, p = cost.evaluate(plan.shapes[:, 0], plan.shapes[:, 1], plan.shapes[:, 2])
    np.testing.assert_allclose(plan.times_s, t, rtol=1e-12)
    np.testing.assert_allclose(plan.stored_bytes, s, rtol=1e-12)
    assert np.all(plan.in_flight * s + p <= cost.memory_budget_bytes)
    if max_samples is not None:
        assert plan.shapes[:, 0].max() <= max_samples
    if max_tokens is not None:
        assert (plan.shapes[:, 0] * (plan.shapes[:, 1] + plan.shapes[:, 2])).max() <= max_tokens
    total = float(np.cumsum(plan.times_s)[-1])
    assert plan.objective_s == pytest.approx(total + (plan.num_stages - 1) * plan.times_s.max(), rel=1e-12)


def flan_like(rng, n):
    e = np.clip(rng.lognormal(np.log(300), 1.0, n), 4, 2048).astype(np.int64)
    d = np.clip(rng.lognormal(np.log(5), 1.2, n), 1, 256).astype(np.int64)
    return e, d


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_tolerance_bound_and_limits_on_a_realistic_batch(family):
    rng = np.random.default_rng(3)
    e, d = flan_like(rng, 400)
    cost = PolynomialCostModel(memory_budget_bytes=12 * 2**30)
    exact = plan_partition(e, d, cost, 4, family=family, cap_tolerance=0.0)
    for tol in (0.01, 0.1):
        approx = plan_partition(e, d, cost, 4, family=family, cap_tolerance=tol)
        assert exact.objective_s <= approx.objective_s + 1e-12
        assert approx.objective_s <= exact.objective_s + tol * 3 * exact.times_s.max() + 1e-12
        assert approx.num_cap_candidates_tried <= exact.num_cap_candidates_tried
        check_plan(approx, e, d, cost)
    bounded = plan_partition(e, d, cost, 4, family=family, max_samples=5, max_tokens=6000, in_flight=6)
    check_plan(bounded, e, d, cost, max_samples=5, max_tokens=6000)
    assert bounded.objective_s >= exact.objective_s


def test_more_stages_make_micro_batches_smaller():
    e, d = flan_like(np.random.default_rng(4), 300)
    sizes = [
        plan_partition(e, d, COST, s, family="t5", cap_tolerance=0.0, in_flight=1).times_s.max() for s in (1, 4, 16)
    ]
    assert sizes[0] >= sizes[1] >= sizes[2]


# --------------------------------------------------------------------------- plan -> row groups


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_row_groups_collate_to_the_planned_shapes(family):
    rng = np.random.default_rng(5)
    e, d = random_lengths(rng, 30, family)
    samples = [
        TokenizedSample("task", rng.integers(3, 100, a).astype(np.int32), rng.integers(3, 100, b).astype(np.int32))
        for a, b in zip(e, d)
    ]
    plan = plan_partition(e, d, COST, 4, family=family)
    groups = plan.to_row_groups()
    assert all(isinstance(g, RowGroup) for g in groups) and len(groups) == plan.num_micro_batches
    for g, (b, me, md) in zip(groups, plan.shapes.tolist()):
        if family == "t5":
            mb = collate_seq2seq(samples, g.rows, 0, 0, g.encoder_len, g.decoder_len)
            assert tuple(mb.input_ids.shape) == (b, me) and tuple(mb.labels.shape) == (b, md)
        else:
            mb = collate_causal(samples, g.rows, 0, g.encoder_len)
            assert tuple(mb.input_ids.shape) == (b, me) and md == 0


# --------------------------------------------------------------------------- errors


def test_too_small_memory_names_the_sample_and_the_budget_that_works():
    e = np.array([10, 2000, 30, 1500])
    d = np.array([5, 200, 7, 100])
    _, s, p = COST.evaluate(np.ones(4, dtype=np.int64), e, d)
    need = 4 * s + p
    cost = PolynomialCostModel(memory_budget_bytes=float(need[3]))  # sample 1 does not fit
    with pytest.raises(ValueError) as info:
        plan_partition(e, d, cost, 4, family="t5")
    msg = str(info.value)
    assert "sample 1 (input_len=2000, target_len=200)" in msg
    assert f"{need[1] / 2**30:.3f} GiB" in msg and f"({int(np.ceil(need[1]))} bytes)" in msg
    assert "1 sample(s) do not fit alone" in msg
    plan = plan_partition(e, d, PolynomialCostModel(memory_budget_bytes=float(np.ceil(need[1]))), 4, family="t5")
    assert plan.shapes[:, 0].tolist().count(1) >= 1


def test_token_bound_below_one_sample_names_it():
    with pytest.raises(ValueError, match=r"sample 2 \(input_len=900, target_len=10\) has 910 padded tokens"):
        plan_partition(np.array([10, 20, 900]), np.array([1, 2, 10]), COST, 2, family="t5", max_tokens=500)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"family": "bert"}, "unknown sequence kind 'bert'; valid: causal, seq2seq"),
        ({"family": "t5", "order": "random"}, "valid: auto, lex, morton, hilbert, nn2opt"),
        ({"family": "gpt2", "order": "lex"}, "valid: auto, length"),
        ({"family": "t5", "cap_tolerance": -0.1}, "cap_tolerance"),
        ({"family": "t5", "max_samples": 0}, "max_samples must be an int >= 1"),
        ({"family": "t5", "in_flight": 1.5}, "in_flight must be an int >= 1"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_partition(np.array([3, 4]), np.array([1, 2]), COST, 2, **kwargs)


def test_bad_lengths_and_cost_model():
    with pytest.raises(ValueError, match="1-D of one length"):
        plan_partition(np.array([3, 4]), np.array([1]), COST, 2, family="t5")
    with pytest.raises(ValueError, match="empty batch"):
        plan_partition(np.array([], dtype=int), np.array([], dtype=int), COST, 2, family="t5")
    with pytest.raises(ValueError, match="num_stages must be an int >= 1"):
        plan_partition(np.array([3]), np.array([1]), COST, 0, family="t5")

    class Broken:
        memory_budget_bytes = 1e12

        def evaluate(self, b, E, D):
            return np.full(b.shape, np.nan), np.zeros(b.shape), np.zeros(b.shape)

    assert isinstance(Broken(), MicroBatchCostModel)
    with pytest.raises(ValueError, match="time_s must be finite"):
        plan_partition(np.array([3, 4]), np.array([1, 2]), Broken(), 2, family="t5")


class _Doubled:
    """A wrapper that forwards every attribute to a cost model (``evaluate_variables`` too) but prices its own way."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def evaluate(self, b, E, D, pairs=None):  # noqa: N803
        t, stored, peak = self.inner.evaluate(b, E, D, pairs=pairs)
        return 2 * t, stored, peak


def test_runs_are_priced_by_the_models_own_evaluate():
    """The compiled model prices a band's runs through ``evaluate_variables`` (the same values as ``evaluate``); a
    wrapper that forwards that method but prices otherwise, and a subclass pricing otherwise, price through their own
    ``evaluate``."""
    from dynabatch.cost.analytic import AnalyticCostModel
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.plan import partition

    class Halved(StageCostModel):
        def evaluate(self, b, E, D, pairs=None):  # noqa: N803
            t, stored, peak = super().evaluate(b, E, D, pairs)
            return t / 2, stored, peak

    layer = AnalyticCostModel.from_names("t5-base", "a100-40gb")
    model = StageCostModel(layer, balanced_layout(layer, 2), 40 * 2**30, recompute="auto")
    rng = np.random.default_rng(5)
    e, d = np.sort(rng.integers(1, 900, 60)), rng.integers(1, 200, 60)
    unit_pairs = np.stack([e * e, d * d, d * e], axis=1).astype(float)
    for flat in (False, True):
        runs = partition._Runs(e, d, partition._pair_prefix(unit_pairs, np.arange(60), 60), flat)
        counts, x = runs.band(np.arange(60), np.ones(60, dtype=np.int64), np.full(60, 9))
        rows = partition._ROWS_AT
        pairs = partition.AttentionPairs.of_sums(*(x[r] for r in rows[3:6]),
                                                 longest=tuple(x[r] for r in rows[6:]) if flat else None)
        want = model.evaluate(x[0], x[1], x[2], pairs=pairs)
        assert model.evaluate_variables(x, pairs=True, longest=flat) is not None
        for got, expected in zip(runs.price(model, x), want):
            assert np.array_equal(got, expected)
        assert np.array_equal(runs.price(_Doubled(model), x)[0], 2 * want[0])
        halved = Halved(layer, model.layout, model.memory_budget_bytes, recompute="auto")
        assert halved.evaluate_variables(x, pairs=True, longest=flat) is None
        assert np.array_equal(runs.price(halved, x)[0], want[0] / 2)


def test_running_max_rows_is_the_rows_accumulated_maximum():
    rng = np.random.default_rng(9)
    table = rng.random((7, 11))
    table[2, 4] = np.inf
    want = np.maximum.accumulate(table, axis=1)
    K._running_max_rows(table)
    assert np.array_equal(table, want)
