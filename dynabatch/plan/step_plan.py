"""What the planner decides for one global batch: per replica, its pieces of pipeline work in execution order
(:class:`StepPlan`, made by :func:`~dynabatch.plan.step.plan_step` and the baselines' planners), each a micro-batch
of whole samples or one token slice of a sample (:class:`Piece`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynabatch.core.sequence import is_seq2seq
from dynabatch.cost.pairs import AttentionPairs
from dynabatch.data.baselines import RowGroup


@dataclass(frozen=True)
class Piece:
    """A unit of pipeline work: whole samples padded together, or one token slice of one sample."""

    sample_ids: tuple[int, ...]
    """Global-batch indices of the samples (one for a slice)."""
    shape: tuple[int, int, int]
    """Padded ``(b, E, D)``; for a slice ``(1, slice length, 0)``."""
    time_s: float
    """Predicted bottleneck-stage forward + backward time."""
    token_range: tuple[int, int] | None = None
    """For a slice: tokens ``[start, end)`` of the sample (``start`` is its context length)."""
    rows: tuple[tuple[int, ...], ...] | None = None
    """Samples of each row when rows hold several (row packing); ``None``: one sample per row."""
    pairs: tuple[float, float, float] | None = None
    """Attention pairs (encoder, decoder, cross) the piece was priced with; ``None``: dense ``b x E^2``."""
    calls: tuple[int, int, int] | None = None
    """Attention-core calls per layer (encoder, decoder, cross): distinct sample lengths among the piece's
    samples (:func:`~dynabatch.cost.pairs.row_calls`); with :attr:`pairs`."""
    longest: tuple[int, int] | None = None
    """Longest input and target segment (T5's bias window) when a row holds several samples; ``None``: the
    shape's ``E, D``."""

    @property
    def is_slice(self) -> bool:
        return self.token_range is not None

    @property
    def row_samples(self) -> tuple[tuple[int, ...], ...]:
        """Samples of each row: :attr:`rows`, or one sample per row."""
        return self.rows if self.rows is not None else tuple((i,) for i in self.sample_ids)


@dataclass(frozen=True)
class StepPlan:
    """Per replica, the pieces of one global batch in execution order."""

    family: str
    num_stages: int
    replicas: tuple[tuple[Piece, ...], ...]
    sliced_samples: tuple[int, ...]
    """Samples that run token-sliced."""

    @property
    def times_s(self) -> np.ndarray:
        """Predicted step time of each replica: ``sum(t) + (S - 1) max(t)``."""
        out = []
        for pieces in self.replicas:
            t = np.array([p.time_s for p in pieces]) if pieces else np.zeros(1)
            out.append(t.sum() + (self.num_stages - 1) * t.max())
        return np.array(out)

    @property
    def objective_s(self) -> float:
        return float(self.times_s.max())

    def to_row_groups(self, replica: int) -> list:
        """One :class:`~dynabatch.data.baselines.RowGroup` per piece of ``replica``, its rows as planned (one
        sample per row, or several when packed), padded to the planned shape (slices keep their token
        length as the row length)."""

        t5 = is_seq2seq(self.family)
        return [RowGroup(p.row_samples, p.shape[1], p.shape[2] if t5 else None) for p in self.replicas[replica]]

    def pairs(self, replica: int):
        """(M,) :class:`~dynabatch.cost.pairs.AttentionPairs` of ``replica``'s pieces as priced (dense
        ``b x E^2`` for a piece without pairs), or ``None`` when every piece was priced dense."""

        pieces = self.replicas[replica]
        if all(p.pairs is None for p in pieces):
            return None
        rows = [p.pairs if p.pairs is not None else _dense_pairs(p.shape) for p in pieces]
        calls = [p.calls if p.calls is not None else (1, 1, 1) for p in pieces]
        values = np.array(rows, dtype=np.float64).reshape(-1, 3)
        counts = np.array(calls, dtype=np.float64).reshape(-1, 3)
        longest = np.array([p.longest or p.shape[1:] for p in pieces], dtype=np.float64).reshape(-1, 2)
        return AttentionPairs(values[:, 0], values[:, 1], values[:, 2], (counts[:, 0], counts[:, 1], counts[:, 2]),
                              (longest[:, 0], longest[:, 1]))

    def slice_links(self, replica: int) -> tuple[int, ...]:
        """Token-slice links of ``replica``'s pieces (:mod:`dynabatch.schedule.chains`): each slice
        points at the previous slice of its sample; ``()`` when the replica has no slices."""
        pieces = self.replicas[replica]
        out = [
            m - 1 if p.is_slice and m > 0 and pieces[m - 1].is_slice and pieces[m - 1].sample_ids == p.sample_ids else -1
            for m, p in enumerate(pieces)
        ]
        return tuple(out) if any(x >= 0 for x in out) else ()

    def contexts(self, replica: int) -> np.ndarray:
        """(M,) tokens before each piece of ``replica`` (a slice's context length; 0 otherwise)."""
        return np.array([p.token_range[0] if p.is_slice else 0 for p in self.replicas[replica]], dtype=np.int64)

    def samples_of(self, replica: int) -> list[int]:
        return sorted({i for p in self.replicas[replica] for i in p.sample_ids})


def _dense_pairs(shape) -> tuple[float, float, float]:
    b, e, d = (float(x) for x in shape)
    return b * e * e, b * d * d, b * d * e


__all__ = ["Piece", "StepPlan"]
