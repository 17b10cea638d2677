"""Validator: deadlocks, pairing, data dependencies, buffers and memory, found by symbolic execution."""

from __future__ import annotations

import time

import numpy as np
import pytest

from dynabatch.schedule.compute import ComputeOp, ComputeSchedule, Phase
from dynabatch.schedule.ir import ExecutionPlan, Instr, Op, PipelineSpec, TensorSpec
from dynabatch.schedule.lower import assign_slots, lower
from dynabatch.schedule.validate import PlanValidationError, validate, validate_or_raise

F, B = Phase.FORWARD, Phase.BACKWARD
GIB = 2.0**30


def one_f_one_b(S: int, M: int) -> ComputeSchedule:
    stages = []
    for s in range(S):
        w = min(M, S - s)
        ops = [ComputeOp(F, m) for m in range(w)]
        for m in range(M):
            ops += [ComputeOp(B, m)] + ([ComputeOp(F, w + m)] if w + m < M else [])
        stages.append(tuple(ops))
    return ComputeSchedule(tuple(stages), M, "1f1b")


def gpipe(S: int, M: int) -> ComputeSchedule:
    ops = tuple(ComputeOp(F, m) for m in range(M)) + tuple(ComputeOp(B, m) for m in reversed(range(M)))
    return ComputeSchedule((ops,) * S, M, "gpipe")


def lowered(cs: ComputeSchedule, d_model: int = 4) -> dict[int, ExecutionPlan]:
    shapes = np.array([[1 + m % 3, 4 + m, 0] for m in range(cs.num_micro_batches)])
    return lower(cs, shapes, PipelineSpec.gpt(cs.num_stages, d_model))


def make_plans(lists: dict[int, list[str]], M: int) -> dict[int, ExecutionPlan]:
    """Plans of one replica from compact keys (peers and tags of replica 0 filled in, slots assigned)."""
    S = len(lists)
    plans = {}
    for r, keys in lists.items():
        instrs, num_slots = assign_slots([Instr.from_str(k) for k in keys])
        plans[r] = ExecutionPlan(r, r, S, 0, 1, M, num_slots, tuple(instrs))
    return plans


def naive_lowering(cs: ComputeSchedule) -> dict[int, ExecutionPlan]:
    """Receive just before the compute, send right after it, wait for sends at the end: fine under
    gloo's tag matching, but both ends of a link do not issue their ops in the same order."""
    S, M = cs.num_stages, cs.num_micro_batches
    lists = {}
    for s, ops in enumerate(cs.stages):
        keys, sends = [], []
        for op in ops:
            m = op.micro_batch
            if op.phase is F:
                keys += [f"{s}RECV_F{m}", f"{s}WAIT_RECV_F{m}"] if s > 0 else []
                keys += [f"{s}LOAD{m}", f"{s}F{m}"]
                sends += [f"SEND_F{m}"] if s < S - 1 else []
            else:
                keys += [f"{s}RECV_B{m}", f"{s}WAIT_RECV_B{m}"] if s < S - 1 else []
                keys.append(f"{s}B{m}")
                sends += [f"SEND_B{m}"] if s > 0 else []
            if sends and f"{s}{sends[-1]}" not in keys:
                keys.append(f"{s}{sends[-1]}")
        keys += [f"{s}WAIT_{x}" for x in sends] + [f"{s}FREE{m}" for m in range(M)] + [f"{s}REDUCE", f"{s}STEP"]
        lists[s] = keys
    return make_plans(lists, M)


def edit(plan: ExecutionPlan, fn) -> ExecutionPlan:
    """A copy of ``plan`` whose instruction list is ``fn(list of instructions)``."""
    instrs = list(plan.instructions)
    instrs = fn(instrs) or instrs
    return ExecutionPlan(plan.rank, plan.stage, plan.num_stages, plan.replica_index, plan.num_replicas,
                         plan.num_micro_batches, plan.num_slots, tuple(instrs), plan.step)


def index(instrs: list[Instr], key: str) -> int:
    return [str(i) for i in instrs].index(key)


def move_before(key: str, anchor: str):
    def fn(instrs):
        ins = instrs.pop(index(instrs, key))
        instrs.insert(index(instrs, anchor), ins)

    return fn


def errors_of(plans, **kw) -> str:
    report = validate(plans, **kw)
    assert not report.ok
    return "\n".join(report.errors)


# ------------------------------------------------------------------------------ valid plans


def test_lowered_plan_is_ok_and_reports_counts():
    plans = lowered(one_f_one_b(3, 5))
    report = validate(plans)
    assert report.ok, report
    assert report.errors == () and report.deadlocked_ranks == ()
    assert report.num_instructions == sum(len(p.instructions) for p in plans.values())
    assert set(report.peak_memory_bytes) == {0, 1, 2}
    assert all(v > 0 for v in report.peak_memory_bytes.values())  # buffers are counted without costs
    assert validate_or_raise(list(plans.values())).ok


def test_validation_is_fast():
    plans = lowered(one_f_one_b(4, 100), d_model=64)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        report = validate(plans)
        best = min(best, time.perf_counter() - t0)
    assert report.ok
    assert best < 0.05, f"validating 4 ranks x 100 micro-batches took {best * 1e3:.1f} ms"


# ------------------------------------------------------------------------------ deadlocks


def test_swapped_receive_order_is_caught():
    plans = lowered(one_f_one_b(2, 4))
    plans[1] = edit(plans[1], move_before("1RECV_F2", "1RECV_F1"))
    report = validate(plans)
    assert not report.ok
    text = "\n".join(report.errors)
    assert "mismatch rank 0 -> rank 1: send #1 is 0SEND_F1" in text and "receive #1 is 1RECV_F2" in text
    assert any(e.startswith("deadlock: rank 1 blocked at") and "1WAIT_RECV_F1" in e for e in report.errors)
    assert 1 in report.deadlocked_ranks


def test_cyclic_compute_order_is_reported_as_deadlock_not_raised():
    cyclic = ComputeSchedule.from_str("F0 B0 F1 B1\nF1 B1 F0 B0")  # each stage waits for the other
    report = validate(naive_lowering(cyclic))
    assert not report.ok
    assert report.deadlocked_ranks == (0, 1)
    text = "\n".join(report.errors)
    assert "deadlock: rank 0 blocked at" in text and "0WAIT_RECV_B0" in text
    assert "deadlock: rank 1 blocked at" in text and "1WAIT_RECV_F1" in text
    gloo = validate(naive_lowering(cyclic), semantics="gloo")  # tag matching: a pure dependency cycle
    assert gloo.deadlocked_ranks == (0, 1)
    assert any("rank 0 has not issued 0SEND_F1; rank 0 is blocked at #4 0WAIT_RECV_B0" in e for e in gloo.errors)


def test_naive_lowering_deadlocks_under_in_order_links():
    """Receive-just-in-time lowering of 1F1B: rank 0 sends F1 while rank 1 sends B0; NCCL runs a link's
    ops in issue order, so both sends wait for receives queued behind them."""
    plans = naive_lowering(one_f_one_b(2, 2))
    text = errors_of(plans)
    assert "link 0-1 order differs at op #1: rank 0 issues 0SEND_F1, rank 1 issues 1SEND_B0" in text
    assert "both ends send first" in text
    assert validate(plans, semantics="gloo").ok  # gloo matches by tag: this order is fine there
    assert validate(lowered(one_f_one_b(2, 2))).ok  # the planned order of the real lowering


def test_blocking_sends_on_both_ends_deadlock():
    lists = {
        0: "0LOAD0 0F0 0SEND_F0 0WAIT_SEND_F0 0RECV_B0 0WAIT_RECV_B0 0B0 0FREE0 0REDUCE 0STEP".split(),
        1: "1LOAD0 1SEND_B0 1WAIT_SEND_B0 1RECV_F0 1WAIT_RECV_F0 1F0 1B0 1FREE0 1REDUCE 1STEP".split(),
    }
    text = errors_of(make_plans(lists, 1))
    assert "deadlock: rank 0 blocked at #3 0WAIT_SEND_F0" in text
    assert "both ends send first" in text
    assert "sends a gradient before its backward" in text


def test_reduce_is_a_barrier_across_replicas():
    shapes = np.array([[1, 4, 0]] * 2)
    spec = PipelineSpec.gpt(2, 4)
    plans = {**lower(one_f_one_b(2, 2), shapes, spec, replica_index=0, num_replicas=2),
             **lower(gpipe(2, 2), shapes, spec, replica_index=1, num_replicas=2)}
    assert validate(plans).ok
    plans[2] = edit(plans[2], lambda xs: [x for x in xs if x.op is not Op.REDUCE_GRADS])
    text = errors_of(plans)
    assert "deadlock: rank 0 blocked at" in text and "waiting for ranks [2] to reach REDUCE" in text
    assert "rank 2 #" in text and "optimizer step before REDUCE" in text


# ------------------------------------------------------------------------------ pairing


@pytest.mark.parametrize(
    "tensor, shown",
    [
        (TensorSpec("hidden", (2, 5, 5), "bfloat16"), "hidden:bfloat16[2x5x5]"),  # shape
        (TensorSpec("hidden", (2, 5, 4), "float32"), "hidden:float32[2x5x4]"),  # dtype
        (TensorSpec("h", (2, 5, 4), "bfloat16"), "h:bfloat16[2x5x4]"),  # name
    ],
)
def test_shape_dtype_and_name_mismatch(tensor, shown):
    plans = lowered(one_f_one_b(2, 3))  # micro-batch 1 sends hidden:bfloat16[2x5x4]

    def corrupt(instrs):
        k = index(instrs, "1RECV_F1")
        i = instrs[k]
        instrs[k] = Instr(i.op, i.stage, i.micro_batch, i.peer, i.slot, i.tag, None, (tensor,))

    plans[1] = edit(plans[1], corrupt)
    text = errors_of(plans)
    assert "mismatch rank 0 -> rank 1: send #1 is 0SEND_F1" in text
    assert f"(tensors hidden:bfloat16[2x5x4] vs {shown})" in text


def test_tag_mismatch():
    plans = lowered(one_f_one_b(2, 2))

    def retag(instrs):
        k = index(instrs, "0SEND_F1")
        i = instrs[k]
        instrs[k] = Instr(i.op, i.stage, i.micro_batch, i.peer, i.slot, 99, None, i.tensors)

    plans[0] = edit(plans[0], retag)
    assert "(tag 99 vs 2)" in errors_of(plans)


def test_missing_receive_and_missing_plan():
    plans = lowered(one_f_one_b(2, 2))
    plans[1] = edit(plans[1], lambda xs: [x for x in xs if str(x) not in ("1RECV_F1", "1WAIT_RECV_F1")])
    text = errors_of(plans)
    assert "rank 0 sends 2 messages to rank 1, which posts 1 receives from it" in text
    assert "forward before its input activation arrived" in text
    only = {0: lowered(one_f_one_b(2, 2))[0]}
    assert "names peer rank 1, which has no plan" in errors_of(only)
    assert "replica 0 lacks plans for stages [1]" in errors_of(only)


# ------------------------------------------------------------------------------ data dependencies


@pytest.mark.parametrize(
    "rank, fn, message",
    [
        (1, move_before("1F0", "1WAIT_RECV_F0"), "1F0: forward before its input activation arrived"),
        (0, move_before("0B0", "0WAIT_RECV_B0"), "0B0: backward before its output gradient arrived"),
        (1, move_before("1B0", "1F0"), "1B0: backward before its forward"),
        (1, move_before("1F1", "1LOAD1"), "1F1: forward before LOAD"),
        (0, move_before("0SEND_F1", "0F1"), "0SEND_F1: sends an activation before its forward"),
        (0, move_before("0STEP", "0REDUCE"), "0STEP: optimizer step before REDUCE"),
        (0, move_before("0REDUCE", "0B1"), "gradient reduce before all backwards (1 missing)"),
        (0, move_before("0FREE0", "0B0"), "0B0: uses micro-batch 0's buffers after its FREE"),
        (0, move_before("0FREE0", "0B0"), "0FREE0: frees the micro-batch before its backward"),
        (1, move_before("1FREE0", "1WAIT_SEND_B0"), "frees buffers with transfers in flight: 1SEND_B0"),
        (1, lambda xs: [x for x in xs if str(x) != "1WAIT_SEND_B1"], "transfers never waited: 1SEND_B1"),
        (1, lambda xs: [x for x in xs if str(x) != "1B1"], "no backward of micro-batches [1]"),
        (0, lambda xs: xs + [xs[index(xs, "0F1")]], "runs the forward twice"),
    ],
)
def test_data_dependency_violations(rank, fn, message):
    plans = lowered(one_f_one_b(2, 2))
    plans[rank] = edit(plans[rank], fn)
    assert message in errors_of(plans)


def test_slot_clash_and_unfreed_slot():
    plans = lowered(one_f_one_b(2, 2))

    def reslot(instrs):  # micro-batch 1 claims slot 0 while micro-batch 0 still holds it
        return [
            Instr(i.op, i.stage, i.micro_batch, i.peer, 0, i.tag, i.waits_on, i.tensors) if i.micro_batch == 1 else i
            for i in instrs
        ]

    plans[0] = edit(plans[0], reslot)
    assert "0LOAD1: slot 0 still holds micro-batch 0" in errors_of(plans)
    plans = lowered(one_f_one_b(2, 2))
    plans[0] = edit(plans[0], lambda xs: [x for x in xs if str(x) != "0FREE1"])
    assert "rank 0: slots never freed (slot: micro-batch) {1: 1}" in errors_of(plans)


def test_unknown_semantics():
    with pytest.raises(ValueError, match="valid: nccl, gloo"):
        validate(lowered(one_f_one_b(2, 1)), semantics="mpi")


def test_validate_or_raise():
    plans = lowered(one_f_one_b(2, 2))
    plans[0] = edit(plans[0], move_before("0STEP", "0REDUCE"))
    with pytest.raises(PlanValidationError, match="INVALID.*\n.*optimizer step before REDUCE") as info:
        validate_or_raise(plans)
    assert isinstance(info.value, ValueError) and not info.value.report.ok


# ------------------------------------------------------------------------------ memory


def test_memory_limit_separates_1f1b_from_gpipe():
    S, M = 4, 8
    stored, peak = np.full((S, M), 1.0 * GIB), np.full((S, M), 0.5 * GIB)
    kw = dict(stored_bytes=stored, peak_bytes=peak, memory_limit_bytes=4.6 * GIB)
    ok = validate(lowered(one_f_one_b(S, M)), **kw)
    assert ok.ok, ok
    # stage 0 of 1F1B holds S micro-batches when it runs B0: 4 stored + 0.5 transient (+ tiny buffers)
    assert ok.peak_memory_bytes[0] == pytest.approx(4.5 * GIB, abs=1e4)
    assert ok.peak_memory_bytes[3] == pytest.approx(1.5 * GIB, abs=1e4)
    bad = validate(lowered(gpipe(S, M)), **kw)
    assert not bad.ok
    assert bad.errors[0] == (
        "rank 0 #13 0F4: memory 5.000 GiB live + 0.000 GiB transient = 5.000 GiB > limit 4.600 GiB "
        "(stage 0, micro-batches in flight: [0, 1, 2, 3, 4])"
    )
    assert sum("> limit" in e for e in bad.errors) == S  # first violation of every rank
    assert bad.peak_memory_bytes[0] == pytest.approx(8.5 * GIB, abs=1e4)


def test_per_stage_limits_and_per_replica_costs():
    S, M = 2, 3
    spec = PipelineSpec.gpt(S, 4)
    shapes = np.array([[1, 4, 0]] * M)
    plans = {**lower(gpipe(S, M), shapes, spec, replica_index=0, num_replicas=2),
             **lower(gpipe(S, M), shapes, spec, replica_index=1, num_replicas=2)}
    small, large = np.ones((S, M)), np.full((S, M), 1000.0)
    report = validate(plans, stored_bytes={0: small, 1: large}, memory_limit_bytes=[1e6, 2500.0])
    assert [r for r in report.peak_memory_bytes] == [0, 1, 2, 3]
    assert not report.ok and len(report.errors) == 1 and report.errors[0].startswith("rank 3 #")
    with pytest.raises(ValueError, match="no entry for replica 1"):
        validate(plans, stored_bytes={0: small})
    with pytest.raises(ValueError, match="must be \\(2, 3\\)"):
        validate(plans, stored_bytes=np.ones((3, 3)))


def test_buffer_bytes_are_exact():
    plans = lower(ComputeSchedule.from_str("F0 B0\nF0 B0"), np.array([[2, 8, 0]]), PipelineSpec.gpt(2, 4))
    report = validate(plans)
    # rank 0: loads 3 x (2, 8) int64; the activation (2, 8, 4) bf16 it sends is part of stored bytes,
    # the gradient buffer it receives is not
    assert report.peak_memory_bytes[0] == 3 * 2 * 8 * 8 + 2 * 8 * 4 * 2
    # rank 1: received activation, loads 2 x (2, 8) int64, input gradient it sends back
    assert report.peak_memory_bytes[1] == 2 * (2 * 8 * 4 * 2) + 2 * 2 * 8 * 8
