"""Prove a set of per-rank plans safe by symbolic execution on the CPU (no process group).

Checks, each reported as a readable error naming ranks and instructions:

* pairing: the k-th send from rank a to rank b and the k-th receive on b from a are the same message
  (op kind, micro-batch, tag) with equal tensors (names, shapes, dtypes); both ends of a link issue
  their ops in the same order (NCCL runs a link's p2p ops in issue order and ignores tags);
* deadlock: all ranks run their lists. Send and receive starts never block; a ``WAIT`` blocks until
  its transfer completes, and a transfer completes only when it is the oldest pending op of its rank
  on that link *and* the peer's oldest pending op on the link is its partner. This is NCCL's
  in-order rule, and conservative for gloo, where a send completes once its receive is posted and
  tags match out of order (``semantics="gloo"`` models exactly that). ``REDUCE`` is a barrier over
  the replicas of a stage present. If ranks stop, each blocked rank is reported with its instruction
  and what it waits for (a cyclic compute order, a swapped receive order, two ends sending first);
* data dependencies on each rank: ``F`` after its ``LOAD`` and received activation, ``B`` after its
  ``F`` and received gradient, a token slice's ``F`` after its previous slice's and its ``B`` after
  the next slice's (:mod:`~dynabatch.schedule.chains`), a send after the compute producing it, ``REDUCE`` after every ``B``,
  ``STEP`` after ``REDUCE``; every micro-batch runs ``F`` and ``B`` exactly once; every transfer is
  waited once; no use of a slot after its ``FREE``, no ``FREE`` of a buffer with a transfer in
  flight, no slot shared by two micro-batches at once, every slot freed by the end;
* memory, given per-stage stored and peak bytes per micro-batch: live bytes on a rank are the loaded
  and transfer buffers of every slot not yet freed (exact, from the tensor specs; a received
  activation is also counted in stored bytes, which errs on the safe side) plus the stored
  activations of every micro-batch between its ``F`` and ``B``; a compute adds its peak bytes. The largest
  value is the rank's peak; one over ``memory_limit_bytes`` is an error saying where.

Measured (2 shared CPU cores): 4 ranks x 100 micro-batches (about 4000 instructions, 1F1B or GPipe)
validate in 7-16 ms, 8 ranks x 200 (17,600 instructions) in 30-36 ms.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from dynabatch.schedule._validate_static import (  # noqa: F401 (ValidationReport is imported from here)
    _PARTNER,
    ValidationReport,
    _check_layout,
    _check_pairing,
    _Errors,
    _Memory,
    _memory_tables,
)
from dynabatch.schedule.chains import successors
from dynabatch.schedule.ir import SEND_OPS, ExecutionPlan, Instr, Op

_RECV_ACT, _RECV_GRAD = Op.RECV_ACT, Op.RECV_GRAD  # enum member lookups are slow in hot loops


class PlanValidationError(ValueError):
    """A plan failed :func:`validate_or_raise`; ``report`` has every finding."""

    def __init__(self, report: ValidationReport) -> None:
        super().__init__(str(report))
        self.report = report


def validate_or_raise(plans, **kwargs) -> ValidationReport:
    """:func:`validate`, raising :class:`PlanValidationError` (a ``ValueError``) when not ok."""
    report = validate(plans, **kwargs)
    if not report.ok:
        raise PlanValidationError(report)
    return report


def validate(
    plans: Mapping[int, ExecutionPlan] | Iterable[ExecutionPlan],
    *,
    stored_bytes=None,
    peak_bytes=None,
    memory_limit_bytes=None,
    semantics: str = "nccl",
    max_errors: int = 50,
) -> ValidationReport:
    """Symbolically execute ``plans`` (every rank of one or more pipeline replicas) and report.

    ``stored_bytes`` / ``peak_bytes``: ``(S, M)`` per-stage bytes per micro-batch (``StageCosts``
    rows), or a mapping from replica index to such arrays when replicas differ. ``memory_limit_bytes``:
    one limit or one per stage. ``semantics``: ``nccl`` (default; a link's transfers complete in issue
    order, which also proves the plan safe under gloo) or ``gloo`` (a transfer completes once both
    ends started it, matched by tag; the link-order check is skipped).
    """
    if semantics not in ("nccl", "gloo"):
        raise ValueError(f"unknown semantics {semantics!r}; valid: nccl, gloo")
    plan_list = list(plans.values()) if isinstance(plans, Mapping) else list(plans)
    errors = _Errors(max_errors)
    by_rank = _check_layout(plan_list, errors)
    if by_rank is None:
        return errors.report({}, sum(len(p.instructions) for p in plan_list))
    _check_pairing(by_rank, errors, semantics == "nccl")
    mem = _memory_tables(by_rank, stored_bytes, peak_bytes, memory_limit_bytes)
    sim = _Simulation(by_rank, mem, errors, semantics == "nccl")
    sim.run()
    return errors.report(sim.peak_memory(), sum(len(p.instructions) for p in plan_list), sim.deadlocked)


class _Request:
    __slots__ = ("ins", "rank", "done", "waited")

    def __init__(self, ins: Instr, rank: int) -> None:
        self.ins, self.rank = ins, rank
        self.done = self.waited = False


@dataclass
class _Rank:
    plan: ExecutionPlan
    mem: _Memory
    pc: int = 0
    blocked_on: object = None
    requests: dict = field(default_factory=dict)
    open: dict = field(default_factory=dict)
    """(stage, micro-batch) -> its transfer requests (to check FREE). Every per-micro-batch set and map here is
    keyed by ``(stage, micro-batch)``: a rank may hold several stages (virtual stages)."""
    loaded: set = field(default_factory=set)
    act_in: set = field(default_factory=set)
    """(stage, micro-batch) whose received activation's wait completed."""
    grad_in: set = field(default_factory=set)
    fwd: set = field(default_factory=set)
    bwd: set = field(default_factory=set)
    freed: set = field(default_factory=set)
    slot_of: dict = field(default_factory=dict)
    holder: dict = field(default_factory=dict)
    """slot -> (stage, micro-batch) bound to it."""
    slot_bytes: dict = field(default_factory=dict)
    live: float = 0.0
    peak: float = 0.0
    over_limit: int = 0
    reduced: bool = False
    stepped: bool = False
    next_slice: dict = field(default_factory=dict)
    """Token slice -> the slice that extends it (from the plan's ``slice_links``)."""


def _in_flight(st: _Rank) -> str:
    """``stage 1, micro-batches in flight: [0, 2]`` (or ``stages [0, 2], ...: [0:1, 2:0]`` on a rank holding several)."""
    flying = sorted(st.fwd - st.bwd)
    if len(st.plan.stages) == 1:
        return f"stage {st.plan.stage}, micro-batches in flight: {[m for _, m in flying]}"
    return f"stages {list(st.plan.stages)}, stage:micro-batch in flight: [{', '.join(f'{s}:{m}' for s, m in flying)}]"


class _Simulation:
    def __init__(
        self, by_rank: dict[int, ExecutionPlan], mem: dict[int, _Memory], errors: _Errors, in_order: bool
    ) -> None:
        self.ranks = {r: _Rank(p, mem[r], next_slice=successors(p.slice_links)) for r, p in by_rank.items()}
        self.errors = errors
        self.in_order = in_order
        self.queues: dict[tuple[int, int], deque] = {}
        """In order (NCCL): (rank, peer) -> the rank's started, unmatched transfers, oldest first."""
        self.unmatched: dict[tuple[int, int], dict] = {}
        """By tag (gloo): (rank, peer) -> {(op, micro-batch, tag): request} started, not yet matched."""
        self.runnable = deque(sorted(self.ranks))
        self.deadlocked: list[int] = []
        self.replicas_of_stage: dict[int, list[int]] = {}
        for r, p in by_rank.items():
            self.replicas_of_stage.setdefault(p.stage, []).append(r)
        self.arrived: dict[int, list[int]] = {}
        self.nbytes: dict[int, int] = {}
        self.handlers = {
            Op.LOAD: self._load,
            Op.FORWARD: self._forward,
            Op.BACKWARD: self._backward,
            Op.SEND_ACT: self._send_act,
            Op.SEND_GRAD: self._send_grad,
            Op.RECV_ACT: self._recv,
            Op.RECV_GRAD: self._recv,
            Op.WAIT: self._wait,
            Op.FREE: self._free,
            Op.REDUCE_GRADS: self._reduce,
            Op.OPTIMIZER_STEP: self._step,
        }

    # ----------------------------------------------------------------------------- driver

    def run(self) -> None:
        handlers, ranks = self.handlers, self.ranks
        while self.runnable:
            st = ranks[self.runnable.popleft()]
            instrs = st.plan.instructions
            st.blocked_on = None
            while st.pc < len(instrs):
                ins = instrs[st.pc]
                if ins.micro_batch >= 0:
                    self._slot_ok(st, ins)
                if handlers[ins.op](st, ins):
                    break  # blocked; woken by a completion or the reduce barrier
                st.pc += 1
            else:
                self._finish(st)
        blocked = [st for st in ranks.values() if st.pc < len(st.plan.instructions)]
        for st in blocked:
            self.deadlocked.append(st.plan.rank)
            self.errors.add(f"deadlock: {self._describe_block(st)}")

    def _err(self, st: _Rank, ins: Instr, msg: str) -> None:
        self.errors.add(f"rank {st.plan.rank} #{st.pc} {ins}: {msg}")

    def _slot_ok(self, st: _Rank, ins: Instr) -> bool:
        m, slot = (ins.stage, ins.micro_batch), ins.slot
        bound = st.slot_of.get(m)
        if bound == slot:
            return True  # fast path: a bound micro-batch is not freed (FREE unbinds it)
        if m in st.freed:
            self._err(st, ins, f"uses micro-batch {m[1]}'s buffers after its FREE (slot {slot})")
            return False
        if not 0 <= slot < st.plan.num_slots:
            self._err(st, ins, f"slot {slot} outside 0..{st.plan.num_slots - 1}")
            return False
        if bound is None:
            other = st.holder.get(slot)
            if other is not None:
                self._err(st, ins, f"slot {slot} still holds micro-batch {other[1]} of stage {other[0]}")
                return False
            st.slot_of[m], st.holder[slot] = slot, m
        elif bound != slot:
            self._err(st, ins, f"micro-batch {m[1]} is in slot {bound}, not {slot}")
            return False
        return True

    def _add_bytes(self, st: _Rank, m: int, tensors, ins: Instr) -> None:
        n = self.nbytes.get(id(tensors))  # instructions outlive the run, so ids are stable keys
        if n is None:
            n = self.nbytes[id(tensors)] = sum(t.nbytes for t in tensors)
        st.slot_bytes[m] = st.slot_bytes.get(m, 0) + n
        st.live += n
        self._check_memory(st, ins, 0.0)

    def _check_memory(self, st: _Rank, ins: Instr, transient: float) -> None:
        need = st.live + transient
        if need > st.peak:
            st.peak = need
        if need > st.mem.limit:
            st.over_limit += 1
            if st.over_limit == 1:
                gib = 2.0**30
                self._err(
                    st,
                    ins,
                    f"memory {st.live / gib:.3f} GiB live + {transient / gib:.3f} GiB transient = "
                    f"{need / gib:.3f} GiB > limit {st.mem.limit / gib:.3f} GiB "
                    f"({_in_flight(st)})",
                )

    # ----------------------------------------------------------------------------- handlers
    # Each returns True when the rank blocks on the instruction (it is re-run when woken).

    def _load(self, st: _Rank, ins: Instr) -> bool:
        k = (ins.stage, ins.micro_batch)
        if k in st.loaded:
            self._err(st, ins, "loads the micro-batch twice")
        st.loaded.add(k)
        self._add_bytes(st, k, ins.tensors, ins)
        return False

    def _forward(self, st: _Rank, ins: Instr) -> bool:
        s, m = k = (ins.stage, ins.micro_batch)
        if k in st.fwd:
            self._err(st, ins, "runs the forward twice")
        if k not in st.loaded:
            self._err(st, ins, "forward before LOAD of its inputs")
        if s > 0 and k not in st.act_in:
            self._err(st, ins, "forward before its input activation arrived (no completed WAIT_RECV_F)")
        links = st.plan.slice_links
        if links and links[m] >= 0 and (s, links[m]) not in st.fwd:
            self._err(st, ins, f"token slice forward before F{links[m]}, the slice whose keys/values it extends")
        self._check_memory(st, ins, st.mem.peak[s][m] if st.mem.peak is not None else 0.0)
        st.fwd.add(k)
        if st.mem.stored is not None:
            st.live += st.mem.stored[s][m]
            self._check_memory(st, ins, 0.0)
        return False

    def _backward(self, st: _Rank, ins: Instr) -> bool:
        s, m = k = (ins.stage, ins.micro_batch)
        if k not in st.fwd:
            self._err(st, ins, "backward before its forward")
        if k in st.bwd:
            self._err(st, ins, "runs the backward twice")
        if s < st.plan.num_stages - 1 and k not in st.grad_in:
            self._err(st, ins, "backward before its output gradient arrived (no completed WAIT_RECV_B)")
        later = st.next_slice.get(m)
        if later is not None and (s, later) not in st.bwd:
            self._err(st, ins, f"token slice backward before B{later}, whose key/value gradients it needs")
        self._check_memory(st, ins, st.mem.peak[s][m] if st.mem.peak is not None else 0.0)
        if st.mem.stored is not None and k in st.fwd:
            st.live -= st.mem.stored[s][m]
        st.bwd.add(k)
        return False

    def _send_act(self, st: _Rank, ins: Instr) -> bool:
        if (ins.stage, ins.micro_batch) not in st.fwd:
            self._err(st, ins, "sends an activation before its forward")
        self._start(st, ins)
        return False

    def _send_grad(self, st: _Rank, ins: Instr) -> bool:
        k = (ins.stage, ins.micro_batch)
        if k not in st.bwd:
            self._err(st, ins, "sends a gradient before its backward")
        self._add_bytes(st, k, ins.tensors, ins)  # the input gradient buffer
        self._start(st, ins)
        return False

    def _recv(self, st: _Rank, ins: Instr) -> bool:
        self._add_bytes(st, (ins.stage, ins.micro_batch), ins.tensors, ins)
        self._start(st, ins)
        return False

    def _start(self, st: _Rank, ins: Instr) -> None:
        key = (ins.op, ins.stage, ins.micro_batch)
        if key in st.requests:
            self._err(st, ins, "starts the same transfer twice")
        req = st.requests[key] = _Request(ins, st.plan.rank)
        st.open.setdefault((ins.stage, ins.micro_batch), []).append(req)
        r, q = st.plan.rank, ins.peer
        if not self.in_order:
            other = self.unmatched.get((q, r), {}).pop((_PARTNER[ins.op], ins.micro_batch, ins.tag), None)
            if other is None:
                self.unmatched.setdefault((r, q), {})[(ins.op, ins.micro_batch, ins.tag)] = req
            else:
                self._complete(req)
                self._complete(other)
            return
        mine = self.queues.get((r, q))
        if mine is None:
            mine = self.queues[(r, q)] = deque()
        mine.append(req)
        theirs = self.queues.get((q, r))
        while mine and theirs:
            a, b = mine[0], theirs[0]
            if _PARTNER[a.ins.op] is not b.ins.op or a.ins.micro_batch != b.ins.micro_batch or a.ins.tag != b.ins.tag:
                break  # heads disagree: this link is stuck (reported if anyone waits on it)
            mine.popleft()
            theirs.popleft()
            self._complete(a)
            self._complete(b)

    def _complete(self, req: _Request) -> None:
        req.done = True
        owner = self.ranks[req.rank]
        if owner.blocked_on is req:
            owner.blocked_on = None
            self.runnable.append(req.rank)

    def _wait(self, st: _Rank, ins: Instr) -> bool:
        k = (ins.stage, ins.micro_batch)
        req = st.requests.get((ins.waits_on, *k))
        if req is None:
            self._err(st, ins, f"waits on {ins.waits_on.value}{ins.micro_batch}, which this rank never started")
            return False
        if req.waited:
            self._err(st, ins, "waits on the same transfer twice")
            return False
        if not req.done:
            st.blocked_on = req
            return True
        req.waited = True
        if ins.waits_on is _RECV_ACT:
            st.act_in.add(k)
        elif ins.waits_on is _RECV_GRAD:
            st.grad_in.add(k)
        return False

    def _free(self, st: _Rank, ins: Instr) -> bool:
        m = (ins.stage, ins.micro_batch)
        if m in st.freed:
            return False  # reported by _slot_ok
        inflight = [str(r.ins) for r in st.open.get(m, ()) if not r.waited]
        if inflight:
            self._err(st, ins, f"frees buffers with transfers in flight: {', '.join(inflight)}")
        if m in st.fwd and m not in st.bwd:
            self._err(st, ins, "frees the micro-batch before its backward")
        st.live -= st.slot_bytes.pop(m, 0)
        st.freed.add(m)
        slot = st.slot_of.pop(m, None)
        if slot is not None:
            st.holder.pop(slot, None)
        return False

    def _reduce(self, st: _Rank, ins: Instr) -> bool:
        if st.reduced:
            self._err(st, ins, "reduces gradients twice")
            return False
        stage = st.plan.stage
        arrived = self.arrived.setdefault(stage, [])
        if st.plan.rank not in arrived:
            missing = st.plan.num_micro_batches * len(st.plan.stages) - len(st.bwd)
            if missing:
                self._err(st, ins, f"gradient reduce before all backwards ({missing} missing)")
            arrived.append(st.plan.rank)
            if len(arrived) == len(self.replicas_of_stage[stage]):
                for r in arrived:
                    if r != st.plan.rank:
                        self.ranks[r].blocked_on = None
                        self.runnable.append(r)
        if len(arrived) < len(self.replicas_of_stage[stage]):
            st.blocked_on = "reduce"
            return True
        st.reduced = True
        return False

    def _step(self, st: _Rank, ins: Instr) -> bool:
        if not st.reduced:
            self._err(st, ins, "optimizer step before REDUCE")
        if len(st.bwd) < st.plan.num_micro_batches * len(st.plan.stages):
            self._err(st, ins, "optimizer step before all backwards")
        if st.stepped:
            self._err(st, ins, "optimizer step twice")
        st.stepped = True
        return False

    # ----------------------------------------------------------------------------- end of list

    def _finish(self, st: _Rank) -> None:
        r, M = st.plan.rank, st.plan.num_micro_batches
        for name, done in (("forward", st.fwd), ("backward", st.bwd)):
            for s in st.plan.stages:
                missing = sorted(set(range(M)) - {m for t, m in done if t == s})
                if missing:
                    where = f" on stage {s}" if len(st.plan.stages) > 1 else ""
                    self.errors.add(f"rank {r}: no {name} of micro-batches {missing[:10]}{where}")
        never = [str(q.ins) for q in st.requests.values() if not q.waited]
        if never:
            self.errors.add(f"rank {r}: transfers never waited: {', '.join(never[:10])}")
        if st.slot_of:
            held = {slot: k[1] if len(st.plan.stages) == 1 else k for slot, k in sorted(st.holder.items())}
            self.errors.add(f"rank {r}: slots never freed (slot: micro-batch) {held}")
        if not st.stepped:
            self.errors.add(f"rank {r}: no optimizer STEP")

    def _describe_block(self, st: _Rank) -> str:
        r = st.plan.rank
        ins = st.plan.instructions[st.pc]
        where = f"rank {r} blocked at #{st.pc} {ins}"
        if st.blocked_on == "reduce":
            waiting = sorted(set(self.replicas_of_stage[st.plan.stage]) - set(self.arrived.get(st.plan.stage, [])))
            return f"{where}: waiting for ranks {waiting} to reach REDUCE"
        req = st.blocked_on
        q = req.ins.peer
        mine, theirs = self.queues.get((r, q), deque()), self.queues.get((q, r), deque())
        if mine and mine[0] is not req:
            ahead = list(mine).index(req)
            first = f"{ahead} earlier op(s) on link {r}-{q} are pending first, oldest {mine[0].ins}"
            return f"{where}: {first}; " + self._head(r, q, mine[0], theirs)
        return f"{where}: " + self._head(r, q, req, theirs)

    def _head(self, r: int, q: int, head: _Request, theirs: deque) -> str:
        peer = self.ranks[q]
        peer_at = (
            f"rank {q} is blocked at #{peer.pc} {peer.plan.instructions[peer.pc]}"
            if peer.pc < len(peer.plan.instructions)
            else f"rank {q} finished"
        )
        if theirs:
            both = " (both ends send first)" if head.ins.op in SEND_OPS and theirs[0].ins.op in SEND_OPS else ""
            oldest = f"rank {q}'s oldest pending op on the link is {theirs[0].ins}"
            return f"{oldest}, not the partner of {head.ins}{both}; {peer_at}"
        partner = f"{q}{_PARTNER[head.ins.op].value}{head.ins.micro_batch}"
        return f"rank {q} has not issued {partner}; {peer_at}"

    def peak_memory(self) -> dict[int, float]:
        return {r: float(st.peak) for r, st in sorted(self.ranks.items())}
