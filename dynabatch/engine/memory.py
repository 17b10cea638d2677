"""Peak activation memory on any device: bytes autograd keeps for backward, metered by saved-tensor hooks.

CUDA has ``torch.cuda.max_memory_allocated``; the CPU allocator reports nothing comparable, and a
process's peak RSS only grows. :class:`SavedActivationMeter` instead counts the storages autograd saves
for backward while it is active (``torch.autograd.graph.saved_tensors_hooks``): a storage counts once
however many ops save views of it, from the first save until the last graph node holding it is freed
(after its backward), and parameters (``exclude``) and autocast's half-precision copies of them never count. That is the activation memory that
micro-batch sizes, schedules and token slicing change; transient buffers inside one op (and tensors
kept outside autograd, such as the executor's received buffers or a slice chain's carried keys/values)
are not in it.

Activation recomputation (:mod:`dynabatch.models.recompute`): inside a checkpointed block or attention
core the checkpoint's own hooks replace these, so nothing the region saves internally is seen (it is
dropped and recomputed in backward). What the region really keeps, its tensor inputs, is saved through an
identity autograd node in front of it, so the meter counts it like any saved tensor, once per storage, until
the region's backward has run. The recomputed activations, alive only during one region's backward, are
not counted. Measured (tests/unit/models/test_recompute.py): a two-block GPT-2 stage keeps exactly its two
``(B, T, d)`` block inputs under ``full``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SavedActivationMeter:
    """``with SavedActivationMeter(exclude=model.parameters()) as meter: ...``; then ``meter.peak_bytes``."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or key == 0 or self._is_weight_cast(t):
            return t
        n = self._refs.get(key, 0)
        if n == 0:
            self._sizes[key] = storage.nbytes()
            self.live_bytes += self._sizes[key]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = n + 1
        return _Saved(t, key, self)

    def _is_weight_cast(self, t: torch.Tensor) -> bool:
        """Autocast's half-precision copy of an excluded parameter (``ToCopyBackward0`` straight from its gradient
        accumulator): a model state, shared by every micro-batch of the step and priced as one
        (``AnalyticCostModel.cast_copy_bytes``), not an activation. Counted, it made bf16 runs of gpt2-small and
        t5-small read 1.08-1.22x their prediction."""
        fn = (t._base if t._base is not None else t).grad_fn  # the linear saves a transposed view of the copy
        if fn is None or type(fn).__name__ != "ToCopyBackward0" or not fn.next_functions:
            return False
        source = fn.next_functions[0][0]
        variable = getattr(source, "variable", None)
        return variable is not None and variable.untyped_storage().data_ptr() in self._exclude

    def _release(self, key: int) -> None:
        n = self._refs[key] - 1
        if n:
            self._refs[key] = n
        else:
            del self._refs[key]
            self.live_bytes -= self._sizes.pop(key)


class _Saved:
    """A saved tensor; when autograd drops it (graph freed), the meter stops counting its storage."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Saved) else packed
