"""Lowering onto virtual stages (:mod:`dynabatch.schedule.virtual`) and what the validator checks of device plans."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.ir import ExecutionPlan, Instr, Op, PipelineSpec
from dynabatch.schedule.placement import Placement, list_schedule
from dynabatch.schedule.validate import validate
from dynabatch.schedule.virtual import lower_placed

CASES = [("cyclic", PipelineSpec.t5(2, 2, 16, "float32"), 2), ("interleaved:2", PipelineSpec.gpt(4, 16, "float32"), 2),
         ("interleaved:2", PipelineSpec.gpt(6, 16, "float32"), 3), ("interleaved:3", PipelineSpec.gpt(6, 16, "float32"), 2),
         ("cyclic", PipelineSpec.t5(3, 3, 16, "float32"), 3)]


def _placed(kind, spec, devices, M, seed=0, replica=0, replicas=1):
    rng = np.random.default_rng(seed)
    placement = Placement.parse(kind, devices)
    V = placement.num_stages
    fwd = rng.uniform(0.5, 2.0, (V, M))
    stored = rng.uniform(1.0, 2.0, (V, M)) * 1e6
    costs = StageCosts(fwd, 2 * fwd, stored, stored / 4, np.zeros((V, M)))
    res = list_schedule(costs, placement, np.zeros((V, M)), np.zeros(V))
    shapes = np.stack([rng.integers(1, 4, M), rng.integers(1, 30, M), rng.integers(1, 10, M)], 1)
    plans = lower_placed(res.order, shapes, spec, placement, fwd_s=fwd, bwd_s=2 * fwd, replica_index=replica,
                         num_replicas=replicas, check=False)
    return plans, costs, placement


@pytest.mark.parametrize("kind,spec,devices", CASES)
@pytest.mark.parametrize("M", [1, 2, 7, 24])
def test_device_plans_validate_under_nccl_and_gloo(kind, spec, devices, M):
    plans, _, placement = _placed(kind, spec, devices, M, seed=M)
    assert sorted(plans) == list(range(devices))
    for r, p in plans.items():
        assert p.stages == tuple(range(r, placement.num_stages, devices)) and p.num_devices == devices
        assert {i.stage for i in p.instructions} == set(p.stages)
        assert [i.op for i in p.instructions[-2:]] == [Op.REDUCE_GRADS, Op.OPTIMIZER_STEP]
        assert ExecutionPlan.from_bytes(p.to_bytes()) == p and ExecutionPlan.from_text(p.to_text()) == p
    for semantics in ("nccl", "gloo"):
        report = validate(plans, semantics=semantics)
        assert report.ok, report


def test_two_replicas_use_their_own_device_ranks():
    spec = PipelineSpec.gpt(4, 16, "float32")
    plans = {}
    for p in range(2):
        plans.update(_placed("interleaved:2", spec, 2, 5, seed=p, replica=p, replicas=2)[0])
    assert sorted(plans) == [0, 1, 2, 3]
    assert {i.peer for i in plans[2].instructions if i.peer >= 0} == {3}
    assert validate(plans).ok


def test_tags_are_unique_per_device_pair():
    """Cyclic T5 on 2 devices: links 0-1 and 2-3 both join devices 0 and 1; their messages keep distinct tags."""
    plans, _, _ = _placed("cyclic", PipelineSpec.t5(2, 2, 16, "float32"), 2, 6)
    sends = [(i.peer, i.tag) for i in plans[0].instructions if i.op in (Op.SEND_ACT, Op.SEND_GRAD)]
    assert len(sends) == len(set(sends)) and {i.stage for i in plans[0].instructions if i.op is Op.SEND_ACT} == {0, 2}


def test_memory_of_every_chunk_on_a_device_counts():
    """Device memory is the sum over its chunks: a limit that one chunk's activations fit but two do not fails."""
    plans, costs, _ = _placed("interleaved:2", PipelineSpec.gpt(4, 16, "float32"), 2, 1)
    stored, peak = costs.stored_bytes, costs.peak_bytes
    one_chunk = float(np.max(stored) + np.max(peak)) + 1e5
    assert validate(plans, stored_bytes=stored, peak_bytes=peak, memory_limit_bytes=10 * one_chunk).ok
    report = validate(plans, stored_bytes=stored, peak_bytes=peak, memory_limit_bytes=one_chunk)
    assert not report.ok and any("> limit" in e and "stages [0, 2]" in e for e in report.errors), report


def test_device_memory_error_names_the_placement_not_the_policy():
    """Over the limit on virtual stages, the one-line error names the placement's schedule and advice that
    applies there (``--policy`` orders nothing under a placement)."""
    from dynabatch.schedule.step import check_step_memory

    plans, costs, _ = _placed("interleaved:2", PipelineSpec.gpt(4, 16, "float32"), 2, 3)
    limit = float(np.max(costs.stored_bytes) + np.max(costs.peak_bytes)) + 1e5
    with pytest.raises(ValueError, match=r"step 4: the 2-chunk placement's schedule does not fit .* largest device\): "
                                         r".*> limit.*raise --memory-gib, use more devices or --placement linear$"):
        check_step_memory(plans, [costs], limit, np.zeros(4), step=4, policy="adaptive")


def _replace_instr(plan: ExecutionPlan, k: int, **fields) -> ExecutionPlan:
    ins = list(plan.instructions)
    ins[k] = dataclasses.replace(ins[k], **fields)
    return dataclasses.replace(plan, instructions=tuple(ins))


def test_validator_rejects_overlapping_chunk_buffers():
    """Giving a chunk's micro-batch the slot another chunk's live micro-batch holds is an error."""
    plans, _, _ = _placed("cyclic", PipelineSpec.t5(2, 2, 16, "float32"), 2, 4)
    plan = plans[0]
    ins = plan.instructions
    first = next(k for k, i in enumerate(ins) if i.stage == 2)  # the decoder chunk's first instruction
    live = {i.slot for i in ins[:first] if i.stage == 0} - {i.slot for i in ins[:first] if i.op is Op.FREE}
    assert live, "the encoder chunk holds buffers when the decoder chunk starts"
    bad = dict(plans)
    bad[0] = _replace_instr(plan, first, slot=min(live))
    report = validate(bad)
    assert not report.ok and any("still holds micro-batch" in e and "of stage 0" in e for e in report.errors), report


def test_validator_rejects_a_chunk_on_the_wrong_device():
    """A device plan running an instruction of a chunk another device holds (two devices would run the chunk)."""
    plans, _, _ = _placed("interleaved:2", PipelineSpec.gpt(4, 16, "float32"), 2, 3)
    k = next(k for k, i in enumerate(plans[0].instructions) if i.op is Op.FORWARD)
    bad = dict(plans)
    bad[0] = _replace_instr(plans[0], k, stage=1)
    report = validate(bad)
    assert not report.ok and any("holds an instruction of a stage it does not hold" in e for e in report.errors)


def test_plan_checks_its_device_layout():
    with pytest.raises(ValueError, match="multiple of the device count"):
        ExecutionPlan(0, 0, 3, 0, 1, 1, 0, (), num_devices=2)
    p = ExecutionPlan(1, 1, 6, 0, 1, 2, 0, (Instr(Op.REDUCE_GRADS, 1),), num_devices=2, recompute=("none",) * 4 + ("full", "none"))
    assert p.stages == (1, 3, 5) and p.recompute_of(5, 0) == "full" and p.recompute_of(3, 0) == "none"
    with pytest.raises(ValueError, match="recompute has 2 entries for 6"):
        ExecutionPlan(1, 1, 6, 0, 1, 2, 0, (), num_devices=2, recompute=("full", "none"))


def test_one_device_cannot_hold_several_chunks():
    with pytest.raises(ValueError, match="at least 2 devices"):
        lower_placed([[]], np.ones((1, 3), dtype=np.int64), PipelineSpec.gpt(2, 16), Placement("interleaved", 1, 2))
