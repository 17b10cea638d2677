"""Model-ready micro-batches.

A micro-batch is a set of rows, each row holding one sample (padding) or several
(packing). Rows do not carry attention masks: they carry *segment ids* (1, 2, ...
for the samples in a row, 0 for padding) and per-sample *position ids*, and the
model adapters in :mod:`dynabatch.models.forward` build the masks from them
(block-diagonal, causal where needed, cross-attention confined to the same
segment). Padding and packing therefore run through one code path.

Targets are stored *already shifted* for causal models: ``target_ids[b, t]`` is
the token that position ``t`` must predict, or ``IGNORE_INDEX`` when there is no
loss there (inputs, padding, sample boundaries). No model-internal label shift
can then leak across packed samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass(frozen=True)
class CausalMicroBatch:
    """Rows for a decoder-only (GPT) model. All tensors are (B, T) int64."""

    input_ids: torch.Tensor
    """Token ids; padding uses the tokenizer's pad id."""
    target_ids: torch.Tensor
    """Next-token targets, already shifted; ``IGNORE_INDEX`` where no loss is taken."""
    position_ids: torch.Tensor
    """Positions restarting at 0 for every sample (0 on padding)."""
    segment_ids: torch.Tensor
    """1.. for the samples of a row in order, 0 for padding."""
    sample_ids: tuple[tuple[int, ...], ...]
    """For each row, the global-batch sample indices of its segments, in segment order."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def num_real_tokens(self) -> int:
        """Tokens that belong to samples (inputs + targets)."""
        return int((self.segment_ids > 0).sum())

    @property
    def num_computed_tokens(self) -> int:
        """Tokens the model computes on, padding included (B * T)."""
        return int(self.input_ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int((self.target_ids != IGNORE_INDEX).sum())

    @property
    def num_samples(self) -> int:
        return sum(len(r) for r in self.sample_ids)


@dataclass(frozen=True)
class Seq2SeqMicroBatch:
    """Rows for an encoder-decoder (T5) model: encoder (B, E) and decoder (B, D) tensors, int64."""

    input_ids: torch.Tensor
    """Encoder token ids (B, E)."""
    encoder_segment_ids: torch.Tensor
    """Encoder segment ids (B, E): 1.. per sample, 0 for padding."""
    encoder_position_ids: torch.Tensor
    """Encoder positions (B, E), restarting per sample."""
    decoder_input_ids: torch.Tensor
    """Decoder inputs (B, D): each sample's targets shifted right behind the decoder start token."""
    labels: torch.Tensor
    """Decoder targets (B, D); ``IGNORE_INDEX`` on padding."""
    decoder_segment_ids: torch.Tensor
    """Decoder segment ids (B, D); segment k of a row's decoder is segment k of its encoder."""
    decoder_position_ids: torch.Tensor
    """Decoder positions (B, D), restarting per sample."""
    sample_ids: tuple[tuple[int, ...], ...]
    """For each row, the global-batch sample indices of its segments, in segment order."""

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, E, D)."""
        b, e = self.input_ids.shape
        return (b, e, int(self.decoder_input_ids.shape[1]))

    @property
    def num_real_tokens(self) -> int:
        return int((self.encoder_segment_ids > 0).sum() + (self.decoder_segment_ids > 0).sum())

    @property
    def num_computed_tokens(self) -> int:
        return int(self.input_ids.numel() + self.decoder_input_ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def num_samples(self) -> int:
        return sum(len(r) for r in self.sample_ids)


MicroBatch = CausalMicroBatch | Seq2SeqMicroBatch


def token_slices(mb: CausalMicroBatch, bounds) -> list[CausalMicroBatch]:
    """Cut every row of ``mb`` at the token positions ``bounds`` (``0 = x_0 < x_1 < ... < x_k = T``)
    into ``k`` token slices (TeraPipe): slice ``j`` holds columns ``[x_{j-1}, x_j)``, keeps the rows'
    position ids (so positions continue where the previous slice stopped) and targets, and attends to
    the earlier columns through the keys/values its previous slices leave on each stage. The slices'
    loss tokens add up to ``mb``'s, so a step's loss normaliser does not change.
    """
    bounds = [int(x) for x in bounds]
    t = mb.shape[1]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != t or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"slice bounds must rise strictly from 0 to the row length {t}, got {bounds}")
    return [
        CausalMicroBatch(
            mb.input_ids[:, lo:hi].contiguous(),
            mb.target_ids[:, lo:hi].contiguous(),
            mb.position_ids[:, lo:hi].contiguous(),
            mb.segment_ids[:, lo:hi].contiguous(),
            mb.sample_ids,
        )
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
