"""Inside a planned micro-batch: pack short samples into shared rows, and order micro-batches for 1F1B.

**Rows for the padding-free planner** (:func:`pack_units`, what ``plan_step(pack_rows="auto")`` uses).
With padding-free attention a row holding samples of lengths ``L_k`` pays attention only on each
sample's own block, ``sum L_k^2`` score pairs (:mod:`dynabatch.cost.pairs`), so packing short samples
into long rows no longer costs the row's ``T^2``: it removes their padding (and their rows) at the
price of coarser micro-batches. :func:`pack_units` fills rows of a given capacity best-first-fit
decreasing (``dynabatch.data._kernels._best_fit_rows``) and returns them as *units*: pseudo-samples with the rows'
summed lengths and summed attention pairs, which the partition DP then cuts into micro-batches with
per-segment pricing (``plan_partition(unit_pairs=...)``). :func:`apply_row_packing` below is the older,
dense-priced pass inside already planned micro-batches.

**Row packing.** A micro-batch of ``b`` samples is padded to ``(E, D)``, its longest input and target
(GPT: one sequence, ``E`` = longest input + target, ``D = 0``). Packing puts several samples in one row,
with positions restarting and attention confined to each sample (block-diagonal masks; see
``dynabatch.data.baselines.Packing`` and ``dynabatch.data.collate``), as long as the row still fits
``(E, D)``: for T5 the inputs share the encoder row and the targets the decoder row, and a sample joins
a row only if both fit (seqio-style). Rows are filled first-fit-decreasing (largest ``e / E + d / D``
first, ties by index). The row length never grows, so with dense attention every row costs what a padded
row costs and ``num_rows < b`` rows are cheaper; the cost model is still asked about both shapes,
``(b, E, D)`` and ``(num_rows, E, D)``, and packing is kept only when it is strictly cheaper.

**Fill/drain order.** 1F1B runs micro-batches through the pipeline in one order. The first ones fill it
(stage ``s`` idles until micro-batch 0 has crossed stages ``0 .. s - 1``) and the last ones drain it, and
in the steady state a stage stalls whenever a neighbour's micro-batch is much longer than its own.
:func:`order_for_fill_drain` sorts by time and deals the sorted micro-batches alternately to the front
and the back: the smallest fill and drain, the largest sit in the middle, neighbours are alike.

Measured, packing (N = 1024 FLAN-like samples from ``scripts/bench_planner.py``'s ``sample_lengths``,
polynomial cost model, S = 4, mean of 5 batches). After the partition DP there is little to pack: its
micro-batches are runs of similar lengths (padding efficiency 96.5% T5, 98.9% GPT), so two samples
rarely fit one row of the run's own ``(E, D)``. With the default 0.5 ms per-micro-batch overhead 0.3%
(T5) / 0.7% (GPT) of micro-batches pack and the objective drops 0.01%; with 5 ms overhead (longer, more
mixed runs) 2.5% / 1.6% pack and it drops 0.19% / 0.13%. A packing-aware DP (runs priced at
``min(padded, packed)`` with the optimistic row count ``ceil(sum / E)``, same run band) would gain
1.6-1.7% (T5) / 0.5% (GPT) over the padded DP. Packing pays on mixed micro-batches: 8 samples per
micro-batch in stream order cut the summed predicted time by 45% (T5) / 53% (GPT), 32 per micro-batch by
69% / 71% (memory limits not applied; still 1.3-1.6x the DP's objective). :func:`apply_row_packing` takes 1.5-3 ms at N = 1024 (first-fit only where the two shortest
samples fit one row; one cost-model call for the whole plan).

Measured, fill/drain order (1F1B simulated op by op, the ``simulate_1f1b`` helper of
``tests/unit/plan/test_plan_rowpack.py``: forward 1/3 and backward 2/3 of each bottleneck time on every stage,
no communication; same batches; makespan over the DP's formula ``sum(t) + (S - 1) max(t)``)::

    family  S  plans                M    planner order  ascending  descending  fill/drain
    t5      4  one pipeline         183  1.160          0.994      0.994       0.987
    t5      4  each of R = 4         60  1.116          0.986      0.984       0.969
    t5      8  one pipeline (32G)   221  1.171          0.990      0.990       0.978
    t5      8  each of R = 4 (32G)   61  1.150          0.970      0.966       0.938
    gpt2    4  one pipeline         108  1.053          0.993      0.993       0.985
    gpt2    4  each of R = 4         50  1.051          0.990      0.989       0.976
    gpt2    8  one pipeline (32G)   165  1.049          0.991      0.991       0.982
    gpt2    8  each of R = 4 (32G)   53  1.086          0.979      0.976       0.949

In the planner's order (along the sample ordering, so T5's Hilbert curve makes neighbours' times jump)
1F1B overshoots the formula by 5-17%; the fill/drain order runs 13-18% (T5) / 6-13% (GPT) faster than
that and stays below the formula, which is then a safe upper bound. On 300 random lognormal time
vectors (M 2-40, S 2/4/8) it was never above the formula (worst 0.98 of it), beat or tied the given
order in 296 and plain ascending in 281 (worst 2.4% / 5% behind them). This is a model without
communication or per-stage differences; the schedule simulator is the judge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynabatch.cost.pairs import sample_pairs
from dynabatch.data.baselines import RowGroup
from dynabatch.data._kernels import _best_fit_rows
from dynabatch.plan.costs import MicroBatchCostModel, evaluate_costs
from dynabatch.plan.order import check_lengths, padded_lengths
from dynabatch.plan.partition import PartitionPlan
from dynabatch.sequence import is_seq2seq


@dataclass(frozen=True)
class RowPacking:
    """How one micro-batch's samples fill its rows."""

    rows: tuple[tuple[int, ...], ...]
    """Sample indices per row; one sample per row when packing was not chosen."""
    shape: tuple[int, int, int]
    """Chosen shape ``(num_rows, E, D)``; ``E, D`` are the micro-batch's longest input and target."""
    time_s: float
    """Predicted bottleneck-stage time of the chosen shape."""
    padded_time_s: float
    """Predicted time with one sample per row, ``(b, E, D)``."""
    packed: bool
    """Whether several samples share a row (the packed shape was strictly cheaper)."""
    packed_num_rows: int
    """Rows first-fit-decreasing needs, whether or not packing was chosen."""


@dataclass(frozen=True, eq=False)
class RowPackedPlan:
    """A :class:`PartitionPlan` whose micro-batches may pack several samples per row."""

    family: str
    """``t5`` or ``gpt2``."""
    num_stages: int
    """Pipeline stages ``S`` in the objective."""
    packings: tuple[RowPacking, ...]
    """Per micro-batch, in the plan's order."""
    shapes: np.ndarray
    """(M, 3) int64 chosen ``(num_rows, E, D)``."""
    times_s: np.ndarray
    """(M,) float64 predicted time of each micro-batch as packed."""
    objective_s: float
    """``sum(times_s) + (S - 1) max(times_s)``; the padded plan's is ``padded_objective_s``."""
    padded_objective_s: float
    """The objective of the plan before packing."""

    @property
    def fraction_packed(self) -> float:
        """Share of micro-batches that pack at least two samples into one row."""
        return sum(p.packed for p in self.packings) / len(self.packings)

    def to_row_groups(self) -> list[RowGroup]:
        """One :class:`RowGroup` per micro-batch with fixed row lengths ``(E, D)`` (GPT: ``E``)."""
        return [
            RowGroup(rows=p.rows, encoder_len=p.shape[1], decoder_len=p.shape[2] if is_seq2seq(self.family) else None)
            for p in self.packings
        ]


def pack_rows(input_lens, target_lens, sample_ids, cost_model: MicroBatchCostModel, *, family: str) -> RowPacking:
    """Pack the samples ``sample_ids`` (indices into the length arrays) of one micro-batch into rows that
    fit its padded ``(E, D)``, first-fit-decreasing; keep packing only if the cost model says it is cheaper."""
    e_raw, d_raw = check_lengths(input_lens, target_lens)
    e_all, d_all = padded_lengths(e_raw, d_raw, family)
    ids = np.asarray(sample_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"sample_ids must be a non-empty 1-D integer array, got shape {ids.shape} dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= e_raw.size:
        raise ValueError(f"sample_ids must lie in [0, {e_raw.size}), got min {ids.min()} max {ids.max()}")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"sample_ids must be distinct, got {ids.size - np.unique(ids).size} repeat(s)")
    return _pack_all(e_all, d_all, [ids.astype(np.int64)], cost_model)[0]


def apply_row_packing(plan: PartitionPlan, input_lens, target_lens, cost_model: MicroBatchCostModel) -> RowPackedPlan:
    """Row-pack every micro-batch of ``plan`` (lengths and cost model as given to :func:`plan_partition`)."""
    e_raw, d_raw = check_lengths(input_lens, target_lens)
    if e_raw.size != plan.order.size:
        raise ValueError(f"plan covers {plan.order.size} samples but {e_raw.size} lengths were given")
    e_all, d_all = padded_lengths(e_raw, d_raw, plan.family)
    groups = [plan.order[lo:hi] for lo, hi in zip(plan.boundaries[:-1], plan.boundaries[1:])]
    packings = tuple(_pack_all(e_all, d_all, groups, cost_model))
    shapes = np.array([p.shape for p in packings], dtype=np.int64)  # (M, 3)
    times = np.array([p.time_s for p in packings], dtype=np.float64)
    objective = float(np.cumsum(times)[-1] + (plan.num_stages - 1) * times.max())
    return RowPackedPlan(plan.family, plan.num_stages, packings, shapes, times, objective, plan.objective_s)


@dataclass(frozen=True)
class PackedUnits:
    """Samples packed into rows, each row a unit for the partition DP."""

    rows: tuple[tuple[int, ...], ...]
    """Sample indices of each row (unit), longest sample first."""
    input_lens: np.ndarray
    """(U,) int64 summed input lengths per row (decoder-only: inputs + targets)."""
    target_lens: np.ndarray
    """(U,) int64 summed target lengths per row (decoder-only: 0)."""
    pairs: np.ndarray
    """(U, 3) float64 attention pairs of each row: encoder (or causal) self, decoder self, cross."""


def pack_units(input_lens, target_lens, family: str, capacity: tuple[int, int]) -> PackedUnits:
    """Rows of at most ``capacity = (E, D)`` tokens (decoder-only: ``(L, 0)``, one sequence of inputs +
    targets), filled best-fit-decreasing by the normalised size ``e / E + d / D``; a sample over the
    capacity gets a row of its own. Deterministic (ties by sample index)."""
    e_raw, d_raw = check_lengths(input_lens, target_lens)
    e, d = padded_lengths(e_raw, d_raw, family)
    cap_e, cap_d = int(capacity[0]), (int(capacity[1]) if is_seq2seq(family) else 0)
    if cap_e < 1 or (is_seq2seq(family) and cap_d < 1):
        raise ValueError(f"row capacity must be >= 1 token per side, got {capacity}")
    size = e / cap_e + (d / cap_d if cap_d else 0.0)
    order = np.lexsort((np.arange(e.size), -size)).astype(np.int64)
    row = _best_fit_rows(e, d, order, cap_e, cap_d)
    num = int(row.max()) + 1
    members = [[] for _ in range(num)]
    for i in order.tolist():
        members[row[i]].append(i)
    per_sample = sample_pairs(e_raw, d_raw, family)  # (N, 3)
    pairs = np.zeros((num, 3))
    np.add.at(pairs, row, per_sample)
    unit_e = np.bincount(row, weights=e, minlength=num).astype(np.int64)
    unit_d = np.bincount(row, weights=d, minlength=num).astype(np.int64)
    if not is_seq2seq(family):  # the DP's padded_lengths adds targets to inputs: keep the sum in inputs
        unit_d = np.zeros_like(unit_e)
    return PackedUnits(tuple(tuple(m) for m in members), unit_e, unit_d, pairs)


def order_for_fill_drain(times_s) -> np.ndarray:
    """Run order for 1F1B: sorted by time (ties by index), dealt alternately to the front and the back, so
    the smallest micro-batches fill and drain the pipeline and the largest run in the middle. (M,) int64."""
    times = np.asarray(times_s, dtype=np.float64)
    if times.ndim != 1 or not np.isfinite(times).all():
        raise ValueError(f"times_s must be a 1-D array of finite times, got shape {times.shape}")
    ascending = np.lexsort((np.arange(times.size), times))
    m = times.size
    out = np.empty(m, dtype=np.int64)
    out[: (m + 1) // 2] = ascending[0::2]  # smallest, 3rd, 5th, ... from the front
    out[(m + 1) // 2 :] = ascending[1::2][::-1]  # ..., 4th, 2nd smallest at the back
    return out


def _pack_all(e_all, d_all, groups: list[np.ndarray], cost_model) -> list[RowPacking]:
    """Pack each group of sample indices; one cost-model call prices every padded and packed shape."""
    caps = np.array([[e_all[g].max(), d_all[g].max()] for g in groups], dtype=np.int64)  # (M, 2)
    rows = [_first_fit_decreasing(e_all[g], d_all[g], int(ce), int(cd)) for g, (ce, cd) in zip(groups, caps)]
    b = np.array([g.size for g in groups] + [len(r) for r in rows], dtype=np.int64)  # (2M,) padded, packed
    t, _, _ = evaluate_costs(cost_model, b, np.tile(caps[:, 0], 2), np.tile(caps[:, 1], 2))
    m = len(groups)
    out = []
    for k, (g, row_list) in enumerate(zip(groups, rows)):
        padded_t, packed_t = float(t[k]), float(t[m + k])
        packed = len(row_list) < g.size and packed_t < padded_t
        ids = g.tolist()
        chosen = tuple(tuple(ids[j] for j in r) for r in row_list) if packed else tuple((i,) for i in ids)
        out.append(
            RowPacking(
                rows=chosen,
                shape=(len(chosen), int(caps[k, 0]), int(caps[k, 1])),
                time_s=packed_t if packed else padded_t,
                padded_time_s=padded_t,
                packed=packed,
                packed_num_rows=len(row_list),
            )
        )
    return out


def _first_fit_decreasing(e, d, cap_e: int, cap_d: int) -> list[list[int]]:
    """Rows of positions into ``e, d``: largest normalised size ``e / E + d / D`` first, each into the
    first row where both lengths still fit. One row per sample if no two samples fit together."""
    if e.size < 2 or np.partition(e, 1)[:2].sum() > cap_e or np.partition(d, 1)[:2].sum() > cap_d:
        return [[k] for k in range(e.size)]  # fast path: the two shortest do not share a row
    size = e / max(cap_e, 1) + d / max(cap_d, 1)
    rows: list[list[int]] = []
    free_e: list[int] = []
    free_d: list[int] = []
    for k in np.lexsort((np.arange(e.size), -size)).tolist():
        ek, dk = int(e[k]), int(d[k])
        for r in range(len(rows)):
            if ek <= free_e[r] and dk <= free_d[r]:
                rows[r].append(k)
                free_e[r] -= ek
                free_d[r] -= dk
                break
        else:
            rows.append([k])
            free_e.append(cap_e - ek)
            free_d.append(cap_d - dk)
    return rows
