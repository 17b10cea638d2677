"""Partition a global batch into variable-size micro-batches that minimise the pipeline step time.

Algorithm (DynaPipe, arXiv 2311.10418, Sec. 4). Samples are first ordered so that neighbours pad well
together (:mod:`dynabatch.plan.order`); micro-batches are contiguous runs of that order. A pipeline of
``S`` stages running ``M`` micro-batches with bottleneck-stage times ``t_1 .. t_M`` takes about

    step time = sum(t_i) + (S - 1) * max(t_i)

(every micro-batch crosses the bottleneck stage once; the slowest one also fills and drains the other
``S - 1`` stages). The objective couples a sum and a max, so the DP fixes a *cap* ``c`` on ``max(t_i)``
and minimises the sum of the runs under the cap, ``F(c)``, by ``f[k] = min_w f[k - w] + t(k - w .. k-1)``;
each path is scored with its actual max. Caps are the candidate runs' own times between the bottleneck
value (the smallest max any partition reaches) and ``(U - F(inf)) / (S - 1)`` (``U``: objective of the
unconstrained min-sum path; no larger cap can win), thinned to a relative step of ``cap_tolerance``.
Rather than trying them all in order, the kernel bisects the sorted caps best-first: ``F`` is
non-increasing, so every cap strictly between evaluated caps ``lo < hi`` scores more than
``F(hi) + (S - 1) lo``, and intervals whose bound reaches the best objective are dropped. With
``cap_tolerance = 0`` the result is optimal over contiguous partitions of the ordering (tests check it
against brute force); with ``tol > 0`` it is within ``tol * (S - 1) * max(t_i)`` of it.

Candidate runs. For every run ``(end j, length w)`` the padded shape ``(w, max E, max D)`` is computed in
numba, the cost model is called vectorised on all of them, and runs that break a limit are dropped:
``in_flight * stored + peak <= memory_budget_bytes`` (1F1B: the first stage holds the stored activations
of up to ``S`` micro-batches while running one backward; the bound is exact when the micro-batches in
flight are alike, and only approximate when a small-stored, large-peak one meets large-stored ones, so
the schedule validator checks the real memory timeline), at most ``max_samples`` samples and at most
``max_tokens`` padded tokens ``w (E + D)``. A run is kept only if all its shorter suffixes are (true
for costs non-decreasing in ``b, E, D``), so the band length per end is found by growing it for the
ends still feasible: O(log W) cost-model calls, O(sum of band lengths) shapes. A row stops growing, too, once
its runs are too slow to be in a plan better than the DP's plan on the first band (``U``: no run slower than
``U / W`` can be, ``W`` the objective's weight; :func:`_candidate_runs`), which leaves the optimum as it was and on
heavy-tailed batches prices about half the runs; once ``U`` is known, a row's next band stops a little past where
its runs cross ``U / W``, if that comes before doubling (:func:`~dynabatch.plan._kernels._next_band_ends`). Run
times are made non-decreasing in the run length, so the DP scans each band until the first run over the cap: one
cap costs O(N x runs under the cap), worst case O(N x W).

Measured (``scripts/bench_planner.py``, 2 shared CPU cores, warm, median; FLAN-like lengths, S = 4,
16 GiB budget, tolerance 0.01): N = 256 about 1 ms, N = 1024 9-10 ms (T5 and GPT; 15 ms with another
job on the cores), N = 4096 40-60 ms. 6-37 caps are tried (8-54 at tolerance 0, which adds 5-30%
time); the band W is 70-260 but plans use runs of at most 16-81 samples. Against a sorted token-budget
partition at its best budget the objective is 1% lower (GPT) and 9-10% lower for T5 (mostly ordering).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from dynabatch.plan._kernels import (_band_fits, _band_runs, _next_band_ends, _running_max_rows, _scatter_band,
                                     _solve_partition)
from dynabatch.plan.costs import MicroBatchCostModel, check_int, check_non_negative, checked_costs, evaluate_costs
from dynabatch.plan.order import check_lengths, order_padded, padded_lengths
from dynabatch.core.sequence import is_seq2seq
from dynabatch.data.baselines import RowGroup
from dynabatch.cost.pairs import AttentionPairs
from dynabatch.cost.symbolic import VARIABLES

if TYPE_CHECKING:
    from dynabatch.data.baselines import RowGroup

FIRST_BAND = 16
"""Run lengths evaluated in the first cost-model call; the band then grows while runs still fit
(:func:`~dynabatch.plan._kernels._next_band_ends`)."""
ONE_CALL_RUNS = 4096
"""Up to this many candidate runs (``N x`` the longest run allowed) are all priced in the first call: a call's
fixed cost (a tenth of a millisecond on the compiled analytic model, milliseconds on a layer model priced by its
Python methods) outweighs pricing runs that turn out not to fit.
Either way the table within the band is the same, and the DP reads nothing outside it."""
BAND_MARGIN = 0.1
"""How far past its estimated reach of the pruning bound an end's next band goes
(:func:`~dynabatch.plan._kernels._next_band_ends`)."""


@dataclass(frozen=True, eq=False)
class PartitionPlan:
    """Micro-batches of one global batch: contiguous runs of an ordering of its samples."""

    family: str
    """``t5`` or ``gpt2``: how ``(E, D)`` were formed from the lengths."""
    num_stages: int
    """Pipeline stages ``S`` in the objective."""
    in_flight: int
    """Micro-batches whose stored activations the memory bound assumed live at once."""
    order: np.ndarray
    """(N,) int64 sample indices in planner order."""
    boundaries: np.ndarray
    """(M + 1,) int64 offsets into ``order``: micro-batch ``k`` is ``order[boundaries[k]:boundaries[k + 1]]``."""
    shapes: np.ndarray
    """(M, 3) int64 padded shape ``(b, E, D)`` of each micro-batch (GPT: ``E`` = sequence length, ``D`` = 0)."""
    times_s: np.ndarray
    """(M,) float64 predicted bottleneck-stage forward + backward time of each micro-batch."""
    stored_bytes: np.ndarray
    """(M,) float64 activation bytes each micro-batch stores on the bottleneck stage."""
    peak_bytes: np.ndarray
    """(M,) float64 transient bytes while each micro-batch runs on the bottleneck stage."""
    objective_s: float
    """Predicted step time ``sum(times_s) + (num_stages - 1) * max(times_s)``."""
    num_cap_candidates_tried: int
    """Caps on the max micro-batch time for which the min-sum DP ran."""
    band_width: int
    """``W``: the longest run any end could form within the limits and the pruning bound (the DP band;
    :func:`_candidate_runs`)."""
    flat_rows: bool = False
    """Every micro-batch is one row of all its samples' real tokens (``shapes`` ``(1, sum e, sum d)``)."""

    @property
    def num_micro_batches(self) -> int:
        return len(self.times_s)

    @property
    def micro_batches(self) -> tuple[tuple[int, ...], ...]:
        """Original sample indices of each micro-batch, in planner order."""
        order = self.order.tolist()
        bounds = self.boundaries.tolist()
        return tuple(tuple(order[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:]))

    @property
    def padded_tokens(self) -> int:
        """Tokens the model computes on, padding included: ``sum b (E + D)``."""
        return int((self.shapes[:, 0] * (self.shapes[:, 1] + self.shapes[:, 2])).sum())

    def to_row_groups(self) -> list[RowGroup]:
        """One :class:`RowGroup` per micro-batch, one sample per row, padded to the planned shape."""

        groups = []
        for rows, (_, e, d) in zip(self.micro_batches, self.shapes.tolist()):
            groups.append(
                RowGroup(
                    rows=(tuple(rows),) if self.flat_rows else tuple((i,) for i in rows),
                    encoder_len=e,
                    decoder_len=d if is_seq2seq(self.family) else None,
                )
            )
        return groups


def plan_partition(
    input_lens,
    target_lens,
    cost_model: MicroBatchCostModel,
    num_stages: int,
    *,
    family: str,
    order: str = "auto",
    cap_tolerance: float = 0.01,
    max_samples: int | None = None,
    max_tokens: int | None = None,
    in_flight: int | None = None,
    unit_pairs=None,
    fill_scale: float = 1.0,
    flat_rows: bool = False,
    max_row: tuple[int, int] | None = None,
    runs_cache: dict | None = None,
    prune_fill_scale: float | None = None,
) -> PartitionPlan:
    """Order the samples and cut them into micro-batches minimising ``sum(t) + (S - 1) max(t)``.

    ``fill_scale`` weighs the fill-and-drain term: the DP minimises ``sum(t) + fill_scale (S - 1) max(t)``.
    The formula charges the *largest* micro-batch's bottleneck time to every other stage, while the
    schedule puts small micro-batches at the ends and a light stage fills faster than the bottleneck,
    so the real fill and drain cost less; :func:`~dynabatch.plan.step.plan_step` tries smaller weights
    and keeps the partition whose simulated step is shortest. ``objective_s`` stays the plain formula.

    ``in_flight`` defaults to ``num_stages`` (1F1B's first stage). ``max_samples`` also bounds the DP
    band; set it when memory allows very long runs of short samples. Raises ``ValueError`` on bad
    arguments and when a single sample alone breaks the memory budget or ``max_tokens``.

    ``unit_pairs`` ((N, 3) float, one row per "sample", which may be a packed row of several samples:
    its encoder, decoder and cross-attention score pairs, :mod:`dynabatch.cost.pairs`) prices every run
    with per-segment attention, the sum of its units' pairs, through ``cost_model.evaluate(..., pairs=)``.
    Without it (the default) runs are priced with dense ``b x E^2`` attention: an upper bound for sorted
    single-sample runs, whose rows the padding-free runtime computes only on their real lengths.

    ``flat_rows`` (needs ``unit_pairs``): every micro-batch is laid out as *one* row of its samples back to
    back, so no layer computes pad: a run is priced at ``(1, sum e, sum d)`` with its summed pairs and its
    longest segments (T5's bias window), and ``max_tokens`` bounds its real tokens. Ordering still matters
    (near-equal lengths share attention calls), padding no longer does. ``max_row`` ``(input, target)``
    tokens (flat rows only; causal: ``(tokens, 0)``) bounds each flat row like a packed row of that capacity
    (:func:`~dynabatch.plan.step.flat_row_limit`).

    ``runs_cache`` (a dict the caller owns, e.g. for the calls of one :func:`~dynabatch.plan.step.plan_step`):
    the ordering and the priced candidate runs, the cost-model calls that make up most of a call's time, are
    kept there and reused by a later call on the same lengths, pairs, limits and ``cost_model`` (only
    ``num_stages``, ``fill_scale`` and ``cap_tolerance`` may differ: they change the cut, not the runs); so is the
    plan of a cut already made. The plans are those of a call without the cache.

    Runs too slow to be in any plan better than one already found are not priced (:func:`_candidate_runs`,
    "Pruning"): the bound is taken under the fill-and-drain weight of ``prune_fill_scale`` (default
    ``fill_scale``), which must be at most the ``fill_scale`` of every call the ``runs_cache`` table serves (a call
    with a smaller one prices the table again); ``plan_step`` passes the smallest of its weights.
    """
    e_raw, d_raw = check_lengths(input_lens, target_lens)
    check_int("num_stages", num_stages)
    in_flight = num_stages if in_flight is None else in_flight
    check_int("in_flight", in_flight)
    for name, value in (("max_samples", max_samples), ("max_tokens", max_tokens)):
        if value is not None:
            check_int(name, value)
    check_non_negative("cap_tolerance", cap_tolerance)
    if flat_rows and unit_pairs is None:
        raise ValueError("flat_rows prices runs by their attention pairs: pass unit_pairs")
    if max_row is not None and not flat_rows:
        raise ValueError("max_row bounds flat rows: pass flat_rows=True")
    budget = float(cost_model.memory_budget_bytes)
    if not budget > 0:
        raise ValueError(f"cost model memory_budget_bytes must be > 0, got {budget}")

    limits = _Limits(budget, in_flight, max_samples, max_tokens, None if max_row is None else tuple(max_row))
    check_non_negative("fill_scale", fill_scale)
    weighted_stages = 1.0 + float(fill_scale) * (num_stages - 1)  # the kernel's slope is its argument - 1
    prune_scale = fill_scale if prune_fill_scale is None else min(float(prune_fill_scale), float(fill_scale))
    check_non_negative("prune_fill_scale", prune_scale)
    prune_weight = 1.0 + prune_scale * (num_stages - 1)
    key = None if runs_cache is None else _table_key(e_raw, d_raw, family, order, limits, unit_pairs, flat_rows)
    table = None if key is None else runs_cache.get(key)
    if table is None or table.cost_model is not cost_model or table.prune_weight > weighted_stages:
        table = _table(e_raw, d_raw, cost_model, family, order, limits, unit_pairs, flat_rows, prune_weight,
                       float(cap_tolerance))
        if key is not None:
            runs_cache[key] = table
    T, L = table.T, table.L
    lengths, _, num_tried = _solve_partition(T, L, weighted_stages, float(cap_tolerance))
    cut = (lengths.tobytes(), num_stages)
    if cut in table.plans:  # the same cut under another weight: only the count of caps tried differs
        kept = table.plans[cut]
        return replace(kept, num_cap_candidates_tried=int(num_tried), **{
            f: getattr(kept, f).copy() for f in ("order", "boundaries", "shapes", "times_s", "stored_bytes", "peak_bytes")})

    e, d, runs, perm = table.e, table.d, table.runs, table.perm
    boundaries = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    starts, ends = boundaries[:-1], boundaries[1:] - 1
    b, E, D, pairs = runs.priced(ends, lengths, np.maximum.reduceat(e, starts), np.maximum.reduceat(d, starts))
    shapes = np.stack([b, E, D], axis=1)
    times = T[ends, lengths - 1].copy()
    stored, peak = _run_bytes(table.bands, ends, lengths)  # as the runs were priced
    if np.isnan(stored).any() or np.isnan(peak).any():  # not expected: every run in the band was priced
        _, stored, peak = evaluate_costs(cost_model, b, E, D, pairs=pairs)
    objective = float(np.cumsum(times)[-1] + (num_stages - 1) * times.max())
    plan = PartitionPlan(
        family=family,
        num_stages=num_stages,
        in_flight=in_flight,
        order=perm,
        boundaries=boundaries,
        shapes=shapes.astype(np.int64),
        times_s=times,
        stored_bytes=stored,
        peak_bytes=peak,
        objective_s=objective,
        num_cap_candidates_tried=int(num_tried),
        band_width=int(L.max()),
        flat_rows=flat_rows,
    )
    table.plans[cut] = plan
    return plan


@dataclass(frozen=True, eq=False)
class _Table:
    """What :func:`plan_partition` computes before it cuts: the ordering, the ordered units and their priced
    candidate runs (``T``, ``L``), and the plans of the cuts made from them (by run lengths and stages)."""

    cost_model: MicroBatchCostModel
    perm: np.ndarray
    e: np.ndarray
    d: np.ndarray
    runs: _Runs
    T: np.ndarray  # noqa: N815 - the run-time table
    L: np.ndarray  # noqa: N815 - the band lengths
    bands: tuple
    """The :class:`_Band` s priced: the bytes the cost model gave each run as it priced ``T``."""
    prune_weight: float
    """The fill-and-drain weight the runs were pruned under: the table serves calls of this weight or more."""
    plans: dict = field(default_factory=dict)


def _table_key(e_raw, d_raw, family, order, limits, unit_pairs, flat_rows) -> tuple:
    pairs = None if unit_pairs is None else np.ascontiguousarray(unit_pairs, dtype=np.float64)
    return (e_raw.tobytes(), d_raw.tobytes(), family, order, limits, flat_rows,
            None if pairs is None else (pairs.shape, pairs.tobytes()))


def _table(e_raw, d_raw, cost_model, family, order, limits: _Limits, unit_pairs, flat_rows, prune_weight: float,
           tolerance: float) -> _Table:
    e_all, d_all = padded_lengths(e_raw, d_raw, family)  # e_raw, d_raw: checked by plan_partition
    perm = order_padded(e_all, d_all, family, order)
    e, d = e_all[perm], d_all[perm]
    prefix = None if unit_pairs is None else _pair_prefix(unit_pairs, perm, e_raw.size)
    runs = _Runs(e, d, prefix, flat_rows)
    bands: list = []
    T, L = _candidate_runs(runs, cost_model, limits, perm, e_raw, d_raw, bands, (prune_weight, tolerance))
    return _Table(cost_model, perm, e, d, runs, T, L, tuple(bands), prune_weight)


@dataclass(frozen=True)
class _Limits:
    budget: float
    in_flight: int
    max_samples: int | None
    max_tokens: int | None
    max_row: tuple[int, int] | None = None
    """Flat rows: at most this many input and target tokens (the run's ``E``, ``D`` as priced)."""


def _pair_prefix(unit_pairs, perm, n: int) -> np.ndarray:
    """(N + 1, 3) prefix sums of the units' attention pairs in planner order."""
    pairs = np.asarray(unit_pairs, dtype=np.float64)
    if pairs.shape != (n, 3) or not (np.isfinite(pairs).all() and (pairs >= 0).all()):
        raise ValueError(f"unit_pairs must be a finite (N, 3) array >= 0 with N = {n}, got shape {pairs.shape}")
    return np.concatenate([np.zeros((1, 3)), np.cumsum(pairs[perm], axis=0)])


def _run_pairs(prefix: np.ndarray, ends, widths, longest=None):
    """:class:`~dynabatch.cost.pairs.AttentionPairs` of runs ending at ``ends`` (inclusive) of ``widths`` units
    (``longest``: their longest input and target segments, or None)."""

    ends, widths = np.asarray(ends), np.asarray(widths)
    total = prefix[ends + 1] - prefix[np.maximum(ends + 1 - widths, 0)]  # (..., 3)
    return AttentionPairs.of_sums(total[..., 0], total[..., 1], total[..., 2], longest=longest)


@dataclass(frozen=True)
class _Runs:
    """The ordered units and how a run of them is priced: padded rows, or one flat row (``flat``)."""

    e: np.ndarray
    d: np.ndarray
    prefix: np.ndarray | None
    """:func:`_pair_prefix`, or None (dense pricing)."""
    flat: bool
    cum_e: np.ndarray = field(init=False, repr=False)
    """(N + 1,) prefix sums of ``e`` (a flat run's row length)."""
    cum_d: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cum_e", np.concatenate(([0], np.cumsum(self.e))))
        object.__setattr__(self, "cum_d", np.concatenate(([0], np.cumsum(self.d))))

    def priced(self, ends, widths, E, D):  # noqa: N803 - the padded run shapes
        """``(b, E, D, pairs)`` the cost model prices runs ending at ``ends`` of ``widths`` units with, given their
        padded lengths ``E, D``: ``(widths, E, D)``, or flat ``(1, sum e, sum d)`` with ``E, D`` the longest."""
        ends, widths = np.asarray(ends), np.asarray(widths)
        pairs = None if self.prefix is None else _run_pairs(self.prefix, ends, widths, (E, D) if self.flat else None)
        if not self.flat:
            return widths, E, D, pairs
        starts = ends + 1 - widths
        return (np.ones_like(widths), self.cum_e[ends + 1] - self.cum_e[starts],
                self.cum_d[ends + 1] - self.cum_d[starts], pairs)

    def band(self, ends, w_lo, w_hi) -> tuple[np.ndarray, np.ndarray]:
        """The runs of lengths ``w_lo[k] .. w_hi[k] - 1`` ending at ``ends[k]``, end by end (those starting at
        sample 0 or later): ``(counts, x)``, ``counts`` the runs of each end and ``x`` the inputs the cost model
        prices each run with (as :meth:`priced` gives them), one column per run, in the rows of
        :data:`~dynabatch.cost.symbolic.VARIABLES` (:func:`~dynabatch.plan._kernels._band_runs`: one pass)."""
        rows_at = _ROWS_AT.copy()
        if self.prefix is None:
            rows_at[3:] = -1
        elif not self.flat:
            rows_at[6:] = -1
        return _band_runs(self.e, self.d, self.cum_e, self.cum_d, _NO_PAIRS if self.prefix is None else self.prefix,
                          self.flat, ends, w_lo, w_hi, rows_at, len(VARIABLES))

    def price(self, cost_model, x: np.ndarray):
        """``(time, stored, peak)`` of the runs whose inputs are the columns of ``x`` (:meth:`band`): through the
        cost model's ``evaluate_variables`` where it has one of its own (the compiled analytic model: no per-call
        check of arrays this planner made, :meth:`~dynabatch.cost.stages.StageCostModel.evaluate_variables`; not one a
        wrapper forwards past its own ``evaluate``) and it applies, else its ``evaluate``."""
        b, E, D = x[_ROWS_AT[0]], x[_ROWS_AT[1]], x[_ROWS_AT[2]]
        fast = getattr(cost_model, "evaluate_variables", None)
        if getattr(fast, "__self__", None) is cost_model and self.prefix is not None:  # not a wrapper's forward
            out = fast(x, pairs=True, longest=self.flat)
            if out is not None:
                return checked_costs(out, b, E, D)
        pairs = None if self.prefix is None else AttentionPairs.of_sums(
            *(x[r] for r in _ROWS_AT[3:6]), longest=tuple(x[r] for r in _ROWS_AT[6:]) if self.flat else None)
        return _evaluate_distinct(cost_model, *(a.astype(np.int64) for a in (b, E, D)), pairs)


_NO_PAIRS = np.zeros((0, 3))
_ROWS_AT = np.array([VARIABLES.index(name) for name in ("b", "E", "D", "pairs_encoder", "pairs_decoder", "pairs_cross",
                                                        "longest_input", "longest_target")], dtype=np.int64)
"""The rows of :data:`~dynabatch.cost.symbolic.VARIABLES` a run's inputs go to, in the order
:func:`~dynabatch.plan._kernels._band_runs` writes them."""


@dataclass(frozen=True)
class _Band:
    """One cost-model call of :func:`_candidate_runs`: the runs of lengths ``w_lo[k] ..`` ending at ``ends[k]``, end
    by end (``counts[k]`` each), with their times and bytes, run by run."""

    ends: np.ndarray
    """(K,) increasing: the ends priced (alive ends, filtered in order)."""
    w_lo: np.ndarray
    """(K,) the shortest run priced of each end."""
    counts: np.ndarray
    times: np.ndarray
    stored: np.ndarray
    peak: np.ndarray


def _candidate_runs(runs: _Runs, cost_model, limits: _Limits, perm, e_raw, d_raw,
                    bands: list | None = None, prune: tuple[float, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Dense ``T`` (N, W) run times (non-decreasing along rows) and ``L`` (N,) band lengths: the runs priced, all
    within the limits; runs priced as :meth:`_Runs.priced` says. ``bands`` (a list) receives the :class:`_Band` s
    priced, with the bytes the cost model gave each run (:func:`_run_bytes`), so a cut's runs need no second call.

    Pruning (``prune``: the fill-and-drain weight ``W`` of the objective ``sum(t) + (W - 1) max(t)`` and the DP's
    cap tolerance). Any plan holding a run of time ``t`` scores at least ``W t`` (its sum is at least ``t``, its max
    at least ``t``), so once a plan scoring ``U`` is known, no run slower than ``U / W`` can be in a better one. The
    first cost-model call prices every end's shortest runs; the DP on that band gives ``U``; an end's band then
    grows only while its slowest run so far takes at most ``U / W`` (times are non-decreasing along a row, so every
    longer run is slower still). The plan scoring ``U`` stays in the table, so the DP's optimum is unchanged: on the
    heavy-tailed T5 batches of ``scripts/bench_plan_time.py`` it prices about half the runs."""
    e, d = runs.e, runs.d
    n = e.size
    max_w = min(n, limits.max_samples or n)
    band = np.zeros(n, dtype=np.int64)
    slowest = np.zeros(n)  # each end's slowest run priced so far (within its band)
    bands = [] if bands is None else bands
    alive = np.arange(n, dtype=np.int64)
    w_lo = np.ones(n, dtype=np.int64)  # the lengths each alive end prices next: w_lo .. w_hi - 1
    w_hi = np.full(n, (max_w if n * max_w <= ONE_CALL_RUNS else min(max_w, FIRST_BAND)) + 1, dtype=np.int64)
    bound = np.inf
    while alive.size:
        counts, x = runs.band(alive, w_lo, w_hi)
        t, stored, peak = runs.price(cost_model, x)
        rb, rE, rD = x[_ROWS_AT[0]], x[_ROWS_AT[1]], x[_ROWS_AT[2]]
        ok = limits.in_flight * stored + peak <= limits.budget
        if limits.max_tokens is not None:
            ok &= rb * (rE + rD) <= limits.max_tokens
        if limits.max_row is not None:
            ok &= (rE <= limits.max_row[0]) & (rD <= limits.max_row[1])
        num_fit, slowest_fit = _band_fits(counts, t, ok)
        first = not bands
        if first and not num_fit.all():
            _raise_single_sample(cost_model, limits, perm, e_raw, d_raw, e, d)
        band[alive] += num_fit
        bands.append(_Band(alive, w_lo, counts, t, stored, peak))
        slowest[alive] = np.maximum(slowest[alive], slowest_fit)
        if prune is not None and first and (w_hi <= max_w).any():  # more to price: bound it by the DP on this band
            bound = _plan_bound(bands, band, *prune)
        more = (num_fit == w_hi - w_lo) & (alive + 1 >= w_hi) & (slowest[alive] <= bound) & (w_hi <= max_w)
        next_hi = _next_band_ends(counts, t, w_lo, w_hi, bound, max_w, BAND_MARGIN)
        alive, w_lo, w_hi = alive[more], w_hi[more], next_hi[more]
    return _assemble(bands, band), band


def _run_bytes(bands, ends, widths) -> tuple[np.ndarray, np.ndarray]:
    """``(stored, peak)`` the cost model gave the runs ending at ``ends`` of ``widths`` units as ``bands`` priced them
    (NaN where none did). A band's ends are increasing (alive ends, filtered in order)."""
    stored, peak = np.full(ends.size, np.nan), np.full(ends.size, np.nan)
    for x in bands:
        k = np.minimum(np.searchsorted(x.ends, ends), x.ends.size - 1)
        first = np.cumsum(x.counts) - x.counts  # each end's first run in the band's arrays
        hit = (x.ends[k] == ends) & (widths >= x.w_lo[k]) & (widths < x.w_lo[k] + x.counts[k])
        q = first[k[hit]] + widths[hit] - x.w_lo[k[hit]]
        stored[hit], peak[hit] = np.asarray(x.stored)[q], np.asarray(x.peak)[q]
    return stored, peak


def _assemble(bands: list[_Band], band) -> np.ndarray:
    """The (N, max band) run-time table of the priced ``bands`` (inf where no run was priced; the lengths past the
    table's width left out), made non-decreasing along each row (the DP stops scanning a row at its first run over
    the cap)."""
    T = np.full((band.size, int(band.max())), np.inf)
    for x in bands:
        _scatter_band(T, x.ends, x.w_lo, x.counts, np.asarray(x.times, dtype=np.float64))
    _running_max_rows(T)
    return T


def _plan_bound(bands: list[_Band], band, weight: float, tolerance: float) -> float:
    """``U / W`` (:func:`_candidate_runs`, "Pruning"): ``U`` the objective of the DP's plan on the runs priced so
    far, under the fill-and-drain weight ``W``."""
    _, objective, _ = _solve_partition(_assemble(bands, band), band, weight, tolerance)
    return float(objective) / weight


def _evaluate_distinct(cost_model, b, E, D, pairs):  # noqa: N803 - the padded run shapes
    """``evaluate_costs`` of runs of integer shapes ``(b, E, D)``, each distinct shape priced once when the runs are
    priced densely (``pairs`` None): sorted runs share their padded lengths, so a band holds 2-3x fewer distinct
    shapes than runs, and on large models the cost model's time grows with the entries it prices. The cost model
    prices entries independently, so the values are those of pricing every run."""
    if pairs is not None or b.size < 2:
        return evaluate_costs(cost_model, b, E, D, pairs=pairs)
    span_e, span_d = int(E.max()) + 1, int(D.max()) + 1
    key = (b.astype(np.int64) * span_e + E) * span_d + D
    distinct, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    if distinct.size > 0.8 * b.size:
        return evaluate_costs(cost_model, b, E, D)
    t, stored, peak = evaluate_costs(cost_model, b[first], E[first], D[first])
    return t[inverse], stored[inverse], peak[inverse]


def _raise_single_sample(cost_model, limits: _Limits, perm, e_raw, d_raw, e, d) -> None:
    """``ValueError`` naming the sample that cannot form a micro-batch on its own."""
    tokens = e + d
    if limits.max_tokens is not None and tokens.max() > limits.max_tokens:
        j, sample = _worst_sample(tokens, perm, e_raw, d_raw)
        raise ValueError(
            f"{sample} has {int(tokens[j])} padded tokens alone, over max_tokens={limits.max_tokens}; "
            f"{int((tokens > limits.max_tokens).sum())} sample(s) do not fit alone. Raise max_tokens to at "
            f"least {int(tokens.max())}"
        )
    if limits.max_row is not None:
        over = np.maximum(e - limits.max_row[0], d - limits.max_row[1])
        if over.max() > 0:
            j, sample = _worst_sample(over, perm, e_raw, d_raw)
            raise ValueError(f"{sample} is longer than a flat row of max_row={tuple(limits.max_row)} (input, target) "
                             f"tokens; {int((over > 0).sum())} sample(s) do not fit alone. Raise max_row to the "
                             "longest sample's lengths")
    _, stored, peak = evaluate_costs(cost_model, np.ones_like(e), e, d)
    need = limits.in_flight * stored + peak
    j, sample = _worst_sample(need, perm, e_raw, d_raw)
    raise ValueError(
        f"{sample} alone needs {need[j] / 2**30:.3f} GiB of activation memory per stage (in_flight="
        f"{limits.in_flight} x stored {stored[j] / 2**30:.3f} GiB + peak {peak[j] / 2**30:.3f} GiB) but the budget is "
        f"{limits.budget / 2**30:.3f} GiB; {int((need > limits.budget).sum())} sample(s) do not fit alone. "
        f"The smallest budget that fits every sample is {need[j] / 2**30:.3f} GiB ({int(np.ceil(need[j]))} "
        f"bytes) of activation memory{_device_advice(cost_model, need[j])}; or lower in_flight, shorten the length "
        f"limits, {_recompute_advice(cost_model)}or use more pipeline stages"
    )


def _recompute_advice(cost_model) -> str:
    """``--recompute auto`` advice when the cost model could recompute but was told not to; nothing when it already
    recomputes (the figures above are then with recomputation) or cannot price it."""
    model = getattr(cost_model, "cost_model", cost_model)  # simulate's SingleSampleRelief view
    if getattr(model, "recompute", None) == "none" and hasattr(getattr(model, "model", None), "recompute_terms"):
        return "pass --recompute auto (activation recomputation), "
    return ""


def device_memory_for(cost_model, activation_bytes: float) -> float | None:
    """The device memory whose activation budget is ``activation_bytes``: the largest stage's model
    states and the kept-free margin added back (``None`` for a cost model without a device, e.g. a
    bare budget)."""
    device = getattr(cost_model, "device_memory_bytes", None)
    states = getattr(cost_model, "model_state_bytes", None)
    if device is None or states is None:
        return None
    margin = float(getattr(cost_model, "memory_margin", 0.0))
    return (float(activation_bytes) + max(states)) / (1.0 - margin)


def _device_advice(cost_model, activation_bytes: float) -> str:
    device = device_memory_for(cost_model, activation_bytes)
    if device is None:
        return ""
    gib = 2**30
    states = max(cost_model.model_state_bytes)
    # round up so that passing the printed value fits (GiB with 3 decimals)
    shown = np.ceil(device / gib * 1000) / 1000
    return (f", i.e. a device memory (--memory-gib) of at least {shown:.3f} GiB with this stage split's model "
            f"states ({states / gib:.3f} GiB on its largest stage) and {cost_model.memory_margin:.0%} kept free")


def _worst_sample(values, perm, e_raw, d_raw) -> tuple[int, str]:
    """Planner position ``j`` of the largest of ``values``, and that sample as ``sample i (input_len=..,
    target_len=..)``."""
    j = int(np.argmax(values))
    i = int(perm[j])
    return j, f"sample {i} (input_len={int(e_raw[i])}, target_len={int(d_raw[i])})"
