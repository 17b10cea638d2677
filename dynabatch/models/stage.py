"""The contract between pipeline stage modules and the runtime executor.

A Hugging Face model is split into ``S`` :class:`StageModule`s (``dynabatch.models.split``). For
each micro-batch the executor calls ``stage(received, loaded)``:

* ``received``: tensors from the previous stage, by the names of
  :meth:`dynabatch.schedule.ir.PipelineSpec.send_tensors` (``hidden`` for GPT-2, ``enc_hidden`` for
  T5 encoder stages, ``dec_hidden`` + ``enc_out`` for T5 decoder stages); empty on stage 0.
* ``loaded``: host inputs by the names of :meth:`PipelineSpec.load_tensors` (``segment_ids``,
  ``input_ids``, ``position_ids``, ``decoder_segment_ids``, ``decoder_input_ids``, ``labels``).

It returns a :class:`StageOutput`: the tensors to send downstream (same names as the next stage
receives), or, on the last stage, the summed token loss and the number of loss tokens. The executor
backpropagates ``loss_sum / total loss tokens of the global batch`` on the last stage and, elsewhere,
``torch.autograd.backward(outputs, grads received)``.

Parameters that several stages hold copies of (tied embeddings, T5's relative-position bias that
every layer of a stack uses) are listed by :meth:`StageModule.tied_parameters`; the runtime sums
their gradients across the stages that hold them so every copy takes the same optimizer step.

Moving boundaries. A stage built with ``moving_boundaries=True`` also holds copies of the neighbouring
stages' units that may cross its boundaries (:mod:`dynabatch.models.boundary_copies`); its forward takes
the keyword ``moves=(lower, upper)`` (:func:`~dynabatch.cost.boundary_moves.stage_moves` of the
micro-batch's row) and runs exactly :func:`~dynabatch.cost.boundary_moves.run_kinds`. The copies are tied
parameters grouped by their original names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from dynabatch.data.microbatch import IGNORE_INDEX
from dynabatch.models.masks import _token_losses, bidirectional_segment_mask, causal_segment_mask
from dynabatch.models.attention import build_segments
from dynabatch.models.boundary_copies import NO_SIDES, BoundarySides, boundary_sides
from dynabatch.cost.boundary_moves import held_kinds

if TYPE_CHECKING:
    from dynabatch.models.slice_kv import SliceRecord


@dataclass
class StageOutput:
    """What a stage produces for one micro-batch."""

    sends: dict[str, torch.Tensor] = field(default_factory=dict)
    """Activations for the next stage (empty on the last stage)."""
    loss_sum: torch.Tensor | None = None
    """Last stage only: sum of token cross-entropies (fp32 scalar, differentiable)."""
    num_loss_tokens: int = 0
    """Last stage only: tokens that carry loss."""
    segment_losses: torch.Tensor | None = None
    """Last stage only: (B, K, 2) float64 per row and segment: summed token loss and loss-token count
    (segment k + 1 of row b), for per-sample and per-task loss reporting. Detached."""
    slice_record: "SliceRecord | None" = None
    """Token slices only: the slice's keys/values on this stage (:mod:`dynabatch.models.slice_kv`)."""
    token_losses: torch.Tensor | None = None
    """Last stage only: (B, T) fp32 per-token losses shaped like the labels, 0 where ignored."""


def segment_losses(token_losses: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Sum of token losses and count of loss tokens per (row, segment): (B, K, 2) float64 on the CPU.

    ``token_losses``, ``labels`` and ``segment_ids`` are (B, T) aligned with the targets; ``K`` is the
    largest segment id. Padding (segment 0) and ignored targets are left out.
    """

    seg = segment_ids.long()  # (B, T)
    k = max(int(seg.max()), 1)
    valid = (labels != IGNORE_INDEX) & (seg > 0)  # (B, T)
    index = (seg - 1).clamp(min=0)  # (B, T)
    out = torch.zeros(seg.shape[0], k, 2, dtype=torch.float64, device=seg.device)  # (B, K, 2)
    out[:, :, 0].scatter_add_(1, index, torch.where(valid, token_losses.detach().double(), 0.0))
    out[:, :, 1].scatter_add_(1, index, valid.double())
    return out.cpu()


def loss_output(logits: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor,
                slice_record: "SliceRecord | None" = None) -> StageOutput:
    """The last stage's :class:`StageOutput` from its logits (B, T, V) and pre-shifted ``labels`` (B, T):
    the fp32 token-loss sum, the loss-token count and the per-segment losses."""

    token_losses = _token_losses(logits, labels)  # (B, T)
    return StageOutput(loss_sum=token_losses.sum(), num_loss_tokens=int((labels != IGNORE_INDEX).sum()),
                       segment_losses=segment_losses(token_losses, labels, segment_ids), slice_record=slice_record,
                       token_losses=token_losses)


class StageModule(torch.nn.Module):
    """One pipeline stage of a split model (see the module docstring).

    Stages of causal models may run token slices (:attr:`supports_slices`): ``forward(received,
    loaded, context, sliced=True)`` also attends to ``context`` (the keys/values of the earlier slices
    of the same rows, or ``None`` for a chain's first slice) and returns a ``slice_record``.
    """

    stage_index: int
    num_stages: int
    kinds: tuple[str, ...]
    """The layer kinds this stage holds, in model order."""
    has_embedding: bool
    has_head: bool
    parameter_map: dict[str, str]
    """Stage parameter name -> the original model's parameter name (tied copies map to the canonical name); filled
    by :func:`dynabatch.models.split.build_stage`."""
    supports_slices: bool = False
    attention: str = "dense"
    """``segments`` (padding-free) or ``dense`` (4-D masks); set by :func:`dynabatch.models.split.build_stage`."""
    held_kinds: tuple[str, ...]
    """:attr:`kinds` plus, under moving boundaries, the neighbours' units this stage holds copies of
    (:func:`~dynabatch.cost.boundary_moves.held_kinds`)."""
    moving_boundaries: bool = False
    """Built with ``moving_boundaries`` (:func:`dynabatch.models.split.build_stage`)."""
    boundary_sides: BoundarySides = NO_SIDES
    """Which boundary copies the stage holds and which of its units it lends
    (:mod:`~dynabatch.models.boundary_copies`)."""

    def _place(self, layout, stage_index: int, moving_boundaries: bool = False) -> tuple[str, ...]:
        """Record where this stage sits in ``layout`` (index, count, its kinds, whether it holds the embedding and the
        head; an empty :attr:`parameter_map`; with ``moving_boundaries`` its :attr:`boundary_sides` and held kinds);
        returns its kinds. Every family's ``__init__`` starts with it."""
        kinds = tuple(layout.stages[stage_index])
        self.stage_index = stage_index
        self.num_stages = layout.num_stages
        self.kinds = kinds
        self.moving_boundaries = moving_boundaries
        self.held_kinds = held_kinds(layout, stage_index) if moving_boundaries else kinds
        self.boundary_sides = boundary_sides(layout, stage_index) if moving_boundaries else NO_SIDES
        self.has_embedding = "embedding" in kinds
        self.has_head = "lm_head" in kinds
        self.parameter_map = {}
        return kinds

    def movable_units(self) -> torch.nn.ModuleList:
        """The stage's own units of the stack a boundary may move within, in order (decoder-only: its ``blocks``);
        :mod:`~dynabatch.models.boundary_copies` lends their first/last and runs them per move."""
        return self.blocks

    def original_names(self) -> dict[str, str]:
        """Stage parameter name -> original HF parameter name (see :attr:`parameter_map`)."""
        return dict(self.parameter_map)

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        """Where the stage's weights live and in what dtype (the dtype its dense masks take)."""
        weight = next(self.parameters())
        return weight.device, weight.dtype

    def causal_output(self, hidden: torch.Tensor, loaded: dict[str, torch.Tensor], segment_ids: torch.Tensor,
                      cache, final_norm: str) -> StageOutput:
        """A decoder-only stage's result: ``hidden`` (B, T, d) sent on, or on the last stage the head's logits
        (B, T, V) after its ``final_norm`` (the attribute's name) against the pre-shifted ``labels``; with the
        token-slice ``cache``'s record either way."""
        record = cache.record(segment_ids) if cache is not None else None
        if not self.has_head:
            return StageOutput(sends={"hidden": hidden}, slice_record=record)
        labels = loaded["labels"].to(hidden.device, non_blocking=True)  # (B, T)
        return loss_output(self.lm_head(getattr(self, final_norm)(hidden)), labels, segment_ids, record)

    def self_attention_mask(self, kind: str, segment_ids: torch.Tensor, dtype: torch.dtype, device,
                            context_segment_ids: torch.Tensor | None = None):
        """What the stage's layers get as ``attention_mask`` for self-attention of ``kind`` (``causal`` or
        ``bidirectional``) over host (B, T) ``segment_ids``: a :class:`~dynabatch.models.attention.Segments`
        layout, or the dense (B, 1, T, C + T) additive mask."""

        if self.attention == "segments":
            return build_segments(kind, segment_ids, context_segment_ids=context_segment_ids, device=device)
        ids = segment_ids.to(device, non_blocking=True)
        if kind == "bidirectional":
            return bidirectional_segment_mask(ids, dtype)
        context = None if context_segment_ids is None else context_segment_ids.to(device)
        return causal_segment_mask(ids, dtype, context)

    def forward(self, received: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> StageOutput:  # noqa: D102
        raise NotImplementedError

    def tied_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Parameters shared with other stages, keyed by a group name the same on every stage
        (e.g. ``shared_embedding``, ``encoder_relative_bias``)."""
        return {}
