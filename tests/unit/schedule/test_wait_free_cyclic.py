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


def _chain_costs(V: int, M: int, seed: int) -> tuple[StageCosts, tuple[int, ...]]:
    """Random costs and token-slice chains: micro-batches 1-3 are slices of one sample, 5-6 of another."""
    links = [-1] * M
    links[2], links[3], links[6] = 1, 2, 5
    return _random(V, M, seed), tuple(links)


def _assert_chains_kept(order, links):
    """On every chunk, a slice's forward after its previous slice's and its backward before it."""
    for ops in order:
        at = {(p, c, m): k for k, (p, c, m, *_) in enumerate(ops)}
        for m, prev in enumerate(links):
            for c in {c for _, c, _ in at}:
                if prev >= 0:
                    assert at[("F", c, prev)] < at[("F", c, m)] and at[("B", c, m)] < at[("B", c, prev)]


@pytest.mark.parametrize("kind,S", [("interleaved:2", 2), ("interleaved:3", 2), ("interleaved:2", 4)])
@pytest.mark.parametrize("policy", ["list", "wait_free_cyclic", "auto"])
@pytest.mark.parametrize("limit", [60.0, 1.0])  # 1.0: nothing fits, one micro-batch at a time but a chain's slices
def test_every_order_keeps_token_slice_chains_and_lowers_to_valid_plans(kind, S, policy, limit):
    """The slices of a sample run their forwards in order and their backwards in reverse on every chunk, under the
    list scheduler, the wait-free cyclic order and auto's choice, with sends and a memory limit; the lowered device
    plans validate (the validator checks the chains on the instructions) under NCCL and gloo semantics."""
    from dynabatch.schedule.ir import PipelineSpec
    from dynabatch.schedule.validate import validate
    from dynabatch.schedule.virtual import lower_placed

    placement = Placement.parse(kind, S)
    V, M = placement.num_stages, 8
    costs, links = _chain_costs(V, M, S)
    result = placed_step(costs, placement, memory_limit_bytes=limit, send_time=0.1, policy=policy, links=links)
    _assert_chains_kept(result.order, links)
    spec = PipelineSpec.gpt(V, 16, "float32")
    shapes = np.stack([np.ones(M, dtype=int), np.full(M, 8), np.zeros(M, dtype=int)], 1)
    plans = lower_placed(result.order, shapes, spec, placement, fwd_s=costs.fwd_s, bwd_s=costs.bwd_s, check=False,
                         links=links)
    for semantics in ("nccl", "gloo"):
        report = validate(plans, semantics=semantics)
        assert report.ok, report


def test_an_order_that_breaks_a_chain_never_finishes_its_replay():
    """Interleaved 1F1B's fixed order runs slice 1's backward before slice 2's on some chunk here, which the chain
    forbids: the replay deadlocks (None), auto leaves it out and forcing it is a clear error."""
    placement = Placement.parse("interleaved:2", 2)
    costs, links = _uniform(4, 4), (-1, -1, 1, -1)
    from dynabatch.schedule.interleaved import interleaved_1f1b_orders

    assert replay(interleaved_1f1b_orders(placement, 4), costs, placement, np.zeros((4, 4)), np.zeros(4),
                  links=links) is None
    with pytest.raises(ValueError, match="out of their chains' order"):
        placed_step(costs, placement, policy="interleaved_1f1b", links=links)
    assert placed_step(costs, placement, links=links).policy in ("list", "wait_free_cyclic")
