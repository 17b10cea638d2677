"""A global batch's micro-batches as the batchers group them, before any tensor: rows of sample indices
(:class:`RowGroup`), or the same in flat arrays (:class:`FlatGroups`: sample ids, row and micro-batch bounds) that
numpy and numba passes read without a Python object per row."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from dynabatch.core.sequence import is_seq2seq


@dataclass(frozen=True)
class RowGroup:
    """One micro-batch as rows of sample indices, with fixed row lengths (packing) or ``None``."""

    rows: tuple[tuple[int, ...], ...]
    encoder_len: int | None = None
    """Fixed encoder row length (T5) or sequence row length (GPT); ``None`` pads to the longest row."""
    decoder_len: int | None = None
    """Fixed decoder row length (T5 only)."""


@dataclass(frozen=True, eq=False)
class FlatGroups:
    """Micro-batches as three flat int64 arrays instead of a :class:`RowGroup` (and a tuple) per micro-batch and row:
    what every batcher groups into (:meth:`Batcher.flat_group`) and what the planner's candidates price without
    building Python objects per sample (:mod:`dynabatch.plan.candidates`).

    ``ids`` holds the sample indices row after row, micro-batch after micro-batch; row ``r`` is
    ``ids[row_bounds[r]:row_bounds[r + 1]]`` and micro-batch ``m`` the rows ``group_bounds[m]`` up to
    ``group_bounds[m + 1]`` (both bounds start at 0 and end at the total). Fixed row lengths (packing) hold for every
    micro-batch, as in :class:`RowGroup`."""

    ids: np.ndarray
    row_bounds: np.ndarray
    """(R + 1,) where each row starts in :attr:`ids`, then the end."""
    group_bounds: np.ndarray
    """(G + 1,) where each micro-batch starts among the rows, then the number of rows."""
    encoder_len: int | None = None
    decoder_len: int | None = None

    @classmethod
    def single_rows(cls, order, group_bounds) -> "FlatGroups":
        """Samples in ``order``, one per row, the rows cut into micro-batches at ``group_bounds``."""
        order = np.asarray(order, dtype=np.int64)
        return cls(order, np.arange(order.size + 1, dtype=np.int64), np.asarray(group_bounds, dtype=np.int64))

    @classmethod
    def chunked_rows(cls, ids, row_bounds, size: int, encoder_len: int | None = None,
                     decoder_len: int | None = None) -> "FlatGroups":
        """Rows (``ids``, ``row_bounds``) taken ``size`` at a time, in order (the last micro-batch may hold fewer)."""
        num_rows = len(row_bounds) - 1
        starts = np.arange(0, num_rows + size, size, dtype=np.int64)  # the last one the first at or past the end
        return cls(ids, row_bounds, np.minimum(starts, num_rows), encoder_len, decoder_len)

    @classmethod
    def of(cls, groups: Iterable[Sequence[Sequence[int]]]) -> "FlatGroups":
        """Micro-batches given as rows of sample indices (``RowGroup.rows``), without fixed row lengths."""
        groups = list(groups)
        rows = list(chain.from_iterable(groups))
        row_sizes = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        ids = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(row_sizes.sum()))
        group_rows = np.fromiter(map(len, groups), dtype=np.int64, count=len(groups))
        return cls(ids, bounds(row_sizes), bounds(group_rows))

    @classmethod
    def concatenated(cls, parts: Sequence["FlatGroups"]) -> "FlatGroups":
        """The micro-batches of ``parts``, one after another (their rows; fixed row lengths are not kept)."""
        if not parts:
            return cls.of([])
        ids = np.concatenate([p.ids for p in parts])
        return cls(ids, joined_bounds([p.row_bounds for p in parts]), joined_bounds([p.group_bounds for p in parts]))

    def __len__(self) -> int:
        return len(self.group_bounds) - 1

    def rows_key(self) -> tuple[bytes, bytes, bytes]:
        """Equal for two groupings exactly when their micro-batches hold the same rows of the same samples in the same
        order (what ``tuple(g.rows for g in groups)`` compares; fixed row lengths aside)."""
        return self.ids.tobytes(), self.row_bounds.tobytes(), self.group_bounds.tobytes()

    def row_groups(self) -> list[RowGroup]:
        """One :class:`RowGroup` per micro-batch, its rows as tuples of sample indices."""
        ids = self.ids.tolist()
        if len(ids) == len(self.row_bounds) - 1 and bool((np.diff(self.row_bounds) == 1).all()):
            rows = [(i,) for i in ids]  # one sample per row (the common case)
        else:
            b = self.row_bounds.tolist()
            rows = [tuple(ids[lo:hi]) for lo, hi in zip(b[:-1], b[1:])]
        g = self.group_bounds.tolist()
        return [RowGroup(tuple(rows[lo:hi]), self.encoder_len, self.decoder_len) for lo, hi in zip(g[:-1], g[1:])]

    def shapes(self, input_lens, target_lens, family: str) -> np.ndarray:
        """(G, 3) int64 computed shapes ``(rows, E, D)``, as :func:`group_shape` gives each micro-batch: its longest
        row's summed lengths (GPT: ``E`` the sequence, ``D`` 0) unless the row lengths are fixed. Every row's
        lengths are summed and each micro-batch's maximum taken in one numba pass (``_kernels._longest_rows``)."""
        t5 = is_seq2seq(family)
        out = np.zeros((len(self), 3), dtype=np.int64)
        out[:, 0] = self.group_bounds[1:] - self.group_bounds[:-1]
        if not len(self):
            return out
        e, d = lengths_of(input_lens, target_lens, t5)
        longest = data_kernels()._longest_rows(e, d, self.ids, self.row_bounds, self.group_bounds)
        out[:, 1] = self.encoder_len or longest[:, 0]
        out[:, 2] = (self.decoder_len if t5 else None) or longest[:, 1]
        return out


def bounds(sizes: np.ndarray) -> np.ndarray:
    """``(0, cumulative sizes...)``: where each of consecutive parts of ``sizes`` starts, then the end."""
    out = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def joined_bounds(parts: Sequence[np.ndarray]) -> np.ndarray:
    """The bounds of consecutive parts given each by its own bounds (int64, from 0 to its total), as one array from 0
    to the sum of the totals: each part's bounds after its first shifted by the totals of the parts before it (its
    first is the end of the part before). One numba pass over the parts' bounds laid side by side
    (``_kernels._joined_bounds``)."""
    sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    return data_kernels()._joined_bounds(np.concatenate(parts), sizes)


def data_kernels():
    """:mod:`dynabatch.data._kernels`, imported on first use."""
    from dynabatch.data import _kernels as kernels  # lazy: keeps numba out of --help

    return kernels


def lengths_of(input_lens, target_lens, t5: bool) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(e, d)`` of a batch's samples as the batchers count them: T5 inputs and targets, GPT one sequence of
    both (``d`` 0)."""
    e, d = np.asarray(input_lens, dtype=np.int64), np.asarray(target_lens, dtype=np.int64)
    return (e, d) if t5 else (e + d, np.zeros_like(d))
