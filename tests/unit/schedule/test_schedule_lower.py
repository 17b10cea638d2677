"""Lowering of compute orders to per-rank instruction lists: golden plans, each pass, random plans."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch.schedule.compute import ComputeOp, ComputeSchedule, Phase
from dynabatch.schedule.ir import COMM_OPS, SEND_OPS, Instr, Op, PipelineSpec
from dynabatch.schedule.lower import (
    add_comms,
    add_send_waits,
    assign_slots,
    dataflow_times,
    link_orders,
    lower,
)
from dynabatch.schedule.validate import validate

F, B = Phase.FORWARD, Phase.BACKWARD


# ------------------------------------------------------------------ tiny compute-order generators
# (the real policies live in dynabatch.schedule.policies; these only need to be valid orders)


def one_f_one_b(S: int, M: int, warmups=None, order=None) -> ComputeSchedule:
    """1F1B: stage s runs ``warmups[s]`` forwards, then alternates backward / forward. Deadlock-free
    when warmups are non-increasing over stages, >= 1 and <= M (default ``min(M, S - s)``)."""
    warmups = [min(M, S - s) for s in range(S)] if warmups is None else warmups
    order = list(range(M)) if order is None else list(order)
    stages = []
    for w in warmups:
        ops = [ComputeOp(F, m) for m in order[:w]]
        for i, m in enumerate(order):
            ops.append(ComputeOp(B, m))
            if w + i < M:
                ops.append(ComputeOp(F, order[w + i]))
        stages.append(tuple(ops))
    return ComputeSchedule(tuple(stages), M, "1f1b")


def gpipe(S: int, M: int, forward_order=None, backward_order=None) -> ComputeSchedule:
    """All forwards, then all backwards (in ``backward_order``, the same on every stage)."""
    fo = list(range(M)) if forward_order is None else list(forward_order)
    bo = list(reversed(fo)) if backward_order is None else list(backward_order)
    ops = tuple(ComputeOp(F, m) for m in fo) + tuple(ComputeOp(B, m) for m in bo)
    return ComputeSchedule((ops,) * S, M, "gpipe")


def random_case(rng: np.random.Generator):
    """A random valid compute order, shapes, pipeline spec and optional op durations."""
    S, M = int(rng.integers(1, 6)), int(rng.integers(1, 13))
    order = rng.permutation(M)
    kind = rng.integers(3)
    if kind == 0:
        cs = one_f_one_b(S, M, order=order)
    elif kind == 1:  # random non-increasing warmups (GPipe-like front, 1F1B-like back)
        w = [int(rng.integers(1, M + 1))]
        for _ in range(S - 1):
            w.append(int(rng.integers(w[-1], M + 1)))
        cs = one_f_one_b(S, M, warmups=w[::-1], order=order)
    else:
        cs = gpipe(S, M, forward_order=order, backward_order=rng.permutation(M))
    if S >= 2 and rng.random() < 0.5:
        k = int(rng.integers(1, S))
        spec = PipelineSpec.t5(k, S - k, d_model=int(rng.integers(1, 64)), dtype="float32")
    else:
        spec = PipelineSpec.gpt(S, d_model=int(rng.integers(1, 64)))
    shapes = np.stack([rng.integers(1, 9, M), rng.integers(1, 300, M), rng.integers(1, 100, M)], axis=1)
    durations = {}
    if rng.random() < 0.5:
        durations = dict(fwd_s=rng.uniform(0.1, 2, (S, M)), bwd_s=rng.uniform(0.2, 4, (S, M)))
    return cs, shapes, spec, durations


def keys(plans) -> dict[int, str]:
    return {r: str(p) for r, p in plans.items()}


GPT2 = PipelineSpec.gpt(2, d_model=4)
SHAPES2 = np.array([[2, 8, 0], [3, 6, 0]])


# ------------------------------------------------------------------------------ golden plans


def test_golden_1f1b_two_stages_two_micro_batches():
    cs = ComputeSchedule.from_str("F0 F1 B0 B1\nF0 B0 F1 B1")
    plans = lower(cs, SHAPES2, GPT2)
    assert keys(plans) == {
        0: "0LOAD0 0F0 0SEND_F0 0LOAD1 0F1 0SEND_F1 "
        "0RECV_B0 0WAIT_RECV_B0 0WAIT_SEND_F0 0WAIT_SEND_F1 0B0 0FREE0 "
        "0RECV_B1 0WAIT_RECV_B1 0B1 0FREE1 0REDUCE 0STEP",
        1: "1RECV_F0 1LOAD0 1WAIT_RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 "
        "1LOAD1 1WAIT_RECV_F1 1F1 1B1 1SEND_B1 "
        "1WAIT_SEND_B0 1FREE0 1WAIT_SEND_B1 1FREE1 1REDUCE 1STEP",
    }
    assert [p.num_slots for p in plans.values()] == [2, 2]
    # rank 1 posts the receive of F1 while it runs B0: both neighbours send in that window (F1 and
    # B0) and neither waits for the other, since rank 0 posts RECV_B0 before it waits on anything
    assert plans[1].instructions[4].to_text() == "1RECV_F1 slot=1 peer=0 tag=2 hidden:bfloat16[3x6x4]"


def test_golden_gpipe_two_stages_two_micro_batches():
    plans = lower(gpipe(2, 2), SHAPES2, GPT2)
    assert keys(plans) == {
        0: "0LOAD0 0F0 0SEND_F0 0LOAD1 0F1 0SEND_F1 "
        "0RECV_B1 0WAIT_RECV_B1 0WAIT_SEND_F0 0WAIT_SEND_F1 0B1 0FREE1 "
        "0RECV_B0 0WAIT_RECV_B0 0B0 0FREE0 0REDUCE 0STEP",
        1: "1RECV_F0 1LOAD0 1WAIT_RECV_F0 1F0 1RECV_F1 1LOAD1 1WAIT_RECV_F1 1F1 "
        "1B1 1SEND_B1 1B0 1SEND_B0 1WAIT_SEND_B1 1FREE1 1WAIT_SEND_B0 1FREE0 1REDUCE 1STEP",
    }


def test_golden_t5_three_stages_carries_exact_tensors():
    cs = ComputeSchedule.from_str("F0 B0\nF0 B0\nF0 B0")
    plans = lower(cs, np.array([[2, 8, 4]]), PipelineSpec.t5(1, 2, d_model=4))
    assert plans[1].to_text().splitlines()[1:] == [
        "1RECV_F0 slot=0 peer=0 tag=0 enc_hidden:bfloat16[2x8x4]",
        "1LOAD0 slot=0 segment_ids:int64[2x8] decoder_segment_ids:int64[2x4] decoder_input_ids:int64[2x4]",
        "1WAIT_RECV_F0 slot=0 peer=0 tag=0",
        "1F0 slot=0",
        "1SEND_F0 slot=0 peer=2 tag=0 dec_hidden:bfloat16[2x4x4] enc_out:bfloat16[2x8x4]",
        "1RECV_B0 slot=0 peer=2 tag=1 dec_hidden:bfloat16[2x4x4] enc_out:bfloat16[2x8x4]",
        "1WAIT_RECV_B0 slot=0 peer=2 tag=1",
        "1WAIT_SEND_F0 slot=0 peer=2 tag=0",
        "1B0 slot=0",
        "1SEND_B0 slot=0 peer=0 tag=1 enc_hidden:bfloat16[2x8x4]",
        "1WAIT_SEND_B0 slot=0 peer=0 tag=1",
        "1FREE0 slot=0",
        "1REDUCE",
        "1STEP",
    ]


def test_single_stage_has_no_transfers():
    plans = lower(one_f_one_b(1, 3), np.array([[1, 5, 0]] * 3), PipelineSpec.gpt(1, 8))
    assert str(plans[0]) == "0LOAD0 0F0 0B0 0FREE0 0LOAD1 0F1 0B1 0FREE1 0LOAD2 0F2 0B2 0FREE2 0REDUCE 0STEP"
    assert plans[0].num_slots == 1


# ------------------------------------------------------------------------------ passes


def test_dataflow_times_of_1f1b():
    t = dataflow_times(ComputeSchedule.from_str("F0 F1 B0 B1\nF0 B0 F1 B1"))
    # stage 1: F0 [1, 2], B0 [2, 4], F1 [4, 5], B1 [5, 7]; stage 0: B0 [4, 6], B1 [7, 9]
    assert t.start == ((0, 1, 4, 7), (1, 2, 4, 5))
    assert t.end == ((1, 2, 6, 9), (2, 4, 5, 7))
    flat = sorted((o, s, i) for s, row in enumerate(t.order) for i, o in enumerate(row))
    assert [o for o, _, _ in flat] == list(range(8))


def test_cyclic_compute_order_is_rejected_with_the_blocked_stages():
    cyclic = ComputeSchedule.from_str("F0 B0 F1 B1\nF1 B1 F0 B0")  # stage 0 needs B0 before sending F1
    with pytest.raises(ValueError, match="deadlocks.*stage 0 at B0 waits for B0 of stage 1.*stage 1 at F1"):
        dataflow_times(cyclic)
    with pytest.raises(ValueError, match="deadlocks"):
        lower(cyclic, SHAPES2, GPT2)


def test_durations_are_checked():
    with pytest.raises(ValueError, match="fwd_s must be a \\(2, 2\\) array"):
        dataflow_times(gpipe(2, 2), fwd_s=np.zeros((2, 2)))


@pytest.mark.parametrize("seed", range(20))
def test_link_orders_respect_every_dependency(seed):
    cs, shapes, spec, durations = random_case(np.random.default_rng(seed))
    times = dataflow_times(cs, **durations)
    for link, msgs in enumerate(link_orders(cs, times)):
        assert len(msgs) == 2 * cs.num_micro_batches
        # a stage's sends appear on the link in the order it computes them
        for src in (link, link + 1):
            computed = [(op.phase, op.micro_batch) for op in cs.stages[src]]
            sent = [(F if m.op is Op.SEND_ACT else B, m.micro_batch) for m in msgs if m.src == src]
            assert sent == [x for x in computed if x in sent]
        # each message comes after every message its producer depended on (earlier in time)
        keys_ = [(m.time, m.order) for m in msgs]
        assert keys_ == sorted(keys_)


def test_add_comms_posts_receives_in_link_order_and_waits_before_compute():
    cs = one_f_one_b(3, 5)
    times = dataflow_times(cs)
    links = link_orders(cs, times)
    lists = add_comms(cs, [[1, 4, 0]] * 5, PipelineSpec.gpt(3, 8), times, links)
    for s, instrs in enumerate(lists):
        assert [i for i in instrs if i.op in (Op.FORWARD, Op.BACKWARD)] == [
            Instr(Op.FORWARD if op.phase is F else Op.BACKWARD, s, op.micro_batch) for op in cs.stages[s]
        ]
        for link in (s - 1, s):
            if 0 <= link < 2:
                peer = link + 1 if link == s else link
                link_ops = [i for i in instrs if i.op in COMM_OPS and i.peer == peer]
                issued = [(i.micro_batch, i.op in (Op.SEND_ACT, Op.RECV_ACT)) for i in link_ops]
                assert issued == [(m.micro_batch, m.op is Op.SEND_ACT) for m in links[link]]
        pos = {str(i): k for k, i in enumerate(instrs)}
        for op in cs.stages[s]:
            m = op.micro_batch
            if op.phase is F and s > 0:
                assert pos[f"{s}RECV_F{m}"] < pos[f"{s}WAIT_RECV_F{m}"] < pos[f"{s}F{m}"]
            if op.phase is F and s < 2:
                assert pos[f"{s}F{m}"] < pos[f"{s}SEND_F{m}"]
            if op.phase is B and s < 2:
                assert pos[f"{s}RECV_B{m}"] < pos[f"{s}WAIT_RECV_B{m}"] < pos[f"{s}B{m}"]
        assert not any(i.op is Op.WAIT and i.waits_on in SEND_OPS for i in instrs)


def test_add_send_waits_waits_every_send_once_and_frees_after_it():
    cs = one_f_one_b(3, 6)
    times = dataflow_times(cs)
    lists = add_send_waits(add_comms(cs, [[1, 4, 0]] * 6, PipelineSpec.gpt(3, 8), times, link_orders(cs, times)))
    for s, instrs in enumerate(lists):
        texts = [str(i) for i in instrs]
        assert texts[-2:] == [f"{s}REDUCE", f"{s}STEP"]
        for i in instrs:
            if i.op in SEND_OPS:
                wait = f"{s}WAIT_{i.op.value}{i.micro_batch}"
                assert texts.count(wait) == 1
                assert texts.index(str(i)) < texts.index(wait) < texts.index(f"{s}FREE{i.micro_batch}")
        for m in range(6):
            assert texts.count(f"{s}FREE{m}") == 1
            assert texts.index(f"{s}B{m}") < texts.index(f"{s}FREE{m}")


def test_send_waits_never_block_in_steady_state():
    """In 1F1B steady state a stage learns within a few ops that its sends completed."""
    plans = lower(one_f_one_b(4, 16), np.array([[1, 4, 0]] * 16), PipelineSpec.gpt(4, 8))
    texts = [str(i) for i in plans[1].instructions]
    deferred = [t for t in texts[texts.index("1B12") :] if "WAIT_SEND" in t]
    early = [t for t in texts[: texts.index("1B12")] if "WAIT_SEND" in t]
    assert len(early) >= 2 * 12 - 2  # only the cooldown's gradient sends wait at the end
    assert len(deferred) <= 2 * 4 + 2


def test_assign_slots_reuses_freed_slots():
    instrs = [Instr.from_str(t) for t in "0LOAD0 0F0 0LOAD1 0F1 0B0 0FREE0 0LOAD2 0F2 0B1 0FREE1 0B2 0FREE2".split()]
    out, n = assign_slots(instrs)
    assert n == 2
    assert [i.slot for i in out] == [0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0]


@pytest.mark.parametrize("S, M", [(2, 8), (4, 8), (4, 30)])
def test_slots_track_micro_batches_in_flight(S, M):
    shapes = np.array([[1, 4, 0]] * M)
    spec = PipelineSpec.gpt(S, 8)
    slots_1f1b = [p.num_slots for p in lower(one_f_one_b(S, M), shapes, spec).values()]
    slots_gpipe = [p.num_slots for p in lower(gpipe(S, M), shapes, spec).values()]
    assert slots_gpipe == [M] * S
    assert slots_1f1b[0] == S  # the first stage holds S micro-batches; no slot id grows with M
    assert max(slots_1f1b) <= S + 2


def test_replicas_use_their_own_ranks():
    shapes = np.array([[1, 4, 0]] * 3)
    spec = PipelineSpec.gpt(2, 8)
    r0 = lower(one_f_one_b(2, 3), shapes, spec, replica_index=0, num_replicas=2)
    r1 = lower(gpipe(2, 3), shapes + 1, spec, replica_index=1, num_replicas=2)
    assert sorted(r1) == [2, 3]
    assert {i.peer for i in r1[2].instructions if i.peer >= 0} == {3}
    assert validate({**r0, **r1}).ok


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(shapes=np.ones((3, 3), dtype=int)), "\\(2, 3\\) int array"),
        (dict(shapes=np.ones((2, 3))), "int array"),
        (dict(shapes=np.array([[0, 4, 0], [1, 4, 0]])), "b >= 1"),
        (dict(spec=PipelineSpec.gpt(3, 8)), "3 stages but the schedule has 2"),
        (dict(replica_index=2, num_replicas=2), "replica_index"),
    ],
)
def test_lower_rejects_bad_input(kwargs, match):
    args = dict(schedule=one_f_one_b(2, 2), shapes=SHAPES2, spec=GPT2) | kwargs
    with pytest.raises(ValueError, match=match):
        lower(**args)


# ------------------------------------------------------------------------------ random plans


def test_hundreds_of_random_plans_validate():
    rng = np.random.default_rng(2024)
    for case in range(300):
        cs, shapes, spec, durations = random_case(rng)
        plans = lower(cs, shapes, spec, check=False, **durations)
        report = validate(plans)
        assert report.ok, f"case {case}:\n{cs}\n{report}"
        for s, plan in plans.items():
            # exact buffers: every receive carries what the previous/next stage's spec sends
            for i in plan.instructions:
                if i.op is Op.RECV_ACT:
                    assert i.tensors == spec.send_tensors(s - 1, *map(int, shapes[i.micro_batch]))
