"""Keys and values carried between the token slices of a chain on one pipeline stage (TeraPipe).

Slice ``j`` of some rows attends causally to its own tokens and to every earlier token of the same
rows, whose keys and values the earlier slices computed on this stage. Forward and backward then run
like this, per stage and per attention block:

* forward of slice ``j``: the block's attention calls :meth:`SliceCache.update` (Hugging Face's cache
  hook, ``GPT2Attention`` calls it with the slice's own keys/values ``K_j, V_j``). It returns
  ``[K_<j ; K_j]``, where ``K_<j`` (the :class:`SliceContext` of the earlier slices, kept detached) enters
  as a fresh leaf with ``requires_grad`` so that its gradient can be read after the backward. The
  mask is causal aligned bottom-right (:func:`~dynabatch.models.forward.causal_segment_mask` with the
  context's segment ids) and GPT-2's first stage loads the slice's position ids, which continue the
  sample's positions. If a later slice follows, :meth:`SliceRecord.extend` appends the detached
  ``K_j, V_j`` to the context it will see.
* backward, in reverse slice order: slice ``j`` receives ``G_j``, the gradient of the keys/values of
  tokens ``[0, c_j + s_j)`` that the later slices accumulated (``None`` for the last slice). Its
  backward roots are the stage's usual outputs plus its own ``K_j, V_j`` with the ``[c_j, c_j + s_j)``
  part of ``G_j`` (:meth:`SliceRecord.backward_roots`); afterwards the context leaves hold this
  slice's gradient of ``K_<j, V_<j``, and the gradient handed to slice ``j - 1`` is that plus the
  ``[0, c_j)`` part of ``G_j`` (:meth:`SliceRecord.context_grads`).

So every parameter gradient equals the unsliced sequence's, as autograd on the whole sequence would
sum the same terms (tests/dist/test_token_slicing.py; dropping ``G_j`` breaks the equality). Memory:
each slice's saved attention inputs hold ``[K_<j ; K_j]`` (``c_j + s_j`` tokens per block) until its
backward, and the carried gradient holds ``c_j`` tokens per block; the slice cost models
(:mod:`dynabatch.plan.slicing`) price both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SliceContext:
    """The detached keys/values of a chain's earlier slices on one stage."""

    keys: list[torch.Tensor]
    """Per attention block of the stage, (B, H, C, head_dim)."""
    values: list[torch.Tensor]
    segment_ids: torch.Tensor
    """(B, C) segment ids of the context tokens (for the mask)."""

    @property
    def length(self) -> int:
        return int(self.segment_ids.shape[1])


@dataclass
class SliceGrads:
    """Gradients of a chain's keys/values over tokens ``[0, n)``, per block, (B, H, n, head_dim)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class SliceCache:
    """The ``cache`` handed to each attention block while a token slice runs (duck-typed to the
    ``update(key_states, value_states, layer_idx, ...)`` hook of transformers' ``Cache``).

    ``layer_ids``: the ``layer_idx`` of the stage's attention blocks, in order.
    """

    def __init__(self, context: SliceContext | None, layer_ids: list[int]) -> None:
        self.context = context
        self.index = {layer: i for i, layer in enumerate(layer_ids)}
        n = len(layer_ids)
        self.own_keys: list[torch.Tensor | None] = [None] * n
        self.own_values: list[torch.Tensor | None] = [None] * n
        self.context_keys: list[torch.Tensor | None] = [None] * n
        self.context_values: list[torch.Tensor | None] = [None] * n

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Record the slice's own keys/values of block ``layer_idx``; return context + own.

        A second call for the same block is the recomputation of a checkpointed block (``full``
        recomputation, :mod:`dynabatch.models.recompute`): it records nothing and joins the recomputed
        keys/values to the context leaves of the first call, so the backward roots and the leaves whose
        gradient goes to the previous slice stay the original forward's.
        """
        i = self.index[layer_idx]
        recomputing = self.own_keys[i] is not None
        if not recomputing:
            self.own_keys[i], self.own_values[i] = key_states, value_states
        if self.context is None:
            return key_states, value_states
        if not recomputing:
            self.context_keys[i] = self.context.keys[i].detach().requires_grad_()  # (B, H, C, hd) leaf: .grad is dK_<j
            self.context_values[i] = self.context.values[i].detach().requires_grad_()
        k, v = self.context_keys[i], self.context_values[i]
        return torch.cat([k, key_states], dim=2), torch.cat([v, value_states], dim=2)

    def record(self, segment_ids: torch.Tensor) -> "SliceRecord":
        """What the stage keeps of this slice until its backward (``segment_ids``: the slice's, (B, S))."""
        if any(k is None for k in self.own_keys):
            raise RuntimeError("a block of the stage did not call the slice cache; is the attention cache-aware?")
        return SliceRecord(self, segment_ids)


class SliceRecord:
    """One slice's keys/values on one stage, from its forward to its backward (see the module docstring)."""

    def __init__(self, cache: SliceCache, segment_ids: torch.Tensor) -> None:
        self.cache = cache
        self.segment_ids = segment_ids  # (B, S)
        self.context_length = cache.context.length if cache.context is not None else 0

    def extend(self) -> SliceContext:
        """The context the next slice of the chain sees: this slice's context plus its own keys/values."""
        c = self.cache
        own_k = [k.detach() for k in c.own_keys]
        own_v = [v.detach() for v in c.own_values]
        if c.context is None:
            return SliceContext(own_k, own_v, self.segment_ids)
        return SliceContext(
            [torch.cat([a, b], dim=2) for a, b in zip(c.context.keys, own_k)],
            [torch.cat([a, b], dim=2) for a, b in zip(c.context.values, own_v)],
            torch.cat([c.context.segment_ids, self.segment_ids], dim=1),
        )

    def backward_roots(self, carried: SliceGrads | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Extra backward roots: the slice's own keys/values with their part of the carried gradient."""
        if carried is None:
            return [], []
        c, own = self.cache, slice(self.context_length, None)
        tensors = [*c.own_keys, *c.own_values]
        grads = [g[:, :, own] for g in (*carried.keys, *carried.values)]
        for t, g in zip(tensors, grads):
            if tuple(g.shape) != tuple(t.shape):
                raise ValueError(f"carried key/value gradient {tuple(g.shape)} does not match the slice's {tuple(t.shape)}")
        return tensors, [g if g.dtype == t.dtype else g.to(t.dtype) for t, g in zip(tensors, grads)]

    def context_grads(self, carried: SliceGrads | None) -> SliceGrads | None:
        """After the backward: the gradient of the context's keys/values to hand to the previous slice."""
        c = self.cache
        if c.context is None:
            return None
        ctx = slice(0, self.context_length)

        def total(leaves, carried_part):
            out = []
            for i, leaf in enumerate(leaves):
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                if carried_part is not None:
                    g = g + carried_part[i][:, :, ctx]
                out.append(g)
            return out

        return SliceGrads(
            total(c.context_keys, carried.keys if carried is not None else None),
            total(c.context_values, carried.values if carried is not None else None),
        )
