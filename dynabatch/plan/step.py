"""One step's whole plan: token slicing for long decoder-only samples, the partition DP for the
rest, and the split over data-parallel replicas.

``plan_step`` is what the trainer calls for every global batch:

1. Decoder-only models with a slice cost model: :func:`~dynabatch.plan.slicing.slice_long_samples`
   picks the samples that do not fit in memory whole, or whose single-sample time would dominate
   the pipeline bubble, and plans their token slices (TeraPipe). A sliced sample becomes a chain of
   *pieces* ``(sample, token range)`` that must run in order on one pipeline. Samples sliced for the
   bubble alone stay sliced only if the whole step scores better that way (``score``: the predicted
   step time; with many micro-batches per step the bubble is already small and slices add overhead).
2. The remaining samples are cut into micro-batches by the partition DP, split over replicas
   (:func:`~dynabatch.plan.replicas.plan_replicas`; ``R = 1`` is plain ``plan_partition``).
3. Each sliced sample goes, whole, to the replica with the smallest predicted time (longest first).
   Every replica's micro-batches are finally put in fill/drain order (small ones at the ends).

The result lists, per replica, :class:`Piece` objects: a micro-batch of whole samples, or one token
slice of one sample, with its padded shape and predicted bottleneck-stage time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dynabatch.plan.costs import MicroBatchCostModel
from dynabatch.plan.order import check_lengths
from dynabatch.plan.replicas import plan_replicas
from dynabatch.plan.rowpack import order_for_fill_drain
from dynabatch.plan.slicing import SliceCostModel, slice_long_samples
from dynabatch.sequence import is_seq2seq


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

    @property
    def is_slice(self) -> bool:
        return self.token_range is not None


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
        """One :class:`~dynabatch.data.baselines.RowGroup` per piece of ``replica``, one sample per row,
        padded to the planned shape (slices keep their token length as the row length)."""
        from dynabatch.data.baselines import RowGroup  # imports torch (collate); the planner itself does not

        t5 = is_seq2seq(self.family)
        return [
            RowGroup(tuple((i,) for i in p.sample_ids), p.shape[1], p.shape[2] if t5 else None)
            for p in self.replicas[replica]
        ]

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


def plan_step(
    input_lens,
    target_lens,
    cost_model: MicroBatchCostModel,
    num_stages: int,
    *,
    family: str,
    num_replicas: int = 1,
    slice_cost_model: SliceCostModel | None = None,
    slice_granularity: int = 16,
    bubble_fraction: float = 0.1,
    fill_drain_order: bool = True,
    score: Callable[[StepPlan], float] | None = None,
    **partition_options,
) -> StepPlan:
    """Plan one global batch end to end (see the module docstring). ``score(plan)`` (lower is better;
    default :attr:`StepPlan.objective_s`) decides whether slicing for the bubble pays off; the trainer
    passes the simulated step time (:func:`dynabatch.runtime.planner.simulated_step_time`)."""
    e, d = check_lengths(input_lens, target_lens)
    n = len(e)
    if num_replicas < 1 or n < num_replicas:
        raise ValueError(f"need 1 <= num_replicas <= number of samples, got {num_replicas} replicas for {n} samples")
    if slice_cost_model is None:
        return _plan(e, d, [], cost_model, num_stages, family, num_replicas, fill_drain_order, partition_options)
    if is_seq2seq(family):
        raise ValueError(f"token slicing needs a decoder-only (causal) model, got {family!r}")
    decision = slice_long_samples(
        e + d, slice_cost_model, num_stages, bubble_fraction=bubble_fraction, granularity=slice_granularity,
        in_flight=partition_options.get("in_flight") or num_stages,
    )
    sliced = [
        (i, [Piece((i,), (1, hi - lo, 0), float(t), (lo, hi)) for lo, hi, t in zip(b[:-1], b[1:], plan.times_s)], why)
        for i, plan, why in zip(decision.sample_indices.tolist(), decision.plans, decision.reasons)
        for b in [plan.boundaries.tolist()]
    ]
    best = _plan(e, d, sliced, cost_model, num_stages, family, num_replicas, fill_drain_order, partition_options)
    # Which samples must run sliced is the partition's own memory test (the slice model prices one stage).
    in_flight = partition_options.get("in_flight") or num_stages
    lens = (e + d)[[i for i, _, _ in sliced]].astype(np.float64)
    _, stored, peak = cost_model.evaluate(np.ones_like(lens), lens, np.zeros_like(lens))
    whole_fits = in_flight * np.asarray(stored) + np.asarray(peak) <= float(cost_model.memory_budget_bytes)
    forced = [x for x, fits in zip(sliced, whole_fits) if not fits]
    if len(forced) < len(sliced):  # slicing for the bubble alone must pay off for the whole step
        fewer = _plan(e, d, forced, cost_model, num_stages, family, num_replicas, fill_drain_order, partition_options)
        score = score or (lambda plan: plan.objective_s)
        if score(fewer) <= score(best):
            best = fewer
    return best


def _plan(e, d, sliced, cost_model, num_stages, family, num_replicas, fill_drain_order, partition_options) -> StepPlan:
    """The step's plan with the samples of ``sliced`` (``(index, pieces, reason)``) run as slices."""
    keep = np.setdiff1d(np.arange(len(e)), [i for i, _, _ in sliced])
    replica_pieces: list[list[Piece]] = [[] for _ in range(num_replicas)]
    if len(keep):
        # Fewer unsliced samples than replicas (every sample long): the DP fills as many replicas as it can,
        # the sliced samples below go to the empty ones first (their predicted time is 0).
        rp = plan_replicas(e[keep], d[keep], cost_model, num_stages, min(num_replicas, len(keep)), family=family,
                           **partition_options)
        for r, part in enumerate(rp.replicas):
            for ids, shape, t in zip(part.micro_batches, part.shapes.tolist(), part.times_s.tolist()):
                replica_pieces[r].append(Piece(tuple(int(keep[i]) for i in ids), tuple(shape), float(t)))
    # Sliced samples: longest first, whole, to the replica with the smallest predicted time.
    for i, pieces, _ in sorted(sliced, key=lambda x: (-sum(p.time_s for p in x[1]), x[0])):
        loads = [_time([p.time_s for p in rp_], num_stages) for rp_ in replica_pieces]
        replica_pieces[int(np.argmin(loads))].extend(pieces)
    if fill_drain_order:
        replica_pieces = [_fill_drain(pieces) for pieces in replica_pieces]
    return StepPlan(family, num_stages, tuple(tuple(p) for p in replica_pieces), tuple(i for i, _, _ in sliced))


def _time(times: list[float], num_stages: int) -> float:
    return sum(times) + (num_stages - 1) * max(times) if times else 0.0


def _fill_drain(pieces: list[Piece]) -> list[Piece]:
    """Fill/drain order over whole micro-batches; a sliced sample's slices stay consecutive and in order."""
    units: list[list[Piece]] = []
    for p in pieces:
        if p.is_slice and units and units[-1][0].is_slice and units[-1][0].sample_ids == p.sample_ids:
            units[-1].append(p)
        else:
            units.append([p])
    order = order_for_fill_drain(np.array([sum(p.time_s for p in u) for u in units]))
    return [p for k in order.tolist() for p in units[k]]
