"""The data-parallel gradient sum of :class:`~dynabatch.integrations.trainer.DynaBatchTrainer`: each replica runs its
own micro-batches (their counts may differ), so the gradients are summed once a step, in flat buckets, instead of by
DDP's hooks per backward."""

from __future__ import annotations

import torch

ALL_REDUCE_BUCKET_NUMEL = 2**25
"""Elements of one flat bucket of gradients summed by one ``all_reduce``."""


def all_reduce_sum(module: torch.nn.Module, loss: torch.Tensor) -> None:
    """Sum every gradient and ``loss`` over the default process group.

    Missing gradients become zeros, so every rank runs the same collectives. Gradients go in flat
    buckets of at most :data:`ALL_REDUCE_BUCKET_NUMEL` elements per (device, dtype), in parameter
    order (the same on every rank).
    """
    import torch.distributed as dist

    buckets: list[list[torch.Tensor]] = []
    sizes: list[int] = []
    filling: dict[tuple, int] = {}  # (device, dtype) -> index of the bucket being filled
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        key = (p.grad.device, p.grad.dtype)
        k = filling.get(key)
        if k is None or sizes[k] + p.grad.numel() > ALL_REDUCE_BUCKET_NUMEL:
            k = filling[key] = len(buckets)
            buckets.append([])
            sizes.append(0)
        buckets[k].append(p.grad)
        sizes[k] += p.grad.numel()
    for grads in buckets:
        flat = torch.cat([g.reshape(-1) for g in grads])  # (numel,)
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    dist.all_reduce(loss)
