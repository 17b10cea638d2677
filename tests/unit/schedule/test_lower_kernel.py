"""The numba lowering (:mod:`dynabatch.schedule.rows`) makes exactly the plans of the pure-Python passes.

``lower`` runs the kernel; :func:`~dynabatch.schedule.lower.reference_lists` is the readable reference. Equal
means byte-identical text and binary forms and equal instructions, on seeded random compute orders (1F1B
with random warm-ups, GPipe, token-slice free), random shapes and durations, both model kinds and replicas,
and on orders the adaptive search chose (the planner's real input).
"""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch.schedule.ir import ExecutionPlan, Instr, Op
from dynabatch.schedule.lower import lower, reference_lists
from dynabatch.schedule.policies import choose_schedule
from dynabatch.schedule.rows import _TABLES
from dynabatch.schedule.compute import ComputeSchedule
from test_schedule_lower import random_case  # tests/unit is on sys.path (pytest's prepend import)


def _reference_plans(cs, shapes, spec, durations, replica=0, replicas=1) -> dict[int, ExecutionPlan]:
    S, offset = cs.num_stages, replica * cs.num_stages
    lists = reference_lists(cs, np.asarray(shapes).tolist(), spec, durations.get("fwd_s"), durations.get("bwd_s"),
                            offset)
    return {offset + s: ExecutionPlan(offset + s, s, S, replica, replicas, cs.num_micro_batches, n,
                                      tuple(instrs) + (Instr(Op.REDUCE_GRADS, s), Instr(Op.OPTIMIZER_STEP, s)))
            for s, (instrs, n) in enumerate(lists)}


def _assert_same(got: dict[int, ExecutionPlan], want: dict[int, ExecutionPlan]) -> None:
    assert got.keys() == want.keys()
    for r in want:
        assert got[r].instructions == want[r].instructions, r
        assert got[r].to_text() == want[r].to_text()
        assert got[r].to_bytes() == want[r].to_bytes()


@pytest.mark.parametrize("seed", range(6))
def test_kernel_lowering_equals_the_reference_passes(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):
        cs, shapes, spec, durations = random_case(rng)
        cs = ComputeSchedule.from_str(str(cs))  # python ints (the generator's numpy ones do not serialize)
        replicas = int(rng.integers(1, 3))
        replica = int(rng.integers(replicas))
        got = lower(cs, shapes, spec, replica_index=replica, num_replicas=replicas, check=False, **durations)
        _assert_same(got, _reference_plans(cs, shapes, spec, durations, replica, replicas))


def test_kernel_lowering_equals_the_reference_on_searched_schedules():
    """Adaptive orders with ties broken by the search, the lists rank 0 lowers every step; run twice, so the
    second lowering is built from the shared instruction table."""
    from dynabatch.cost.stages import StageCosts
    from dynabatch.schedule.ir import PipelineSpec

    rng = np.random.default_rng(7)
    for _ in range(20):
        S, M = int(rng.integers(2, 6)), int(rng.integers(4, 30))
        fwd = rng.uniform(0.5, 2.0, (S, M))
        costs = StageCosts(fwd, 2 * fwd, rng.uniform(1, 3, (S, M)), rng.uniform(0, 1, (S, M)), np.ones((S, M)))
        cs, _ = choose_schedule(costs, float(rng.uniform(8, 40)), send_time=0.05, num_search_steps=8, seed=1)
        shapes = np.stack([rng.integers(1, 9, M), rng.integers(1, 300, M), np.zeros(M, np.int64)], axis=1)
        spec = PipelineSpec.gpt(S, 16)
        want = _reference_plans(cs, shapes, spec, {"fwd_s": fwd, "bwd_s": 2 * fwd})
        for _ in range(2):
            _assert_same(lower(cs, shapes, spec, fwd_s=fwd, bwd_s=2 * fwd), want)


def test_instruction_table_stays_bounded(monkeypatch):
    import dynabatch.schedule.rows as rows
    from dynabatch.schedule.ir import PipelineSpec

    monkeypatch.setattr(rows, "MAX_CACHED", 40)
    spec = PipelineSpec.gpt(2, 8)
    cs = ComputeSchedule.from_str("F0 F1 B0 B1\nF0 B0 F1 B1")
    for b in range(1, 6):
        lower(cs, np.array([[b, 8, 0], [b, 6, 0]]), spec)
        assert len(_TABLES[spec]) <= 40 + 40  # cleared once over the bound, then refilled by one lowering

