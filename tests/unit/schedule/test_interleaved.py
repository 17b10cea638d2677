"""Interleaved 1F1B on virtual stages (dynabatch.schedule.interleaved) and the per-step choice of placed_step."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.interleaved import interleaved_1f1b_orders, replay
from dynabatch.schedule.ir import PipelineSpec
from dynabatch.schedule.placement import Placement, list_schedule
from dynabatch.schedule.validate import validate
from dynabatch.schedule.virtual import placed_step, lower_placed


def _uniform(V: int, M: int, f: float = 1.0, b: float = 2.0, stored: float = 0.0) -> StageCosts:
    z = np.zeros((V, M))
    return StageCosts(np.full((V, M), f), np.full((V, M), b), np.full((V, M), stored), z, z)


@pytest.mark.parametrize("S,v,M", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 16), (4, 3, 8), (3, 2, 9)])
def test_uniform_costs_take_the_interleaved_formula_and_beat_the_list_scheduler(S, v, M):
    """Equal chunks, free sends: interleaved 1F1B takes (M v + S - 1)(f + b), a bubble V times smaller than 1F1B's
    over whole stages; the list scheduler is never shorter."""
    placement = Placement("interleaved", S, v)
    costs, zero = _uniform(S * v, M), np.zeros((S * v, M))
    fixed = replay(interleaved_1f1b_orders(placement, M), costs, placement, zero, np.zeros(S * v))
    assert fixed.makespan_s == pytest.approx((M * v + S - 1) * 3.0)
    assert list_schedule(costs, placement, zero, np.zeros(S * v)).makespan_s >= fixed.makespan_s
    auto = placed_step(costs, placement)
    assert auto.policy == "interleaved_1f1b" and auto.makespan_s == pytest.approx(fixed.makespan_s)


def test_orders_run_every_op_of_a_device_once_and_need_whole_rounds():
    placement = Placement.parse("cyclic", 3)
    orders = interleaved_1f1b_orders(placement, 6)
    for d, ops in enumerate(orders):
        want = sorted((p, c, m) for p in "FB" for c in (d, d + 3) for m in range(6))
        assert sorted(ops) == want
        for m in range(6):  # a chunk's backward after its forward, the decoder chunk's forward after the encoder's
            assert ops.index(("F", d, m)) < ops.index(("F", d + 3, m)) < ops.index(("B", d + 3, m)) < ops.index(("B", d, m))
    assert interleaved_1f1b_orders(placement, 7) is None
    with pytest.raises(ValueError, match="multiple of 3"):
        placed_step(_uniform(6, 7), placement, policy="interleaved_1f1b")


def test_replay_refuses_orders_that_deadlock():
    placement = Placement("interleaved", 2, 2)
    orders = interleaved_1f1b_orders(placement, 2)
    orders[0] = orders[0][::-1]  # device 0 starts with a backward whose input never comes
    assert replay(orders, _uniform(4, 2), placement, np.zeros((4, 2)), np.zeros(4)) is None


def test_auto_keeps_the_list_schedule_when_interleaved_1f1b_overflows_memory():
    """Interleaved 1F1B's warm-up fixes how many micro-batches are in flight; under a limit below its peak only
    the list scheduler's admission keeps, so auto takes the list schedule although it is slower."""
    placement = Placement("interleaved", 4, 2)
    costs = _uniform(8, 8, stored=1.0)
    fixed = placed_step(costs, placement, policy="interleaved_1f1b")
    assert fixed.makespan_s < placed_step(costs, placement, policy="list").makespan_s
    limit = float(fixed.peak_memory_bytes.max()) - 1.0
    assert not placed_step(costs, placement, memory_limit_bytes=limit, policy="interleaved_1f1b").fits_memory
    auto = placed_step(costs, placement, memory_limit_bytes=limit)
    assert auto.policy == "list" and auto.fits_memory and auto.peak_memory_bytes.max() <= limit


@pytest.mark.parametrize("kind,spec,devices,M,policy", [
    ("cyclic", PipelineSpec.t5(2, 2, 16, "float32"), 2, 6, "interleaved_1f1b"),
    ("interleaved:2", PipelineSpec.gpt(8, 16, "float32"), 4, 8, "interleaved_1f1b"),
    ("interleaved:3", PipelineSpec.gpt(6, 16, "float32"), 2, 4, "interleaved_1f1b"),
    ("cyclic", PipelineSpec.t5(2, 2, 16, "float32"), 2, 5, "wait_free_cyclic"),
    ("cyclic", PipelineSpec.t5(3, 3, 16, "float32"), 3, 7, "wait_free_cyclic"),
    ("interleaved:2", PipelineSpec.gpt(8, 16, "float32"), 4, 6, "wait_free_cyclic"),
])
def test_lowered_fixed_order_plans_validate_under_nccl_and_gloo(kind, spec, devices, M, policy):
    """Interleaved 1F1B and DynaPipe's wait-free cyclic orders (dynabatch.schedule.wait_free_cyclic), lowered."""
    rng = np.random.default_rng(M)
    placement = Placement.parse(kind, devices)
    V = placement.num_stages
    fwd = rng.uniform(0.5, 2.0, (V, M))
    costs = StageCosts(fwd, 2 * fwd, np.full((V, M), 1e6), np.full((V, M), 2.5e5), np.full((V, M), 1e5))
    result = placed_step(costs, placement, send_time=1e-1, policy=policy)
    shapes = np.stack([rng.integers(1, 4, M), rng.integers(1, 30, M), rng.integers(1, 10, M)], 1)
    plans = lower_placed(result.order, shapes, spec, placement, fwd_s=fwd, bwd_s=2 * fwd, check=False)
    for semantics in ("nccl", "gloo"):
        report = validate(plans, semantics=semantics)
        assert report.ok, report


def test_a_replica_replays_another_replicas_device_orders():
    """``--zero 2`` on virtual stages: a replica runs replica 0's device orders (its chunk order fixes the order of
    the gradient reductions, which the replicas must issue alike) priced by its own costs, where alone it would have
    been ordered otherwise; ``None`` when its token-slice chains cannot run in that order."""
    from dynabatch.schedule.virtual import replayed_step

    placement = Placement("interleaved", 2, 2)
    rng = np.random.default_rng(3)
    first_costs, own_costs = (StageCosts(f, 2 * f, np.zeros((4, 5)), np.zeros((4, 5)), np.zeros((4, 5)))
                              for f in (rng.uniform(0.1, 1.0, (4, 5)), rng.uniform(0.1, 1.0, (4, 5))))
    first, alone = placed_step(first_costs, placement), placed_step(own_costs, placement)

    def ops(result):
        return [[op[:3] for op in device] for device in result.order]

    assert ops(first) != ops(alone)  # the replica would order its chunks otherwise
    shared = replayed_step(first, own_costs, placement)
    assert ops(shared) == ops(first) and shared.policy == first.policy
    # micro-batch 0 a later slice of micro-batch 4, which replica 0's order runs first: cannot follow it
    assert replayed_step(first, own_costs, placement, links=(4, -1, -1, -1, -1)) is None
    with pytest.raises(ValueError, match="run 5 micro-batches, this replica has 4"):
        replayed_step(first, StageCosts(*(np.asarray(a)[:, :4] for a in (own_costs.fwd_s, own_costs.bwd_s,
                      own_costs.stored_bytes, own_costs.peak_bytes, own_costs.send_bytes))), placement)
