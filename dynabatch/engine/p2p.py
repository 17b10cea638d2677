"""Point-to-point transfers of one plan message: exact buffers from the plan's tensor specs.

A message (one ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``) carries one or more tensors (T5 decoder
stages send ``dec_hidden`` and ``enc_out``). Tensor ``j`` of a message with plan tag ``t`` travels
with wire tag ``t * MAX_TENSORS_PER_MESSAGE + j``, so gloo matches every tensor by tag; NCCL ignores
tags, and both ends post a message's tensors in the same order inside one ``batch_isend_irecv``.
Receive buffers are allocated with exactly the plan's shape and dtype (gloo silently accepts a
message shorter than its buffer, and aborts on a longer one, so exact shapes are what make it safe).
Starts never block; :func:`wait_all` completes them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dynabatch.schedule.ir import DTYPE_BYTES, TensorSpec

MAX_TENSORS_PER_MESSAGE = 4
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_BYTES}
"""TensorSpec dtype string -> torch dtype."""


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; valid dtypes: {', '.join(TORCH_DTYPES)}") from None


def allocate(specs: tuple[TensorSpec, ...], device: torch.device) -> list[torch.Tensor]:
    """Uninitialised buffers with exactly the specs' shapes and dtypes."""
    return [torch.empty(t.shape, dtype=TORCH_DTYPES[t.dtype], device=device) for t in specs]


def _wire_tag(tag: int, j: int) -> int:
    return tag * MAX_TENSORS_PER_MESSAGE + j


def _start(tensors: list[torch.Tensor], peer: int, tag: int, group, send: bool) -> list:
    if len(tensors) > MAX_TENSORS_PER_MESSAGE:
        raise ValueError(f"a message carries at most {MAX_TENSORS_PER_MESSAGE} tensors, got {len(tensors)}")
    if len(tensors) > 1 and tensors[0].is_cuda:
        fn = dist.isend if send else dist.irecv
        ops = [dist.P2POp(fn, t, peer, group, _wire_tag(tag, j)) for j, t in enumerate(tensors)]
        return dist.batch_isend_irecv(ops)
    if send:
        return [dist.isend(t, dst=peer, group=group, tag=_wire_tag(tag, j)) for j, t in enumerate(tensors)]
    return [dist.irecv(t, src=peer, group=group, tag=_wire_tag(tag, j)) for j, t in enumerate(tensors)]


def start_send(tensors: list[torch.Tensor], peer: int, tag: int, group=None) -> list:
    """Start sending contiguous ``tensors`` to global rank ``peer``; returns the work handles."""
    return _start(tensors, peer, tag, group, send=True)


def start_recv(buffers: list[torch.Tensor], peer: int, tag: int, group=None) -> list:
    """Start receiving into ``buffers`` from global rank ``peer``; returns the work handles."""
    return _start(buffers, peer, tag, group, send=False)


def wait_all(works: list) -> None:
    """Block until every handle completed (raises if a peer died or the group's timeout passed)."""
    for w in works:
        w.wait()
