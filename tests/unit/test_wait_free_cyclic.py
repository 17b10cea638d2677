"""DynaPipe's wait-free cyclic order on virtual stages (dynabatch.schedule.wait_free_cyclic) and its place in
placed_step."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.interleaved import replay
from dynabatch.schedule.placement import Placement
from dynabatch.schedule.virtual import placed_step
from dynabatch.schedule.wait_free_cyclic import flattened_op, wait_free_cyclic_orders


def _uniform(V: int, M: int, f: float = 1.0, b: float = 2.0, stored: float = 0.0) -> StageCosts:
    z = np.zeros((V, M))
    return StageCosts(np.full((V, M), f), np.full((V, M), b), np.full((V, M), stored), z, z)


def _random(V: int, M: int, seed: int) -> StageCosts:
    rng = np.random.default_rng(seed)
    fwd = rng.uniform(0.2, 3.0, (V, M))
    return StageCosts(fwd, 2 * fwd, rng.uniform(1.0, 4.0, (V, M)), rng.uniform(0.5, 1.0, (V, M)), np.zeros((V, M)))


def test_flattened_stages_go_up_the_forwards_and_down_the_backwards():
    assert [flattened_op(f, 3) for f in range(6)] == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]


def test_the_steady_cycle_runs_every_chunk_of_a_device_on_a_different_micro_batch():
    """Cyclic T5 on 2 devices (chunks 0-3; device 0 holds encoder chunk 0 = flattened stage 0 and decoder chunk 2
    = flattened stages 2 and 5, plus chunk 0's backward = 7). Micro-batch m sits at flattened stage k - m in cycle
    k, so from cycle 7 on device 0 runs, backwards and forwards alternating in (micro-batch, stage) order:
    B(0, k - 7), F(2, k - 2), B(2, k - 5), F(0, k)."""
    M = 12
    orders = wait_free_cyclic_orders(_uniform(4, M), Placement.parse("cyclic", 2))
    assert orders[0][:7] == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 0, 2), ("F", 2, 1), ("F", 0, 3), ("F", 2, 2)]
    start = orders[0].index(("B", 0, 0))
    for k in range(7, 10):
        cycle = orders[0][start + 4 * (k - 7): start + 4 * (k - 6)]
        assert cycle == [("B", 0, k - 7), ("F", 2, k - 2), ("B", 2, k - 5), ("F", 0, k)]


@pytest.mark.parametrize("kind,S", [("cyclic", 2), ("cyclic", 3), ("interleaved:2", 4), ("interleaved:3", 2)])
@pytest.mark.parametrize("M", [1, 5, 9])
def test_every_device_runs_each_of_its_ops_once_in_dependency_order(kind, S, M):
    placement = Placement.parse(kind, S)
    V = placement.num_stages
    orders = wait_free_cyclic_orders(_random(V, M, M), placement)
    for d, ops in enumerate(orders):
        chunks = [c for c in range(V) if placement.device(c) == d]
        assert sorted(ops) == sorted((p, c, m) for p in "FB" for c in chunks for m in range(M))
        for m in range(M):
            for a, b in zip(chunks, chunks[1:]):
                assert ops.index(("F", a, m)) < ops.index(("F", b, m)) < ops.index(("B", b, m)) < ops.index(("B", a, m))
    assert replay(orders, _random(V, M, M), placement, np.zeros((V, M)), np.zeros(V)) is not None


@pytest.mark.parametrize("kind,S,M", [("cyclic", 2, 4), ("cyclic", 2, 7), ("cyclic", 2, 8), ("cyclic", 4, 4),
                                      ("cyclic", 4, 7), ("interleaved:2", 4, 8), ("interleaved:3", 2, 8)])
def test_uniform_costs_take_the_interleaved_bound_also_for_partial_rounds(kind, S, M):
    """Equal chunks, free sends: the wait-free cyclic order takes (M v + S - 1)(f + b), interleaved 1F1B's makespan,
    also when M is not a multiple of S (7 micro-batches), where interleaved 1F1B does not apply; the list
    scheduler is never shorter."""
    placement = Placement.parse(kind, S)
    costs = _uniform(placement.num_stages, M)
    cyclic = placed_step(costs, placement, policy="wait_free_cyclic")
    assert cyclic.policy == "wait_free_cyclic"
    assert cyclic.makespan_s == pytest.approx((M * placement.chunks_per_device + S - 1) * 3.0)
    assert placed_step(costs, placement, policy="list").makespan_s >= cyclic.makespan_s
    assert placed_step(costs, placement).makespan_s == pytest.approx(cyclic.makespan_s)


def test_admission_keeps_every_device_within_its_memory():
    """Under a limit that admits 3 of 10 micro-batches at once the cyclic order keeps every device within it (a
    micro-batch enters only while every device's reserved footprint fits), where the unlimited order exceeds it."""
    placement = Placement.parse("cyclic", 2)
    costs = _uniform(4, 10, stored=1.0)
    unlimited = placed_step(costs, placement, policy="wait_free_cyclic")
    limit = 6.0  # each micro-batch stores 2 units on each device (two chunks)
    assert unlimited.peak_memory_bytes.max() > limit
    limited = placed_step(costs, placement, memory_limit_bytes=limit, policy="wait_free_cyclic")
    assert limited.fits_memory and limited.peak_memory_bytes.max() <= limit
    assert limited.makespan_s > unlimited.makespan_s


@pytest.mark.parametrize("seed", range(6))
def test_auto_keeps_the_shortest_order_that_fits(seed):
    placement = Placement.parse("cyclic", 3)
    costs = _random(6, 7 + seed, seed)
    limit = 40.0
    policies = ("list", "wait_free_cyclic") + (("interleaved_1f1b",) if (7 + seed) % 3 == 0 else ())
    results = {p: placed_step(costs, placement, memory_limit_bytes=limit, send_time=0.1, policy=p) for p in policies}
    auto = placed_step(costs, placement, memory_limit_bytes=limit, send_time=0.1)
    fitting = [r for r in results.values() if r.fits_memory]
    assert auto.fits_memory == bool(fitting)
    assert auto.makespan_s == pytest.approx(min(r.makespan_s for r in fitting or results.values()))
