"""Lower a step onto virtual stages: several pipeline chunks per device (:mod:`dynabatch.schedule.placement`).

Input: the per-device op order of a placed step (:func:`~dynabatch.schedule.placement.list_schedule`'s
``order``: ``(phase, stage, micro-batch, ...)`` per device), the micro-batch shapes and the
:class:`~dynabatch.schedule.ir.PipelineSpec` of the ``V = S x v`` chunks. Output: one
:class:`~dynabatch.schedule.ir.ExecutionPlan` per device rank holding the instructions of all its chunks.

1. Each chunk is lowered as if it ran alone on a rank (:func:`~dynabatch.schedule.lower.lower`, per-chunk
   orders taken from the device orders), giving per chunk its loads, computes, sends, waits and frees.
2. :func:`merge_chunks` replays the devices together, one instruction at a time: a device issues, from the
   heads of its chunks' instruction streams, any ready non-compute instruction (a send start, a wait whose
   transfer has started on both ends, a free, a load once its forward is the device's next compute), else the next compute of its device order when it
   heads its chunk's stream. A receive is not taken from the chunk streams: it is posted on the receiving
   device at the moment the sender starts the send. So a receive wait never waits for a send not yet
   started and a send wait never waits for a receive not yet posted, and every device's list is a
   subsequence of one global order in which each blocking wait comes after what it waits for: the lists
   cannot deadlock (the earliest unfinished instruction of that order can always run). Both ends of a
   device pair issue the pair's sends and receives in the same (global) order, as NCCL needs.
3. Peers become device ranks (``replica x S + stage mod S``); a message's tag becomes
   ``message_tag x V + link`` (unique per device pair: two links, e.g. T5's encoder chunks 0-1 and decoder
   chunks 0-1 under the cyclic placement, may join the same two devices). Slots are assigned per device
   over ``(stage, micro-batch)`` lifetimes (:func:`~dynabatch.schedule.lower.assign_slots`); one ``REDUCE``
   and one ``STEP`` end each device's list.

Consecutive chunks never share a device when ``S >= 2`` (chunk ``c`` is on device ``c mod S``), so every
hand-off between chunks is a p2p transfer; one device with several chunks is refused (nothing to gain).
"""

from __future__ import annotations

import numpy as np

from dynabatch.core.policies import PLACED_POLICIES
from dynabatch.schedule.compute import ComputeOp, ComputeSchedule, Phase
from dynabatch.schedule.ir import RECOMPUTE_MODES, RECV_OPS, SEND_OPS, ExecutionPlan, Instr, Op, PipelineSpec
from dynabatch.schedule.lower import assign_slots, lower
from dynabatch.schedule.placement import Placement, list_schedule
from dynabatch.schedule.chains import check_links
from dynabatch.schedule.interleaved import interleaved_1f1b_orders, replay
from dynabatch.schedule.simulate import per_stage_values, stage_send_times, with_message_buffers
from dynabatch.schedule.wait_free_cyclic import wait_free_cyclic_orders
from dynabatch.schedule.validate import validate_or_raise

_RECV_OF = {Op.SEND_ACT: Op.RECV_ACT, Op.SEND_GRAD: Op.RECV_GRAD}
_COMPUTE = (Op.FORWARD, Op.BACKWARD)


def placed_step(costs, placement: Placement, model_state_bytes=0.0, memory_limit_bytes=None, send_time=None,
                policy: str = "auto", links=()):
    """One replica's step on ``placement`` priced by ``costs`` (``(V, M)`` per chunk; their message buffers added):
    a :class:`~dynabatch.schedule.placement.PlacedResult` ordered by ``policy`` (:data:`PLACED_POLICIES`).
    ``send_time`` prices each hand-off between devices (bytes -> seconds, or an array; ``None``: free), as the
    linear simulation does; ``links``: token-slice chains (:mod:`dynabatch.schedule.chains`), which every order
    keeps (interleaved 1F1B's fixed order only when it happens to: else it is not a candidate)."""

    if policy not in PLACED_POLICIES:
        raise ValueError(f"unknown placed policy {policy!r}; valid: {', '.join(PLACED_POLICIES)}")
    V, M = np.shape(costs.fwd_s)
    links = check_links(links, M)
    states = per_stage_values(model_state_bytes, V, "model_state_bytes")
    limit = None if memory_limit_bytes is None else float(np.min(memory_limit_bytes))
    buffered, send = with_message_buffers(costs), stage_send_times(costs, send_time)
    results = []
    if policy in ("auto", "list"):
        results.append(list_schedule(buffered, placement, send, states, limit, links))
    if policy in ("auto", "interleaved_1f1b"):
        orders = interleaved_1f1b_orders(placement, M)
        fixed = None if orders is None else replay(orders, buffered, placement, send, states, limit, links=links)
        if fixed is not None:
            results.append(fixed)
        elif policy == "interleaved_1f1b":
            why = (f"needs a multiple of {placement.num_devices} micro-batches, got {M}" if orders is None else
                   "runs token slices out of their chains' order here")
            raise ValueError(f"interleaved 1F1B {why}")
    if policy in ("auto", "wait_free_cyclic"):
        orders = wait_free_cyclic_orders(buffered, placement, states, limit, links)
        results.append(replay(orders, buffered, placement, send, states, limit, policy="wait_free_cyclic", links=links))
    return min(results, key=lambda r: (not r.fits_memory, r.makespan_s))


def replayed_step(first, costs, placement: Placement, model_state_bytes=0.0, memory_limit_bytes=None,
                  send_time=None, links=()):
    """Another replica's step on ``placement`` run in the device orders of ``first`` (a
    :class:`~dynabatch.schedule.placement.PlacedResult` of as many micro-batches), priced by its own ``costs``
    (arguments as :func:`placed_step`'s): ``--zero 2`` reduces each chunk's gradients after each backward in the order
    the device runs them, so every replica of a device must run its chunks in one order. ``None`` when this replica's
    token-slice chains (``links``) cannot run in that order."""
    V, M = np.shape(costs.fwd_s)
    forwards = sum(1 for ops in first.order for op in ops if op[0] == "F")
    if forwards != V * M:
        raise ValueError(f"the device orders run {forwards // V} micro-batches, this replica has {M}")
    states = per_stage_values(model_state_bytes, V, "model_state_bytes")
    limit = None if memory_limit_bytes is None else float(np.min(memory_limit_bytes))
    orders = [[(phase, c, m) for phase, c, m, *_ in ops] for ops in first.order]
    return replay(orders, with_message_buffers(costs), placement, stage_send_times(costs, send_time), states, limit,
                  policy=first.policy, links=check_links(links, M))


def chunk_schedule(device_orders, num_stages: int, num_micro_batches: int, policy: str = "list") -> ComputeSchedule:
    """The :class:`~dynabatch.schedule.compute.ComputeSchedule` of per-device orders ``[(phase, stage,
    micro_batch, ...), ...]``: each chunk's order, the device orders kept (what :func:`lower_placed` merges)."""
    stages: list[list[ComputeOp]] = [[] for _ in range(num_stages)]
    for ops in device_orders:
        for phase, stage, m, *_ in ops:
            stages[stage].append(ComputeOp(Phase(phase), int(m)))
    return ComputeSchedule(tuple(tuple(s) for s in stages), num_micro_batches, policy,
                           device_orders=tuple(tuple(ops) for ops in device_orders))


def lower_placed(
    device_orders,
    shapes,
    spec: PipelineSpec,
    placement: Placement,
    *,
    replica_index: int = 0,
    num_replicas: int = 1,
    step: int = 0,
    fwd_s=None,
    bwd_s=None,
    check: bool = True,
    links=(),
    recompute=None,
) -> dict[int, ExecutionPlan]:
    """Device plans of one replica on ``placement`` (see the module docstring); rank ``replica x S + d``
    runs device ``d``'s chunks. ``device_orders``: per device, its compute ops in order (``PlacedResult.order``).
    Other arguments as :func:`~dynabatch.schedule.lower.lower` (``recompute``: ``(V, M)`` codes)."""
    V, S = placement.num_stages, placement.num_devices
    if spec.num_stages != V:
        raise ValueError(f"pipeline spec has {spec.num_stages} stages but placement {placement.describe()} has {V}")
    if S < 2 and V > 1:
        raise ValueError("virtual stages need at least 2 devices (consecutive chunks on one device gain nothing)")
    if len(device_orders) != S:
        raise ValueError(f"device_orders has {len(device_orders)} devices, placement {placement.describe()} has {S}")
    M = len(np.asarray(shapes))
    schedule = chunk_schedule(device_orders, V, M)
    chunks = lower(schedule, shapes, spec, replica_index=0, num_replicas=1, step=step, fwd_s=fwd_s, bwd_s=bwd_s,
                   check=False, links=links)
    offset = replica_index * S
    streams = [_device_stream(chunks[v].instructions, v, placement, offset) for v in range(V)]
    lists = merge_chunks(streams, device_orders, placement, offset)
    plans = {}
    for d in range(S):
        instrs, num_slots = assign_slots(lists[d])
        instrs += [Instr(Op.REDUCE_GRADS, d), Instr(Op.OPTIMIZER_STEP, d)]
        modes = ()
        if recompute is not None:
            codes = np.asarray(recompute)
            modes = tuple(RECOMPUTE_MODES[int(c)] for v in range(d, V, S) for c in codes[v])
        plans[offset + d] = ExecutionPlan(offset + d, d, V, replica_index, num_replicas, M, num_slots, tuple(instrs),
                                          step, tuple(links), modes, num_devices=S)
    if check:
        validate_or_raise(plans)
    return plans


def _device_stream(instrs, stage: int, placement: Placement, offset: int) -> list[Instr]:
    """A chunk's instructions with device peers and device-pair tags, without its ``REDUCE``/``STEP``."""
    V = placement.num_stages
    out = []
    for ins in instrs:
        if ins.op in (Op.REDUCE_GRADS, Op.OPTIMIZER_STEP):
            continue
        if ins.peer >= 0:
            link = min(stage, ins.peer)  # chunk lowering used ranks 0..V-1, so the peer is the chunk index
            ins = Instr(ins.op, ins.stage, ins.micro_batch, offset + placement.device(ins.peer), -1,
                        ins.tag * V + link, ins.waits_on, ins.tensors)
        else:
            ins = Instr(ins.op, ins.stage, ins.micro_batch, tensors=ins.tensors)
        out.append(ins)
    return out


def merge_chunks(streams: list[list[Instr]], device_orders, placement: Placement, offset: int) -> list[list[Instr]]:
    """Step 2 of the module docstring: one instruction list per device from its chunks' streams."""
    S = placement.num_devices
    recvs: dict[tuple, Instr] = {}  # (op of the send, receiving stage, micro-batch) -> the receive to post
    queues: list[list[Instr]] = []
    for stream in streams:
        kept = []
        for ins in stream:
            if ins.op in RECV_OPS:
                recvs[(ins.op, ins.stage, ins.micro_batch)] = ins
            else:
                kept.append(ins)
        queues.append(kept)
    started: set = set()  # (transfer op, stage, micro-batch) of started sends and posted receives
    heads = [0] * len(queues)
    computes = [[(Op.FORWARD if phase == "F" else Op.BACKWARD, v, m) for phase, v, m, *_ in ops] for ops in device_orders]
    next_compute = [0] * S
    out: list[list[Instr]] = [[] for _ in range(S)]
    chunks_of = [list(range(d, placement.num_stages, S)) for d in range(S)]

    def ready(d: int, ins: Instr) -> bool:
        if ins.op is Op.WAIT:
            return (ins.waits_on, ins.stage, ins.micro_batch) in started
        if ins.op is Op.LOAD:  # inputs come in when their forward is the device's next compute, not earlier
            nxt = computes[d][next_compute[d]] if next_compute[d] < len(computes[d]) else None
            return nxt == (Op.FORWARD, ins.stage, ins.micro_batch)
        return ins.op not in _COMPUTE

    def issue(d: int, v: int) -> None:
        ins = queues[v][heads[v]]
        heads[v] += 1
        out[d].append(ins)
        if ins.op in SEND_OPS:
            started.add((ins.op, ins.stage, ins.micro_batch))
            to = ins.stage + (1 if ins.op is Op.SEND_ACT else -1)
            recv = recvs.pop((_RECV_OF[ins.op], to, ins.micro_batch))
            out[placement.device(to)].append(recv)
            started.add((recv.op, recv.stage, recv.micro_batch))

    remaining = sum(len(q) for q in queues)
    while remaining:
        progress = False
        for d in range(S):
            while True:
                v = next((v for v in chunks_of[d] if heads[v] < len(queues[v]) and ready(d, queues[v][heads[v]])), None)
                if v is None and next_compute[d] < len(computes[d]):
                    op, w, m = computes[d][next_compute[d]]
                    head = queues[w][heads[w]] if heads[w] < len(queues[w]) else None
                    if head is not None and (head.op, head.stage, head.micro_batch) == (op, w, m):
                        v = w
                        next_compute[d] += 1
                if v is None:
                    break
                issue(d, v)
                remaining -= 1
                progress = True
        if not progress:
            stuck = {d: [str(queues[v][heads[v]]) for v in chunks_of[d] if heads[v] < len(queues[v])] for d in range(S)}
            raise ValueError(f"virtual-stage merge deadlocked; device heads: {stuck}")
    return out
