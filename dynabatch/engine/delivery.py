"""Plan delivery: every rank gets its own instruction list and what it needs to load its micro-batches.

Rank 0 (the planner host) holds every rank's :class:`ExecutionPlan`. Per step it packs, for each rank, one byte
message: the plan's versioned bytes (:meth:`ExecutionPlan.to_bytes`), then either

* a *layout* (:attr:`StepInputs.layout`): the application's own bytes naming the samples and rows of the
  rank's micro-batches (the training application's: :mod:`dynabatch.training.step_data`), from which the rank
  collates its micro-batches itself (``collate`` of :func:`~dynabatch.engine.step.train_step`): no token
  travels; or
* the host tensors the plan's ``LOAD`` instructions name, in instruction order, each converted to its spec
  dtype and 8-byte aligned (a caller without a layout: the start-up calibration, evaluation, ``bench``,
  ``examples/engine_only.py``). No shapes travel with the tensors: the receiver reads them from its plan,
  exactly as it allocates activation buffers. Only ``PipelineSpec.load_tensors`` of that rank's stage are
  sent (token ids to the first stage, labels to the last, segment ids for masks elsewhere).

A fixed 7-int64 header (magic, format, step, plan bytes, layout bytes, total bytes, global loss tokens) goes
first, so the receiver allocates the message buffer exactly.

Transport: non-blocking gloo ``isend``/``irecv`` on the world-wide ``delivery_group`` (CPU, even when
training runs on NCCL), tags 0 (header) and 1 (message). :func:`send_step` only starts the sends and
returns a :class:`PendingDelivery`, so rank 0 can start computing its own step (or plan the next one)
while the others are still finishing the previous step; it must call ``wait()`` before it reuses the
tensors. The global loss-token count (all micro-batches of all replicas) rides in the header.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dynabatch.engine.p2p import TORCH_DTYPES
from dynabatch.schedule.ir import ExecutionPlan, Op, TensorSpec

MAGIC = 0x44425350  # "DBSP"
FORMAT_VERSION = 2
"""2: the header holds the layout's length and a message holds a layout or tensors (1: tensors only)."""
HEADER_LEN = 7
_HEADER_TAG, _PAYLOAD_TAG = 0, 1


@dataclass(frozen=True)
class StepInputs:
    """What one rank needs for one step."""

    plan: ExecutionPlan
    loaded: dict[int, dict[str, torch.Tensor]]
    """Micro-batch -> host tensors of its ``LOAD`` (names and shapes of ``Instr.tensors``)."""
    global_loss_tokens: int
    """Loss-carrying tokens of the whole global batch, every micro-batch of every replica."""
    layout: bytes = b""
    """The application's description of this rank's micro-batches, which the rank collates itself (``loaded`` then
    comes from them, :func:`~dynabatch.engine.step.own_inputs`); ``b""``: ``loaded`` travels as tensors."""


@dataclass
class PendingDelivery:
    """Sends started by :func:`send_step`; keep it until ``wait()`` (it holds the send buffers)."""

    works: list = field(default_factory=list)
    buffers: list = field(default_factory=list)

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works.clear()
        self.buffers.clear()


def _align(n: int) -> int:
    return (n + 7) // 8 * 8


def _loads(plan: ExecutionPlan) -> list[tuple[int, TensorSpec]]:
    """``(micro-batch, tensor)`` of the plan's loads, each once (two chunks of a rank may load the same one)."""
    seen: dict[tuple[int, str], TensorSpec] = {}
    for ins in plan.instructions:
        if ins.op is Op.LOAD:
            for t in ins.tensors:
                if seen.setdefault((ins.micro_batch, t.name), t) != t:
                    raise ValueError(f"rank {plan.rank}: micro-batch {ins.micro_batch} loads {t.name} with two shapes")
    return [(m, t) for (m, _), t in seen.items()]


def check_inputs(inputs: StepInputs) -> None:
    """``ValueError`` when ``loaded`` lacks a tensor the plan loads or has the wrong shape."""
    for m, spec in _loads(inputs.plan):
        t = inputs.loaded.get(m, {}).get(spec.name)
        if t is None:
            raise ValueError(f"rank {inputs.plan.rank}: micro-batch {m} lacks loaded tensor {spec.name!r}")
        if tuple(t.shape) != spec.shape:
            raise ValueError(
                f"rank {inputs.plan.rank}: micro-batch {m} tensor {spec.name} has shape {tuple(t.shape)}, "
                f"the plan says {spec.shape}"
            )


def pack(inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The header (int64, ``HEADER_LEN``) and the message (uint8) of one rank's step: the plan, then the layout
    or, without one, the tensors the plan loads."""
    plan_bytes, layout = inputs.plan.to_bytes(), inputs.layout
    loads = [] if layout else _loads(inputs.plan)
    if not layout:
        check_inputs(inputs)
    total = _align(len(plan_bytes)) + _align(len(layout)) + sum(_align(t.nbytes) for _, t in loads)
    payload = torch.zeros(total, dtype=torch.uint8)
    payload[: len(plan_bytes)] = torch.frombuffer(bytearray(plan_bytes), dtype=torch.uint8)
    offset = _align(len(plan_bytes))
    if layout:
        payload[offset : offset + len(layout)] = torch.frombuffer(bytearray(layout), dtype=torch.uint8)
        offset += _align(len(layout))
    for m, spec in loads:
        t = inputs.loaded[m][spec.name].to(TORCH_DTYPES[spec.dtype]).contiguous().reshape(-1)
        payload[offset : offset + spec.nbytes] = t.view(torch.uint8)
        offset += _align(spec.nbytes)
    header = torch.tensor(
        [MAGIC, FORMAT_VERSION, inputs.plan.step, len(plan_bytes), len(layout), total, inputs.global_loss_tokens],
        dtype=torch.int64,
    )
    return header, payload


def unpack(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    """Inverse of :func:`pack`; loaded tensors are views into ``payload`` (none when a layout came)."""
    magic, version = header[:2].tolist()
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ValueError(f"bad step delivery header (magic {magic:#x}, format {version}); planner and ranks must run the same dynabatch")
    _, _, _, plan_len, layout_len, total, tokens = header.tolist()
    plan = ExecutionPlan.from_bytes(payload[:plan_len].numpy().tobytes())
    loaded: dict[int, dict[str, torch.Tensor]] = {}
    offset = _align(plan_len)
    layout = payload[offset : offset + layout_len].numpy().tobytes()
    offset += _align(layout_len)
    for m, spec in [] if layout_len else _loads(plan):
        raw = payload[offset : offset + spec.nbytes]
        loaded.setdefault(m, {})[spec.name] = raw.view(TORCH_DTYPES[spec.dtype]).view(spec.shape)
        offset += _align(spec.nbytes)
    assert offset == total, f"delivery message has {total} bytes, the plan accounts for {offset}"
    return StepInputs(plan, loaded, int(tokens), layout)


def send_step(payloads: dict[int, StepInputs], group, world_size: int) -> tuple[StepInputs, PendingDelivery]:
    """Rank 0: start sending every other rank its :class:`StepInputs`; returns rank 0's own and the
    pending sends. ``payloads`` must hold every rank ``0 .. world_size - 1``."""
    missing = sorted(set(range(world_size)) - set(payloads))
    if missing:
        raise ValueError(f"step payloads lack ranks {missing}")
    for r, p in payloads.items():
        if p.plan.rank != r:
            raise ValueError(f"payload for rank {r} carries the plan of rank {p.plan.rank}")
    pending = PendingDelivery()
    for r in range(1, world_size):
        header, payload = pack(payloads[r])
        pending.buffers += [header, payload]
        pending.works.append(dist.isend(header, dst=r, group=group, tag=_HEADER_TAG))
        pending.works.append(dist.isend(payload, dst=r, group=group, tag=_PAYLOAD_TAG))
    own = payloads[0]
    if not own.layout:
        check_inputs(own)
    return own, pending


def receive_step(group, timeout_s: float | None = None) -> StepInputs:
    """Any rank but 0: receive this step's :class:`StepInputs` from rank 0 (blocks; raises on timeout).
    ``timeout_s`` replaces the group's timeout for this step (gloo's ``Work.wait(timeout)`` overrides it
    either way): the first step waits for rank 0 to load the data."""
    wait = () if timeout_s is None else (timedelta(seconds=timeout_s),)
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    dist.irecv(header, src=0, group=group, tag=_HEADER_TAG).wait(*wait)
    payload = torch.empty(int(header[5]), dtype=torch.uint8)
    dist.irecv(payload, src=0, group=group, tag=_PAYLOAD_TAG).wait(*wait)
    return unpack(header, payload)
