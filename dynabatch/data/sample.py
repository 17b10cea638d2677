"""Tokenized samples and global batches: what the data pipeline hands to batchers and planners."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TokenizedSample:
    """One tokenized ``{task, inputs, targets}`` example.

    ``input_ids`` end with EOS for encoder-decoder models; ``target_ids`` always end with EOS.
    For decoder-only models the sequence is ``input_ids + target_ids``.
    """

    task: str
    input_ids: np.ndarray
    """int32 token ids of the inputs."""
    target_ids: np.ndarray
    """int32 token ids of the targets."""
    source_index: int = -1
    """Index of the mixture source the sample came from."""
    row_index: int = -1
    """Row of the sample in its source (for error messages and exactly-once checks)."""

    @property
    def input_len(self) -> int:
        return len(self.input_ids)

    @property
    def target_len(self) -> int:
        return len(self.target_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) + len(self.target_ids)


@dataclass(frozen=True)
class GlobalBatch:
    """The samples of one optimizer step, chosen by a token budget."""

    step: int
    """0-based step index of this batch in the stream."""
    samples: tuple[TokenizedSample, ...]
    num_truncated: int = 0
    """Samples of this batch that were truncated to the length limits."""
    num_dropped: int = 0
    """Over-long samples skipped while forming this batch (policy ``drop``)."""
    input_lens: np.ndarray = field(init=False, repr=False)
    """(N,) int64 input lengths, for planners."""
    target_lens: np.ndarray = field(init=False, repr=False)
    """(N,) int64 target lengths, for planners."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_lens", np.array([s.input_len for s in self.samples], dtype=np.int64))
        object.__setattr__(self, "target_lens", np.array([s.target_len for s in self.samples], dtype=np.int64))

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        """Real tokens (inputs + targets) in the batch."""
        return int(self.input_lens.sum() + self.target_lens.sum())

    def rows(self) -> BatchRows:
        """The batch as the rows it was drawn from, without its tokens (:class:`BatchRows`)."""
        ids = np.array([(s.source_index, s.row_index) for s in self.samples], dtype=np.int64).reshape(-1, 2)
        return BatchRows(self.step, ids, self.num_truncated, self.num_dropped)


@dataclass(frozen=True)
class BatchRows:
    """A :class:`GlobalBatch` by reference: which ``(source, row)`` of the mixture each sample is, in order, and
    the batch's counts, but no token ids. A process that holds the same tokenized data rebuilds the batch from it
    (:meth:`dynabatch.data.batching.GlobalBatcher.resolve`): what the planner process sends back instead of the
    samples (nothing tokenized crosses the process boundary per step)."""

    step: int
    ids: np.ndarray
    """(N, 2) int64: the source index and row index of every sample."""
    num_truncated: int = 0
    num_dropped: int = 0

    def __len__(self) -> int:
        return len(self.ids)
