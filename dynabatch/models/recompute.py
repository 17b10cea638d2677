"""Activation recomputation inside a stage forward: what each mode stores, what it runs again in backward.

The executor runs each stage forward under :func:`recompute_mode` (the plan's per-micro-batch mode,
:data:`~dynabatch.schedule.ir.RECOMPUTE_MODES`); the stage modules call their transformer blocks through
:func:`run_block` and the attention functions go through :func:`run_attention_core`, which read the mode:

* ``none``: plain calls; autograd stores every activation until the backward.
* ``selective``: each attention *core* (the part after the Q/K/V projections and before the output
  projection: :func:`~dynabatch.models.attention.segment_attention` on the padding-free path, the HF
  attention function the stage had before on the ``dense`` path, T5's position bias and mask included) runs
  under non-reentrant ``torch.utils.checkpoint``: its inputs (queries, keys, values, the mask or bias)
  stay stored, and what the core saves (SDPA's output and log-sum-exp, or with eager / dropout the
  ``(B, H, Q, K)`` scores, probabilities and dropout mask; the per-group gathered copies of the
  padding-free path) is dropped and recomputed when the core's backward needs it.
* ``full``: each transformer block runs under the checkpoint: only its inputs stay stored (hidden states,
  the dense mask, rotary cos/sin, T5's bias, ``enc_out`` and the cross bias; shared tensors once), and the
  block's whole forward runs again during its backward. Layers outside the blocks (embedding, final norm,
  head, loss) store as usual.

RNG exactness. The checkpoint runs with ``preserve_rng_state=True``: it stashes the CPU (and the inputs'
device) RNG state on entry and restores it for the recomputation, so dropout masks drawn again equal the
original ones; the executor seeds each stage forward with ``forked_rng(seed_for(...))``
(:mod:`dynabatch.models.split`, "Dropout"), so the stashed state is the same in every mode and losses and
gradients under ``selective`` / ``full`` equal ``none`` (fp32, tests/unit/models/test_recompute.py). The
recomputation also runs under the forward's mode (:func:`_in_mode`; the backward may run on another
thread or outside the executor's context) and the forward's autocast state (the checkpoint records it).

Meter. Inside a checkpointed region the checkpoint's own saved-tensor hooks replace the outer ones, so
:class:`~dynabatch.engine.memory.SavedActivationMeter` would not see what the region keeps. Each region's
tensor inputs therefore first pass through :class:`_KeepInputs`, an identity autograd node that saves
them (the tensor the checkpoint holds anyway, no copy): the meter counts them once per storage and stops
counting them when the node's backward has run, right after the region's backward. Not metered: the
activations a region recomputes, alive only while its backward runs (the cost side adds the largest
block's or core's stored bytes to the transient peak).

Token slices (TeraPipe, :mod:`dynabatch.models.slice_kv`). Under ``full`` a block's attention calls the
slice cache during the recomputation again; :meth:`~dynabatch.models.slice_kv.SliceCache.update` sees that
the block's keys/values are already recorded and returns the recorded context leaf joined with the
recomputed keys/values without recording anything, so the backward roots, the context leaves whose
gradient goes to the previous slice and the context handed to the next slice stay the original forward's.
Sliced forwards therefore run all three modes exactly (tests/unit/models/test_recompute.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from dynabatch.schedule.ir import check_recompute_mode

_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("dynabatch_recompute_mode", default="none")


@contextlib.contextmanager
def recompute_mode(mode: str) -> Iterator[None]:
    """Run the body (one stage forward) with activation recomputation ``mode`` (module docstring)."""
    token = _MODE.set(check_recompute_mode(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def current_mode() -> str:
    """The recomputation mode of the stage forward running (``none`` outside :func:`recompute_mode`)."""
    return _MODE.get()


def run_block(block: Callable, *args, **kwargs):
    """``block(*args, **kwargs)``; under ``full`` checkpointed, storing only its inputs."""
    if _MODE.get() != "full":
        return block(*args, **kwargs)
    return checkpointed(block, *args, **kwargs)


def run_attention_core(core: Callable, *args, **kwargs):
    """``core(*args, **kwargs)``: an attention core; under ``selective`` checkpointed, storing only its inputs."""
    if _MODE.get() != "selective":
        return core(*args, **kwargs)
    return checkpointed(core, *args, **kwargs)


def checkpointed(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` under non-reentrant, RNG-preserving checkpointing, its inputs visible to the
    meter (module docstring). Without a graph (no grad, nothing requires it) a plain call."""
    tensors = [t for t in _tensors(args, kwargs)]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return fn(*args, **kwargs)
    args, kwargs = _keep_inputs(tensors, args, kwargs)
    return checkpoint(_in_mode, _MODE.get(), fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def _in_mode(mode: str, fn: Callable, *args, **kwargs):
    """Run ``fn`` under ``mode``: the forward and its recomputation see the same mode."""
    token = _MODE.set(mode)
    try:
        return fn(*args, **kwargs)
    finally:
        _MODE.reset(token)


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    """The tensors among the arguments, one level into tuples and lists (e.g. rotary ``(cos, sin)``)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


class _KeepInputs(torch.autograd.Function):
    """Identity on ``anchor`` that saves ``anchor`` and ``others`` for backward: the tensors a checkpointed
    region keeps, seen by outer saved-tensor hooks and released when its backward has run."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(anchor, *others)
        ctx.num_others = len(others)
        return anchor.view_as(anchor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *([None] * ctx.num_others))


def _keep_inputs(tensors: list[torch.Tensor], args, kwargs):
    """Route the first input that requires grad through :class:`_KeepInputs` (saving every tensor input)."""
    anchor = next(t for t in tensors if t.requires_grad)
    others = [t.detach() for t in tensors if t is not anchor]
    kept = _KeepInputs.apply(anchor, *others)

    def swap(a):
        if a is anchor:
            return kept
        if isinstance(a, (tuple, list)) and any(x is anchor for x in a):
            return type(a)(kept if x is anchor else x for x in a)
        return a

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}
