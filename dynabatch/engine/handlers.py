"""The executor's opcode handlers: one function per :class:`~dynabatch.schedule.ir.Op`, ``(executor, instr)``.

:class:`~dynabatch.engine.executor.Executor` runs a rank's instruction list by looking each opcode up in
:data:`HANDLERS`. A handler reads and writes the executor's per-micro-batch :class:`MicroBatchState` (tensors
loaded, activations received, the stage's output, gradients) and its in-flight :class:`Transfer` s; sends and
receives only start here and complete at the plan's ``WAIT``. Replacing an entry of :data:`HANDLERS` changes what
every executor does for that opcode (``scripts/bench_fixed_cost.py`` slows forwards and backwards that way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dynabatch.engine.p2p import TORCH_DTYPES, allocate, start_recv, start_send, wait_all
from dynabatch.models.recompute import recompute_mode
from dynabatch.models.stage import StageOutput
from dynabatch.schedule.ir import Instr, Op

if TYPE_CHECKING:
    from dynabatch.engine.executor import Executor


@dataclass
class MicroBatchState:
    """What one micro-batch holds on one stage between its instructions."""

    loaded: dict[str, torch.Tensor] | None = None
    received: dict[str, torch.Tensor] = field(default_factory=dict)
    output: StageOutput | None = None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """Received gradients of the stage's outputs."""
    input_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """Gradients of the received activations, to send upstream."""


@dataclass
class Transfer:
    """A started send or receive, kept until its ``WAIT`` (the buffers stay alive until then)."""

    works: list
    tensors: list[torch.Tensor]
    instr: Instr




def _exec_load(ex: Executor, ins: Instr) -> None:
    host = ex.inputs.loaded[ins.micro_batch]
    ex._state(ins).loaded = {t.name: host[t.name].to(ex.device, non_blocking=True) for t in ins.tensors}


def _exec_recv(ex: Executor, ins: Instr) -> None:
    buffers = allocate(ins.tensors, ex.device)
    ex.pending[(ins.op, ins.stage, ins.micro_batch)] = Transfer(start_recv(buffers, ins.peer, ins.tag), buffers, ins)


def _exec_wait(ex: Executor, ins: Instr) -> None:
    transfer = ex.pending.pop((ins.waits_on, ins.stage, ins.micro_batch))
    wait_all(transfer.works)
    names = [t.name for t in transfer.instr.tensors]
    if ins.waits_on is Op.RECV_ACT:
        ex._state(ins).received = {n: b.requires_grad_() for n, b in zip(names, transfer.tensors)}
    elif ins.waits_on is Op.RECV_GRAD:
        ex._state(ins).grads = dict(zip(names, transfer.tensors))


def _exec_forward(ex: Executor, ins: Instr) -> None:
    s, m = ins.stage, ins.micro_batch
    st = ex._state(ins)
    chunk = ex.chunks[s]
    prev = ex.links[m] if ex.links else -1
    plan = ex.inputs.plan
    moved = {"moves": plan.moves_of(m)} if plan.moves else {}  # moving stage boundaries: the units this one runs
    with ex._forward_context(s, m), recompute_mode(plan.recompute_of(s, m)):
        if prev >= 0 or m in ex.next_slice:
            if prev >= 0 and (s, m) not in ex.contexts:
                raise ValueError(f"token slice {m} runs before slice {prev}, whose keys/values it extends")
            out = chunk(st.received, st.loaded, ex.contexts.pop((s, m), None), sliced=True, **moved)
            if m in ex.next_slice:
                ex.contexts[s, ex.next_slice[m]] = out.slice_record.extend()
        else:
            out = chunk(st.received, st.loaded, **moved)
    st.output, st.loaded = out, None
    if s == ex.num_stages - 1:
        if out.loss_sum is None:
            raise ValueError("the last stage returned no loss_sum")
        ex.loss_sum += out.loss_sum.detach()
        ex.num_loss_tokens += out.num_loss_tokens
        if out.segment_losses is not None:
            ex.segment_losses[m] = out.segment_losses


def _exec_backward(ex: Executor, ins: Instr) -> None:
    s, m = ins.stage, ins.micro_batch
    st = ex._state(ins)
    out = st.output
    tensors, grads = [], []
    if s == ex.num_stages - 1:
        loss = out.loss_sum / ex.inputs.global_loss_tokens
        tensors.append(loss if ex.loss_scaler is None else loss * ex.loss_scaler.scale)  # a power of two: exact
        grads.append(None)
    else:
        for name, t in out.sends.items():
            if t.requires_grad:
                g = st.grads[name]
                tensors.append(t)
                grads.append(g if g.dtype == t.dtype else g.to(t.dtype))
    record, carried = out.slice_record, None
    if record is not None:
        if m in ex.next_slice:
            if (s, m) not in ex.kv_grads:
                raise ValueError(f"token slice {m} runs its backward before slice {ex.next_slice[m]}'s")
            carried = ex.kv_grads.pop((s, m))
        extra, extra_grads = record.backward_roots(carried)
        tensors += extra
        grads += extra_grads
    if tensors:
        torch.autograd.backward(tensors, grads)
    if ex.zero is not None:
        ex.zero.end_backward(s)  # --zero 2: this micro-batch's gradients onto their owners
    if record is not None and ex.links[m] >= 0:
        ex.kv_grads[s, ex.links[m]] = record.context_grads(carried)
    st.input_grads = {n: t.grad for n, t in st.received.items()}
    st.output, st.received, st.grads = None, {}, {}


def _outgoing(ins: Instr, source: dict[str, torch.Tensor | None], device: torch.device) -> list[torch.Tensor]:
    """The tensors of a send, in the instruction's order, detached, in the plan's dtype, contiguous."""
    out = []
    for spec in ins.tensors:
        dtype = TORCH_DTYPES[spec.dtype]
        t = source.get(spec.name)
        if t is None:  # a received activation the stage did not use: its gradient is zero
            t = torch.zeros(spec.shape, dtype=dtype, device=device)
        t = t.detach()
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"{spec.name} has shape {tuple(t.shape)} but the plan sends {spec.shape}")
        out.append((t if t.dtype == dtype else t.to(dtype)).contiguous())
    return out


def _exec_send_act(ex: Executor, ins: Instr) -> None:
    tensors = _outgoing(ins, ex._state(ins).output.sends, ex.device)
    ex.pending[(ins.op, ins.stage, ins.micro_batch)] = Transfer(start_send(tensors, ins.peer, ins.tag), tensors, ins)


def _exec_send_grad(ex: Executor, ins: Instr) -> None:
    tensors = _outgoing(ins, ex._state(ins).input_grads, ex.device)
    ex.pending[(ins.op, ins.stage, ins.micro_batch)] = Transfer(start_send(tensors, ins.peer, ins.tag), tensors, ins)


def _exec_free(ex: Executor, ins: Instr) -> None:
    key = (ins.stage, ins.micro_batch)
    busy = [f"{op.value}{m}" for op, s, m in ex.pending if (s, m) == key]
    if busy:
        raise ValueError(f"FREE of micro-batch {ins.micro_batch} with transfers {busy} in flight")
    ex.states.pop(key, None)


def _exec_reduce(ex: Executor, ins: Instr) -> None:
    ex.reduce_gradients()


def _exec_step(ex: Executor, ins: Instr) -> None:
    ex.optimizer_step(ex.inputs.global_loss_tokens)


HANDLERS = {
    Op.LOAD: _exec_load,
    Op.FORWARD: _exec_forward,
    Op.BACKWARD: _exec_backward,
    Op.SEND_ACT: _exec_send_act,
    Op.RECV_ACT: _exec_recv,
    Op.SEND_GRAD: _exec_send_grad,
    Op.RECV_GRAD: _exec_recv,
    Op.WAIT: _exec_wait,
    Op.FREE: _exec_free,
    Op.REDUCE_GRADS: _exec_reduce,
    Op.OPTIMIZER_STEP: _exec_step,
}
"""Opcode -> handler ``(executor, instr)``."""
