"""Static checks of per-rank plans, before the symbolic run of :mod:`dynabatch.schedule.validate`:
plan layout (one plan per rank, consistent world), send/receive pairing per link, and the per-rank
memory tables the run charges against (stored and peak bytes per micro-batch, the limit)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from dynabatch.schedule.ir import COMM_OPS, SEND_OPS, ExecutionPlan, Instr, Op

_PARTNER = {Op.SEND_ACT: Op.RECV_ACT, Op.RECV_ACT: Op.SEND_ACT, Op.SEND_GRAD: Op.RECV_GRAD, Op.RECV_GRAD: Op.SEND_GRAD}


@dataclass(frozen=True)
class ValidationReport:
    """Result of :func:`~dynabatch.schedule.validate.validate`."""

    ok: bool
    errors: tuple[str, ...]
    peak_memory_bytes: dict[int, float]
    """Per rank, the largest live bytes seen (buffers, plus stored/peak activations when given)."""
    num_instructions: int
    deadlocked_ranks: tuple[int, ...] = ()
    num_errors: int = 0
    """All errors found; ``errors`` keeps at most ``max_errors`` of them."""

    def __str__(self) -> str:
        head = f"{'ok' if self.ok else 'INVALID'}: {self.num_instructions} instructions"
        head += f" on {len(self.peak_memory_bytes)} ranks"
        if self.ok:
            return head
        lines = [head + f", {self.num_errors} errors"] + [f"  {e}" for e in self.errors]
        more = self.num_errors - len(self.errors)
        return "\n".join(lines + ([f"  ... and {more} more"] if more else []))


class _Errors:
    def __init__(self, limit: int) -> None:
        self.items: list[str] = []
        self.count = 0
        self.limit = limit

    def add(self, msg: str) -> None:
        self.count += 1
        if len(self.items) < self.limit:
            self.items.append(msg)

    def report(self, peaks, num_instructions: int, deadlocked=()):
        ok = self.count == 0
        return ValidationReport(ok, tuple(self.items), peaks, num_instructions, tuple(deadlocked), self.count)


def _check_layout(plans: list[ExecutionPlan], errors: _Errors) -> dict[int, ExecutionPlan] | None:
    by_rank: dict[int, ExecutionPlan] = {}
    for p in plans:
        if p.rank in by_rank:
            errors.add(f"two plans for rank {p.rank}")
        by_rank[p.rank] = p
    if not by_rank:
        errors.add("no plans to validate")
        return None
    first = next(iter(by_rank.values()))
    S, D = first.num_stages, first.num_devices
    replicas: dict[int, list[int]] = {}
    for p in by_rank.values():
        if (p.num_stages, p.num_devices, p.num_replicas) != (S, D, first.num_replicas):
            errors.add(
                f"rank {p.rank}: {p.num_stages} stages on {p.num_devices} devices / {p.num_replicas} replicas, "
                f"rank {first.rank} has {S} on {D} / {first.num_replicas}"
            )
        replicas.setdefault(p.replica_index, []).extend(p.stages)
        held = set(p.stages)
        for i in p.instructions:
            if i.stage not in held:
                errors.add(f"rank {p.rank} (stages {list(p.stages)}) holds an instruction of a stage it does not "
                           f"hold: {i}")
                break
            if i.peer >= 0 and i.peer not in by_rank:
                errors.add(f"rank {p.rank}: {i} names peer rank {i.peer}, which has no plan")
                break
    for rep, stages in sorted(replicas.items()):
        if sorted(stages) != list(range(S)):
            twice = sorted({s for s in stages if stages.count(s) > 1})
            errors.add(f"replica {rep} lacks plans for stages {sorted(set(range(S)) - set(stages))}"
                       + (f" and holds stages {twice} on two devices" if twice else ""))
    for rep in replicas:
        ms = {by_rank[rep * D + d].num_micro_batches for d in range(D) if rep * D + d in by_rank}
        if len(ms) > 1:
            errors.add(f"replica {rep}: stages disagree on the number of micro-batches {sorted(ms)}")
    return None if errors.count else by_rank


def _message(ins: Instr) -> str:
    return f"{ins.op.value[-1]}{ins.micro_batch}" + (f"#{ins.tag}" if ins.tag >= 0 else "")


def _check_pairing(by_rank: dict[int, ExecutionPlan], errors: _Errors, in_order: bool) -> None:
    """k-th send a->b vs k-th receive on b from a; the same op order on both ends of each link."""
    sends: dict[tuple[int, int], list[Instr]] = {}
    recvs: dict[tuple[int, int], list[Instr]] = {}
    link_ops: dict[tuple[int, int], list[Instr]] = {}
    for r, plan in by_rank.items():
        for ins in plan.instructions:
            if ins.op in COMM_OPS:
                if ins.op in SEND_OPS:
                    sends.setdefault((r, ins.peer), []).append(ins)
                else:
                    recvs.setdefault((ins.peer, r), []).append(ins)
                link_ops.setdefault((r, ins.peer), []).append(ins)
    for a, b in sorted(set(sends) | set(recvs)):
        out, inc = sends.get((a, b), []), recvs.get((a, b), [])
        for k, (s, v) in enumerate(zip(out, inc)):
            problem = _pair_problem(s, v)
            if problem:
                errors.add(
                    f"mismatch rank {a} -> rank {b}: send #{k} is {s.to_text()} but receive #{k} is "
                    f"{v.to_text()} ({problem}); receives must be posted in the order the peer sends"
                )
                break
        if len(out) != len(inc):
            errors.add(f"rank {a} sends {len(out)} messages to rank {b}, which posts {len(inc)} receives from it")
    for a, b in sorted(link_ops):
        if not in_order or a > b or (b, a) not in link_ops:
            continue
        x = [(i.op in SEND_OPS, _message(i)) for i in link_ops[(a, b)]]
        y = [(i.op not in SEND_OPS, _message(i)) for i in link_ops[(b, a)]]
        if x != y:
            k = next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            ia = link_ops[(a, b)][k] if k < len(x) else None
            ib = link_ops[(b, a)][k] if k < len(y) else None
            errors.add(
                f"link {a}-{b} order differs at op #{k}: rank {a} issues {ia or 'nothing'}, rank {b} issues "
                f"{ib or 'nothing'} (NCCL runs a link's ops in issue order: both ends must agree)"
            )


def _pair_problem(send: Instr, recv: Instr) -> str:
    if _PARTNER[send.op] is not recv.op or send.micro_batch != recv.micro_batch or abs(send.stage - recv.stage) != 1:
        return f"different message: {_message(send)} vs {_message(recv)}"
    if send.tag != recv.tag:
        return f"tag {send.tag} vs {recv.tag}"
    if send.tensors != recv.tensors:
        return f"tensors {' '.join(map(str, send.tensors))} vs {' '.join(map(str, recv.tensors))}"
    return ""


@dataclass
class _Memory:
    stored: dict[int, list[float]] | None
    """Stage -> stored bytes per micro-batch, for each stage the rank holds."""
    peak: dict[int, list[float]] | None
    limit: float


def _memory_tables(by_rank, stored_bytes, peak_bytes, limit) -> dict[int, _Memory]:
    out = {}
    for r, p in by_rank.items():
        rows = []
        for name, table in (("stored_bytes", stored_bytes), ("peak_bytes", peak_bytes)):
            if table is None:
                rows.append(None)
                continue
            if isinstance(table, Mapping):
                if p.replica_index not in table:
                    raise ValueError(f"{name} has no entry for replica {p.replica_index}; it has {sorted(table)}")
                table = table[p.replica_index]
            a = np.asarray(table, dtype=np.float64)
            if a.ndim != 2 or a.shape[0] != p.num_stages or a.shape[1] < p.num_micro_batches:
                raise ValueError(f"{name} must be ({p.num_stages}, {p.num_micro_batches}), got {a.shape}")
            rows.append({s: a[s].tolist() for s in p.stages})
        if limit is None:
            lim = float("inf")
        elif np.ndim(limit) == 0:
            lim = float(limit)
        else:
            lims = np.asarray(limit, dtype=np.float64)
            if lims.shape != (p.num_stages,):
                raise ValueError(
                    f"memory_limit_bytes must be a number or one per stage ({p.num_stages}), got {lims.shape}"
                )
            lim = float(lims[list(p.stages)].min())  # a device holding several stages: the tightest
        out[r] = _Memory(rows[0], rows[1], lim)
    return out
