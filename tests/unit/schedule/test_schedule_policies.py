"""Policies: golden GPipe/1F1B orders, the adaptive list schedule (memory, no deadlock), choose_schedule."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.policies import adaptive, candidate_orders, choose_schedule, gpipe, one_f_one_b
from dynabatch.schedule.simulate import simulate

GOLDEN_1F1B = {
    (2, 3): """
        F0 F1 B0 F2 B1 B2
        F0 B0 F1 B1 F2 B2
    """,
    (3, 4): """
        F0 F1 F2 B0 F3 B1 B2 B3
        F0 F1 B0 F2 B1 F3 B2 B3
        F0 B0 F1 B1 F2 B2 F3 B3
    """,
    (4, 2): """
        F0 F1 B0 B1
        F0 F1 B0 B1
        F0 F1 B0 B1
        F0 B0 F1 B1
    """,
}
GOLDEN_GPIPE = {
    (2, 3): """
        F0 F1 F2 B0 B1 B2
        F0 F1 F2 B0 B1 B2
    """,
}


def dedent(text: str) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines())


def equal_costs(num_stages, num_mb, fwd=1.0, bwd=2.0, stored=1.0, peak=0.0) -> StageCosts:
    ones = np.ones((num_stages, num_mb))
    return StageCosts(fwd * ones, bwd * ones, stored * ones, peak * ones, ones)


def random_costs(rng, num_stages, num_mb) -> StageCosts:
    scale = rng.lognormal(0, 0.8, num_mb)  # (M,) micro-batch size, shared by the stages
    stage = rng.uniform(0.5, 1.5, (num_stages, 1))
    fwd = stage * scale * rng.uniform(0.8, 1.2, (num_stages, num_mb))
    return StageCosts(fwd, 2 * fwd, stage * scale * 1e9, 0.1 * stage * scale * 1e9, stage * 0 + scale * 1e6)


@pytest.mark.parametrize("shape", sorted(GOLDEN_1F1B))
def test_1f1b_golden(shape):
    num_stages, num_mb = shape
    assert str(one_f_one_b(num_mb, num_stages)) == dedent(GOLDEN_1F1B[shape])


def test_gpipe_golden():
    assert str(gpipe(3, 2)) == dedent(GOLDEN_GPIPE[(2, 3)])


def test_order_permutes_micro_batch_indices():
    assert str(one_f_one_b(3, 2, order=[2, 0, 1])) == "F2 F0 B2 F1 B0 B1\nF2 B2 F0 B0 F1 B1"
    with pytest.raises(ValueError, match=r"permutation of 0..2, got \[0, 0, 1\]"):
        one_f_one_b(3, 2, order=[0, 0, 1])


@pytest.mark.parametrize("num_stages, num_mb", [(1, 3), (2, 3), (3, 4), (4, 8), (4, 2), (5, 11)])
def test_adaptive_with_slack_0_is_1f1b_on_equal_costs(num_stages, num_mb):
    costs = equal_costs(num_stages, num_mb)
    assert str(adaptive(costs, in_flight_slack=0)) == str(one_f_one_b(num_mb, num_stages))


@pytest.mark.parametrize("num_stages, num_mb", [(2, 3), (4, 8), (3, 1)])
def test_adaptive_hides_send_time_in_steady_state(num_stages, num_mb):
    """Without an in-flight cap, equal micro-batches pay send time only on the fill and the drain."""
    costs = equal_costs(num_stages, num_mb)
    r = simulate(adaptive(costs, send_time=0.25), costs, send_time=0.25)
    assert r.makespan_s == (num_mb + num_stages - 1) * 3.0 + 2 * (num_stages - 1) * 0.25
    r_1f1b = simulate(one_f_one_b(num_mb, num_stages), costs, send_time=0.25)
    assert r.makespan_s < r_1f1b.makespan_s if num_mb > 1 else r.makespan_s == r_1f1b.makespan_s


def test_adaptive_respects_memory_limit_where_1f1b_and_gpipe_do_not():
    num_stages, num_mb = 4, 8
    costs = equal_costs(num_stages, num_mb, stored=10.0, peak=1.0)
    limit = 100.0 + 2 * 10.0 + 1.0  # model states + two micro-batches + one op's peak
    kw = dict(model_state_bytes=100.0, memory_limit_bytes=limit)
    r_1f1b = simulate(one_f_one_b(num_mb, num_stages), costs, **kw)
    r_gpipe = simulate(gpipe(num_mb, num_stages), costs, **kw)
    assert not r_1f1b.fits_memory and not r_gpipe.fits_memory
    assert r_1f1b.peak_memory_bytes[0] == 141.0 and r_gpipe.peak_memory_bytes[0] == 181.0
    schedule = adaptive(costs, limit, model_state_bytes=100.0)
    r = simulate(schedule, costs, **kw)
    assert r.fits_memory and r.peak_memory_bytes.max() == limit
    chosen, result = choose_schedule(costs, limit, model_state_bytes=100.0)
    assert result.fits_memory and chosen.policy.startswith("adaptive")
    assert result.makespan_s <= r.makespan_s


def test_adaptive_on_random_costs_is_valid_and_fits():
    """Hundreds of random cases: a valid ComputeSchedule that replays without deadlock, and within the
    memory limit whenever every micro-batch fits alone."""
    rng = np.random.default_rng(1234)
    for case in range(300):
        num_stages, num_mb = int(rng.integers(1, 7)), int(rng.integers(1, 14))
        costs = random_costs(rng, num_stages, num_mb)
        alone = (costs.stored_bytes + costs.peak_bytes).max()
        limit = None if case % 5 == 0 else float(alone * rng.uniform(1.0, 4.0))
        slack = [None, 0, 1, 3][case % 4]
        lookahead = [1, 1, 2, 100][case % 4]
        order = rng.permutation(num_mb).tolist()
        send = rng.uniform(0, 0.2, (num_stages, num_mb))
        schedule = adaptive(costs, limit, order=order, send_time=send, in_flight_slack=slack, lookahead=lookahead)
        r = simulate(schedule, costs, send_time=send, memory_limit_bytes=limit)
        assert r.fits_memory, (case, r.peak_memory_bytes, limit)
        first = [op.micro_batch for op in schedule.stages[0] if op.phase.value == "F"]
        if lookahead == 1:
            assert first == order
        lower = (costs.fwd_s + costs.bwd_s).sum(axis=1).max()
        assert r.makespan_s >= lower - 1e-9


def test_choose_schedule_is_deterministic_and_no_worse_than_1f1b():
    rng = np.random.default_rng(7)
    for _ in range(5):
        costs = random_costs(rng, 4, 12)
        a = choose_schedule(costs, send_time=0.05, seed=3)
        b = choose_schedule(costs, send_time=0.05, seed=3)
        assert str(a[0]) == str(b[0]) and a[0].policy == b[0].policy and a[1].makespan_s == b[1].makespan_s
        assert a[1].makespan_s <= simulate(one_f_one_b(12, 4), costs, send_time=0.05).makespan_s
        assert a[1].makespan_s <= simulate(gpipe(12, 4), costs, send_time=0.05).makespan_s


def test_choose_schedule_prefers_fitting_candidates():
    rng = np.random.default_rng(3)
    costs = random_costs(rng, 4, 10)
    limit = float((costs.stored_bytes + costs.peak_bytes).max() * 1.5)
    schedule, result = choose_schedule(costs, limit, policies=("gpipe", "1f1b", "adaptive"))
    assert result.fits_memory
    only_gpipe = choose_schedule(costs, limit, policies=("gpipe",), num_search_steps=0)[1]
    assert not only_gpipe.fits_memory  # nothing fits: the smallest overflow is returned, flagged


def test_candidate_orders_are_distinct_permutations():
    costs = random_costs(np.random.default_rng(0), 3, 6)
    orders = candidate_orders(costs, num_random=3, seed=0)
    assert len(orders) == len(set(orders)) >= 5
    assert all(sorted(o) == list(range(6)) for o in orders)
    assert orders[0] == tuple(range(6))


def test_policy_arguments_are_checked():
    costs = equal_costs(2, 3)
    with pytest.raises(ValueError, match=r"unknown policies \['zb'\]; valid: gpipe, 1f1b, adaptive"):
        choose_schedule(costs, policies=("zb",))
    with pytest.raises(ValueError, match=r"in_flight_slack must be None or an int >= 0, got -1"):
        adaptive(costs, in_flight_slack=-1)
    with pytest.raises(ValueError, match=r"num_stages must be an int >= 1, got 0"):
        gpipe(3, 0)


def test_adaptive_schedules_lower_and_validate_within_memory():
    """Integration with the lowering: an adaptive schedule that fits in the simulator (message buffers
    counted by with_message_buffers) lowers to per-rank plans that the validator accepts, memory included."""
    from dynabatch.schedule import lower, validate
    from dynabatch.schedule.ir import PipelineSpec
    from dynabatch.schedule.simulate import with_message_buffers

    rng = np.random.default_rng(5)
    for case in range(20):
        num_stages, num_mb = int(rng.integers(2, 5)), int(rng.integers(2, 12))
        shapes = np.stack([rng.integers(1, 8, num_mb), rng.integers(16, 512, num_mb), np.zeros(num_mb, int)], axis=1)
        tokens = shapes[:, 0] * shapes[:, 1]  # (M,)
        fwd = np.outer(rng.uniform(0.8, 1.2, num_stages), tokens * 1e-6)
        send = np.tile(2.0 * 64 * tokens, (num_stages, 1)).astype(float)  # bf16 hidden states, d_model 64
        send[-1] = 0.0
        costs = StageCosts(fwd, 2 * fwd, np.outer(np.ones(num_stages), tokens * 1e4), np.outer(np.ones(num_stages),
                           tokens * 1e3), send)
        padded = with_message_buffers(costs)
        limit = float((padded.stored_bytes + padded.peak_bytes).max() * rng.uniform(1.0, 3.0))
        schedule = adaptive(padded, limit, in_flight_slack=[None, 0, 2][case % 3])
        assert simulate(schedule, padded, memory_limit_bytes=limit).fits_memory
        plans = lower.lower(schedule, shapes, PipelineSpec.gpt(num_stages, 64), fwd_s=costs.fwd_s, bwd_s=costs.bwd_s)
        report = validate.validate(plans, stored_bytes=costs.stored_bytes, peak_bytes=costs.peak_bytes,
                                   memory_limit_bytes=limit)
        assert not report.errors, (case, report.errors[:2])
