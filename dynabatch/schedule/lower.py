"""Lower a compute schedule to per-rank instruction lists: transfers, waits, frees, slots.

Input: a :class:`~dynabatch.schedule.compute.ComputeSchedule` (each stage's F/B order), the padded
shape ``(b, E, D)`` of every micro-batch and a :class:`~dynabatch.schedule.ir.PipelineSpec`. Output:
one :class:`~dynabatch.schedule.ir.ExecutionPlan` per rank. Small passes, each testable alone:

1. :func:`dataflow_times` runs the compute orders as a dataflow (forward 1, backward 2 time units
   unless durations are given) and raises ``ValueError`` when the orders wait on each other in a cycle.
2. :func:`link_orders` fixes, for each link ``(s, s + 1)``, one order of all its messages (activations
   forward, gradients back) by simulated send time. Both ends issue their ops on the link in exactly
   this order, so every receive is posted in the order its sender sends.
3. :func:`add_comms` walks each stage's compute order: it posts a receive (``irecv``, exact buffers)
   once the simulated sender has sent it and no later than just before the compute that needs it,
   waits for it right before that compute, and starts the send (``isend``) right after the producing
   compute. Sends and receives never block; only ``WAIT`` does.
4. :func:`add_send_waits` places each send's ``WAIT`` at the first point where the rank provably knows
   (vector clocks over the receive waits) that the peer has posted the matching receive, so the wait
   never blocks; if there is none, at the end of the step. It then adds ``FREE`` once a micro-batch's
   backward ran and its sends completed, and ``REDUCE`` + ``STEP`` at the end.
5. :func:`assign_slots` gives each micro-batch in flight on a rank the lowest free buffer slot (a
   slot holds all of the micro-batch's buffers: loaded inputs, received tensors, the gradient to
   send; DeepSpeed's ``buffer_id``). 1F1B uses ``S`` slots on stage 0 and at most two more on later
   stages (a sent gradient's buffer lives until its non-blocking wait); GPipe uses ``M``.

Why it cannot deadlock, under gloo (a send completes only when its receive is posted; tags match) and
NCCL (tags ignored; a link's p2p ops run in issue order, so both ends must issue them in the same order):
starts never block, and both ends of every link issue their ops in the same order, which follows
simulated time and so never puts a message before one it depends on. The only blocking ops are
receive waits, which wait for a send that follows the producing compute, and the data dependencies of
an acyclic compute order therefore cannot form a cycle; send waits are only placed where they cannot
block. Two neighbours that send to each other in the same window issue the pair in the same order,
so the first send always meets a posted receive, never the other send. Every lowered plan is checked by
:func:`dynabatch.schedule.validate.validate` (``check=True``).

:func:`lower` runs passes 1-5 as one numba kernel over integer rows (:mod:`dynabatch.schedule._lower_kernels`)
and builds the instructions from them, sharing equal ones between steps (:mod:`dynabatch.schedule.rows`); the
pure-Python passes below stay the readable reference (:func:`reference_lists`), and the two make byte-identical
plans (tested on random and searched orders). At paper scale (4 stages, 22-41 micro-batches, 900-1,650
instructions; ``python scripts/bench_lowering.py``) a step lowers in 2.6-7.5 ms on 2 shared CPU cores, where
the pure-Python passes took 8-16 ms, most of it building frozen instructions.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from dynabatch.cost.boundary_moves import stage_columns
from dynabatch.schedule.chains import check_schedule
from dynabatch.schedule.compute import ComputeSchedule, Phase
from dynabatch.schedule.ir import RECOMPUTE_MODES, ExecutionPlan, Instr, Op, PipelineSpec, message_tag
from dynabatch.schedule.rows import lowered_lists
from dynabatch.schedule.validate import validate_or_raise

_RECV_OF = {Op.SEND_ACT: Op.RECV_ACT, Op.SEND_GRAD: Op.RECV_GRAD}


@dataclass(frozen=True)
class OpTimes:
    """Simulated start/end time and topological index of every op, indexed ``[stage][position]``."""

    start: tuple[tuple[float, ...], ...]
    end: tuple[tuple[float, ...], ...]
    order: tuple[tuple[int, ...], ...]
    """A global topological index: an op comes after every op it depends on."""


@dataclass(frozen=True)
class Message:
    """One transfer on link ``(s, s + 1)``: an activation (``SEND_F``) or a gradient (``SEND_B``)."""

    op: Op
    micro_batch: int
    src: int
    """Sending stage."""
    dst: int
    time: float
    """Simulated end of the compute that produces it."""
    order: int
    """Topological index of that compute (breaks ties)."""


def dataflow_times(schedule: ComputeSchedule, fwd_s=None, bwd_s=None) -> OpTimes:
    """Run the stages' orders as a dataflow with op durations ``fwd_s``/``bwd_s`` (``(S, M)``, > 0;
    default 1 and 2). Raises ``ValueError`` naming the blocked stages when the orders deadlock."""
    S, M = schedule.num_stages, schedule.num_micro_batches
    fwd = _durations(fwd_s, 1.0, S, M, "fwd_s").tolist()
    bwd = _durations(bwd_s, 2.0, S, M, "bwd_s").tolist()
    end_f = [[-1.0] * M for _ in range(S)]
    end_b = [[-1.0] * M for _ in range(S)]
    start = [[0.0] * len(ops) for ops in schedule.stages]
    end = [[0.0] * len(ops) for ops in schedule.stages]
    order = [[0] * len(ops) for ops in schedule.stages]
    pos, free_at, counter = [0] * S, [0.0] * S, 0
    progress = True
    while progress:
        progress = False
        for s, ops in enumerate(schedule.stages):
            while pos[s] < len(ops):
                op = ops[pos[s]]
                m = op.micro_batch
                if op.phase is Phase.FORWARD:
                    dep, dur = (end_f[s - 1][m] if s > 0 else 0.0), fwd[s][m]
                else:
                    dep, dur = (end_b[s + 1][m] if s < S - 1 else end_f[s][m]), bwd[s][m]
                if dep < 0:
                    break
                t0 = max(free_at[s], dep)
                free_at[s] = t1 = t0 + dur
                (end_f if op.phase is Phase.FORWARD else end_b)[s][m] = t1
                start[s][pos[s]], end[s][pos[s]], order[s][pos[s]] = t0, t1, counter
                counter += 1
                pos[s] += 1
                progress = True
    blocked = [s for s in range(S) if pos[s] < len(schedule.stages[s])]
    if blocked:
        waits = []
        for s in blocked:
            op = schedule.stages[s][pos[s]]
            peer = s - 1 if op.phase is Phase.FORWARD else s + 1
            waits.append(f"stage {s} at {op} waits for {op} of stage {peer}")
        raise ValueError(f"compute order deadlocks ({schedule.policy}): " + "; ".join(waits))
    return OpTimes(*(tuple(map(tuple, x)) for x in (start, end, order)))


def _durations(values, default: float, S: int, M: int, name: str) -> np.ndarray:
    if values is None:
        return np.full((S, M), default)
    a = np.asarray(values, dtype=np.float64)
    if a.shape != (S, M) or not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"{name} must be a ({S}, {M}) array of finite times > 0, got shape {a.shape}")
    return a


def link_orders(schedule: ComputeSchedule, times: OpTimes) -> list[list[Message]]:
    """Messages of each link ``(s, s + 1)`` in the one order both ends issue them: by the simulated
    end time of the producing compute, then topological index (consistent with every dependency)."""
    S = schedule.num_stages
    links: list[list[Message]] = [[] for _ in range(S - 1)]
    for s, ops in enumerate(schedule.stages):
        for i, op in enumerate(ops):
            m = op.micro_batch
            if op.phase is Phase.FORWARD and s < S - 1:
                links[s].append(Message(Op.SEND_ACT, m, s, s + 1, times.end[s][i], times.order[s][i]))
            elif op.phase is Phase.BACKWARD and s > 0:
                links[s - 1].append(Message(Op.SEND_GRAD, m, s, s - 1, times.end[s][i], times.order[s][i]))
    for msgs in links:
        msgs.sort(key=lambda x: (x.time, x.order))
    return links


def add_comms(
    schedule: ComputeSchedule,
    shapes,
    spec: PipelineSpec,
    times: OpTimes,
    links: list[list[Message]],
    rank_offset: int = 0,
) -> list[list[Instr]]:
    """Pass 3: per stage, ``LOAD``/compute plus send/receive starts and receive waits (slots unset)."""
    S = schedule.num_stages
    shapes = [tuple(int(x) for x in row) for row in shapes]
    send_tensors = [[spec.send_tensors(s, *shapes[m]) for m in range(len(shapes))] for s in range(S)]
    index = [{(msg.op, msg.micro_batch): i for i, msg in enumerate(msgs)} for msgs in links]
    out: list[list[Instr]] = []
    for s, ops in enumerate(schedule.stages):
        instrs: list[Instr] = []
        # this stage's progress on its previous / next link
        ptr = {s - 1: 0, s: 0}

        def issue(link: int, upto: int) -> None:
            """Issue this stage's ops on ``link`` up to and including link position ``upto``."""
            msgs = links[link]
            while ptr[link] <= upto:
                msg = msgs[ptr[link]]
                tensors = send_tensors[link][msg.micro_batch]
                if msg.src == s:
                    # own sends are issued right after their compute, so only the target can be one
                    assert ptr[link] == upto, f"link order inconsistent with stage {s}'s compute order"
                    instrs.append(_comm(msg.op, s, msg.micro_batch, msg.dst, tensors, rank_offset))
                else:
                    instrs.append(_comm(_RECV_OF[msg.op], s, msg.micro_batch, msg.src, tensors, rank_offset))
                ptr[link] += 1

        def issue_received(until: float) -> None:
            """Post receives of messages sent by ``until`` (simulated), stopping at an own send."""
            for link in (s - 1, s):
                if 0 <= link < S - 1:
                    msgs = links[link]
                    while ptr[link] < len(msgs) and msgs[ptr[link]].src != s and msgs[ptr[link]].time <= until:
                        issue(link, ptr[link])

        for i, op in enumerate(ops):
            m = op.micro_batch
            issue_received(times.start[s][i])
            if op.phase is Phase.FORWARD:
                if s > 0:
                    issue(s - 1, index[s - 1][(Op.SEND_ACT, m)])
                instrs.append(Instr(Op.LOAD, s, m, tensors=spec.load_tensors(s, *shapes[m])))
                if s > 0:
                    instrs.append(_wait(Op.RECV_ACT, s, m, s - 1, rank_offset))
                instrs.append(Instr(Op.FORWARD, s, m))
                if s < S - 1:
                    issue(s, index[s][(Op.SEND_ACT, m)])
            else:
                if s < S - 1:
                    issue(s, index[s][(Op.SEND_GRAD, m)])
                    instrs.append(_wait(Op.RECV_GRAD, s, m, s + 1, rank_offset))
                instrs.append(Instr(Op.BACKWARD, s, m))
                if s > 0:
                    issue(s - 1, index[s - 1][(Op.SEND_GRAD, m)])
        assert all(ptr[k] == len(links[k]) for k in ptr if 0 <= k < S - 1), f"stage {s} left link messages"
        out.append(instrs)
    return out


def _comm(op: Op, stage: int, m: int, peer_stage: int, tensors, rank_offset: int) -> Instr:
    return Instr(op, stage, m, peer=rank_offset + peer_stage, tag=message_tag(m, op), tensors=tensors)


def _wait(op: Op, stage: int, m: int, peer_stage: int, rank_offset: int) -> Instr:
    return Instr(Op.WAIT, stage, m, peer=rank_offset + peer_stage, tag=message_tag(m, op), waits_on=op)


def add_send_waits(lists: list[list[Instr]], rank_offset: int = 0) -> list[list[Instr]]:
    """Pass 4: a non-blocking ``WAIT`` for every send, ``FREE`` per micro-batch, ``REDUCE`` and ``STEP``.

    Vector clocks: a receive wait on stage ``s`` learns everything its sender had executed when it
    issued the send. A send to ``q`` can be waited without blocking once ``s`` knows ``q`` executed the
    matching receive post; that point (or the end of the step) gets the ``WAIT``.
    """
    S = len(lists)
    recv_pos: dict[tuple[int, Op, int], int] = {}  # (receiving stage, recv op, micro-batch) -> index
    for s, instrs in enumerate(lists):
        for i, ins in enumerate(instrs):
            if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                recv_pos[(s, ins.op, ins.micro_batch)] = i
    checkpoints = _receive_clocks(lists, rank_offset)
    out = []
    for s, instrs in enumerate(lists):
        positions = [p for p, _ in checkpoints[s]]
        clock_of = [[vc[q] for _, vc in checkpoints[s]] for q in range(S)]
        anchored: dict[int, list[Instr]] = {}
        at_end: list[Instr] = []
        pending: dict[int, int] = {}
        for i, ins in enumerate(instrs):
            if ins.op not in (Op.SEND_ACT, Op.SEND_GRAD):
                continue
            q = ins.peer - rank_offset
            j = recv_pos[(q, _RECV_OF[ins.op], ins.micro_batch)]
            # clocks only grow along the list: the first checkpoint after i whose clock of q passed j
            k = max(bisect_right(positions, i), bisect_right(clock_of[q], j))
            anchor = positions[k] if k < len(positions) else None
            wait = Instr(Op.WAIT, s, ins.micro_batch, peer=ins.peer, tag=ins.tag, waits_on=ins.op)
            (at_end if anchor is None else anchored.setdefault(anchor, [])).append(wait)
            pending[ins.micro_batch] = pending.get(ins.micro_batch, 0) + 1
        result: list[Instr] = []
        backward_done: set[int] = set()

        def finish(m: int) -> None:
            if m in backward_done and pending.get(m, 0) == 0:
                result.append(Instr(Op.FREE, s, m))

        for i, ins in enumerate(instrs):
            result.append(ins)
            if ins.op is Op.BACKWARD:
                backward_done.add(ins.micro_batch)
                finish(ins.micro_batch)
            for wait in anchored.get(i, ()):
                result.append(wait)
                pending[wait.micro_batch] -= 1
                finish(wait.micro_batch)
        for wait in at_end:
            result.append(wait)
            pending[wait.micro_batch] -= 1
            finish(wait.micro_batch)
        result += [Instr(Op.REDUCE_GRADS, s), Instr(Op.OPTIMIZER_STEP, s)]
        out.append(result)
    return out


def _receive_clocks(lists: list[list[Instr]], rank_offset: int) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Per stage, ``(index of a receive wait, vector clock after it)``; clock[q] = ops q has executed."""
    S = len(lists)
    clocks = [[0] * S for _ in range(S)]
    sent: dict[tuple[int, Op, int], tuple[int, ...]] = {}
    checkpoints: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in range(S)]
    pc = [0] * S
    send_of = {Op.RECV_ACT: Op.SEND_ACT, Op.RECV_GRAD: Op.SEND_GRAD}
    progress = True
    while progress:
        progress = False
        for s, instrs in enumerate(lists):
            vc = clocks[s]
            while pc[s] < len(instrs):
                ins = instrs[pc[s]]
                if ins.op is Op.WAIT and ins.waits_on in send_of:
                    snap = sent.get((ins.peer - rank_offset, send_of[ins.waits_on], ins.micro_batch))
                    if snap is None:
                        break
                    for q in range(S):
                        if snap[q] > vc[q]:
                            vc[q] = snap[q]
                    vc[s] = pc[s] + 1
                    checkpoints[s].append((pc[s], tuple(vc)))
                vc[s] = pc[s] + 1
                if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    sent[(s, ins.op, ins.micro_batch)] = tuple(vc)
                pc[s] += 1
                progress = True
    assert all(pc[s] == len(lists[s]) for s in range(S)), "comm lowering deadlocked on an acyclic compute order"
    return checkpoints


def assign_slots(instrs: list[Instr]) -> tuple[list[Instr], int]:
    """Pass 5: every instruction of micro-batch ``m`` on stage ``s`` gets ``(s, m)``'s slot: the lowest slot free
    at its first instruction, released at its ``FREE`` (a rank holding several stages, :mod:`dynabatch.schedule.
    virtual`, keeps their buffers apart). Returns the instructions and the number of slots."""
    slot_of: dict[tuple[int, int], int] = {}
    free: list[int] = []
    num_slots = 0
    out = []
    for ins in instrs:
        m = ins.micro_batch
        if m < 0:
            out.append(ins)
            continue
        key = (ins.stage, m)
        slot = slot_of.get(key)
        if slot is None:
            if free:
                slot = min(free)
                free.remove(slot)
            else:
                slot, num_slots = num_slots, num_slots + 1
            slot_of[key] = slot
        out.append(Instr(ins.op, ins.stage, m, ins.peer, slot, ins.tag, ins.waits_on, ins.tensors))
        if ins.op is Op.FREE:
            free.append(slot_of.pop(key))
    return out, num_slots


def lower(
    schedule: ComputeSchedule,
    shapes,
    spec: PipelineSpec,
    *,
    replica_index: int = 0,
    num_replicas: int = 1,
    step: int = 0,
    fwd_s=None,
    bwd_s=None,
    check: bool = True,
    links=(),
    recompute=None,
    moves=None,
) -> dict[int, ExecutionPlan]:
    """Per-rank plans of one pipeline replica; rank ``replica_index * S + s`` runs stage ``s``.

    ``shapes``: ``(M, 3)`` padded ``(b, E, D)`` per micro-batch (``PartitionPlan.shapes``; GPT ``D`` is
    ignored). ``fwd_s``/``bwd_s``: optional ``(S, M)`` op times (e.g. ``StageCosts.fwd_s``) used to
    order messages on links and to post receives. ``check`` validates the result (deadlock, pairing,
    dependencies; see :func:`~dynabatch.schedule.validate.validate_or_raise`). ``links``: token-slice
    chains (:mod:`dynabatch.schedule.chains`); the schedule must respect them and every plan carries them.
    ``recompute``: optional ``(S, M)`` activation recomputation codes (``StageCosts.recompute``, indices into
    :data:`~dynabatch.schedule.ir.RECOMPUTE_MODES`); stage ``s``'s plan carries row ``s``.
    ``moves``: optional ``(M, S - 1)`` moving stage boundaries (``StageCosts.moves``,
    :mod:`dynabatch.cost.boundary_moves`); stage ``s``'s plan carries each micro-batch's moves below and above it.
    """
    S, M = schedule.num_stages, schedule.num_micro_batches
    if spec.num_stages != S:
        raise ValueError(f"pipeline spec has {spec.num_stages} stages but the schedule has {S}")
    arr = np.asarray(shapes)
    if arr.shape != (M, 3) or not np.issubdtype(arr.dtype, np.integer) or np.any(arr < 0) or np.any(arr[:, 0] < 1):
        raise ValueError(
            f"shapes must be an ({M}, 3) int array of (b >= 1, E >= 0, D >= 0), got {arr.shape} {arr.dtype}"
        )
    if not (0 <= replica_index < num_replicas):
        raise ValueError(f"replica_index must be in [0, {num_replicas}), got {replica_index}")
    check_schedule(schedule, links)
    offset = replica_index * S
    fwd, bwd = _durations(fwd_s, 1.0, S, M, "fwd_s"), _durations(bwd_s, 2.0, S, M, "bwd_s")
    lowered = lowered_lists(schedule, [tuple(row) for row in arr.tolist()], spec, fwd, bwd, offset)
    if lowered is None:  # the kernel found an error: the reference passes raise it readably
        lowered = reference_lists(schedule, arr.tolist(), spec, fwd_s, bwd_s, offset)
    plans = {}
    for s, (instrs, num_slots) in enumerate(lowered):
        instrs = instrs + [Instr(Op.REDUCE_GRADS, s), Instr(Op.OPTIMIZER_STEP, s)]
        modes = () if recompute is None else tuple(RECOMPUTE_MODES[int(c)] for c in np.asarray(recompute)[s])
        plans[offset + s] = ExecutionPlan(
            offset + s, s, S, replica_index, num_replicas, M, num_slots, tuple(instrs), step, tuple(links), modes,
            moves=rank_moves(moves, s, S, M),
        )
    if check:
        validate_or_raise(plans)
    return plans


def rank_moves(moves, stage: int, num_stages: int, num_micro_batches: int) -> tuple[int, ...]:
    """Stage ``stage``'s :attr:`~dynabatch.schedule.ir.ExecutionPlan.moves` from a replica's ``(M, S - 1)``
    boundary moves (``None``: none): each micro-batch's move below the stage, then above it."""
    if moves is None or num_stages < 2:
        return ()
    lower, upper = stage_columns(np.asarray(moves, dtype=np.int64).reshape(num_micro_batches, num_stages - 1),
                                 stage, num_stages)
    return tuple(int(x) for x in np.stack([lower, upper], axis=1).reshape(-1))


def reference_lists(schedule: ComputeSchedule, shapes, spec: PipelineSpec, fwd_s=None, bwd_s=None,
                    rank_offset: int = 0) -> list[tuple[list[Instr], int]]:
    """Per stage, ``(instructions, slots)`` by the pure-Python passes 1-5 (``REDUCE``/``STEP`` left off): the
    readable reference of the numba kernel :func:`lower` runs (:mod:`dynabatch.schedule.rows`), tested equal."""
    times = dataflow_times(schedule, fwd_s, bwd_s)
    lists = add_send_waits(add_comms(schedule, shapes, spec, times, link_orders(schedule, times), rank_offset),
                           rank_offset)
    return [assign_slots(instrs[:-2]) for instrs in lists]
