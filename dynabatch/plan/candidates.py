"""Baseline plans as candidates: the dynamic method never runs a step predicted slower than a baseline's.

The partition DP optimises its own objective (``sum(t) + (S - 1) max(t)`` over runs of sorted samples); the
step that runs is judged by the schedule simulator. On the encoder-decoder the two disagree: at t5-tiny, 2
stages, the DP's plans of the built-in mixture were predicted at 0.473 s a step against 0.338 s for the
padding-free best-fit rows (``packing_free``) of the same global batches, and ran 0.72-0.85x as fast.

So for each global batch the dynamic method also builds the plans the baselines would run
(:func:`baseline_candidates`: ``length_grouped``, ``token_budget`` and ``packing_free``, the baselines marked
:attr:`~dynabatch.data.baselines.BaselineSpec.plan_candidate`, at every value of its tuning grid and at the run's own option value, dealt to replicas as the baseline runs them)
and keeps the candidate with the best price (:func:`choose`). The price is the caller's: the trainer's planner
passes its own prediction (cost model, the run's schedule policy, simulator, memory check), so the plan that
runs is never predicted slower than any baseline plan of the same batch; ``dynabatch plan`` prices with the
step formula. Candidates are priced cheaply: each gets a lower bound of its price (``bound``: a stage cannot
finish before it has computed all its work, after the first micro-batch's forward on the stages before it and
before the last one's backward on the stages after it), candidates are priced in order of their bound, and a
candidate whose bound is not below the best price so far is never simulated. The DP's plan is priced first and
wins ties. Under the step formula the baselines' plans are not built at all: their settings are flat arrays
(:func:`baseline_settings`), priced with the DP's pieces in one cost-model call (:func:`price_settings`), their
plans' prices computed from the arrays (:func:`settings_prices`, :func:`~dynabatch.plan.formula.formula_prices`' prices), and only the kept
one becomes a plan (:func:`formula_choice`).

:func:`deal_to_replicas` is the one rule by which baseline micro-batches go to data-parallel replicas
(:func:`baseline_plan`, what a run of a baseline method executes, deals by it too), so a baseline candidate is
exactly the step that baseline would run. :class:`~dynabatch.plan.global_plan.GlobalPlanner` puts the DP, the
candidates and the choice together for every caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain

import numpy as np

from dynabatch.cost.pairs import flat_work, work_pairs
from dynabatch.data.baselines import (BASELINES, GROUPING_TOKENS, BaselineOptions, FlatGroups, Packing, RowGroup,
                                      baseline_spec, group_shape, make_batcher)
from dynabatch.plan.costs import evaluate_costs
from dynabatch.plan.formula import price_micro_batches, step_formula
from dynabatch.plan.replicas import equalize_counts
from dynabatch.plan.step_plan import Piece, StepPlan

DP = "dp"
"""The label of the partition DP's own plan (:attr:`Candidate.label`)."""
DP_WHOLE = "dp_whole"
"""The label of the partition DP's plan with every sample kept whole, a candidate when the DP's own plan cuts samples
into token slices (:class:`~dynabatch.plan.global_plan.GlobalPlanner`)."""


@dataclass(frozen=True)
class Candidate:
    """One plan of a global batch the dynamic method may run: the DP's, or a baseline's at one knob value."""

    method: str
    """:data:`DP`, :data:`DP_WHOLE`, or a baseline of :data:`~dynabatch.data.baselines.BASELINES`."""
    value: int | None
    """The baseline's knob value (``None`` for the DP's plans)."""
    plan: StepPlan

    @property
    def label(self) -> str:
        """``dp``, ``dp_whole``, or ``<baseline>=<knob value>`` (``packing_free=4``: four rows per micro-batch)."""
        return self.method if self.method in (DP, DP_WHOLE) else f"{self.method}={self.value}"


@dataclass(frozen=True)
class Choice:
    """What :func:`choose` kept, and what it cost."""

    candidate: Candidate
    price: float
    num_candidates: int
    num_priced: int
    """Candidates priced in full; the others were ruled out by their bound."""


class _Lengths:
    """The lengths-only view of a global batch the batchers' ``group`` reads (``input_lens``, ``target_lens``,
    ``len``): candidates are planned from lengths, as the DP is. Its :attr:`memo` keeps what the batchers derive
    from the lengths alone (:func:`~dynabatch.data.baselines.memo`: the longest-first order, the packed rows),
    so the batchers and knob values of one global batch compute each once."""

    def __init__(self, input_lens, target_lens):
        self.input_lens = np.asarray(input_lens, dtype=np.int64)
        self.target_lens = np.asarray(target_lens, dtype=np.int64)
        self.memo: dict = {}

    def __len__(self) -> int:
        return len(self.input_lens)


def candidate_baselines(padding_free: bool = True) -> list[str]:
    """The baselines whose plans are candidates (:attr:`~dynabatch.data.baselines.BaselineSpec.plan_candidate`:
    ``length_grouped``, ``token_budget``, ``packing_free``); on a dense-attention run (``padding_free=False``) only
    those with one sample per row."""

    return [n for n, spec in BASELINES.items()
            if spec.plan_candidate and (padding_free or not issubclass(spec.batcher, Packing))]


def knob_values(method: str, options) -> list[int]:
    """The knob values of ``method`` that are tried: its tuning grid and the run's own value (``options``, a
    :class:`~dynabatch.data.baselines.BaselineOptions`), increasing."""

    return sorted({*baseline_spec(method).grid, options.value(method)})


@dataclass(frozen=True, eq=False)
class Setting:
    """One baseline at one knob value on a global batch, as flat arrays: its micro-batches, their padded shapes, and
    which of them each replica runs (:func:`deal_to_replicas`). Its :class:`~dynabatch.plan.step_plan.StepPlan` is built
    only where it is needed (:meth:`plan`)."""

    method: str
    value: int | None
    family: str
    groups: FlatGroups
    shapes: np.ndarray
    """(G, 3) int64 padded ``(b, E, D)`` of each micro-batch."""
    replicas: tuple[list[int], ...]
    """Per replica, its micro-batches (indices into :attr:`groups`) in the baseline's order."""

    def plan(self, times: Sequence[float], num_stages: int, even=None) -> StepPlan:
        """This setting as a plan, each micro-batch's piece timed ``times`` (``even``: the dealt micro-batches then
        given equal counts, :func:`even_counts`)."""
        groups, shapes = self.groups.row_groups(), list(map(tuple, self.shapes.tolist()))
        dealt = [[(groups[k], shapes[k], times[k]) for k in ks] for ks in self.replicas]
        if even is not None:
            dealt = even(dealt)
        return StepPlan(self.family, num_stages, tuple(tuple(_piece(*x) for x in xs) for xs in dealt), ())


def _piece(g: RowGroup, shape, time_s: float) -> Piece:
    samples = tuple(chain.from_iterable(g.rows))  # more samples than rows: some row packs several
    return Piece(samples, shape, time_s, rows=g.rows if len(samples) > len(g.rows) else None)


def baseline_settings(input_lens, target_lens, limits, *, num_replicas: int = 1, options=None,
                      padding_free: bool = True, methods: Sequence[str] | None = None) -> list[Setting]:
    """The settings of the baselines (``methods``, default :func:`candidate_baselines`) at every knob value of
    :func:`knob_values`, in that order. A value whose micro-batches equal an earlier setting's is left out (the first
    stays; equal rows compared as flat arrays, :meth:`~dynabatch.data.baselines.FlatGroups.rows_key`), so is one
    with fewer micro-batches than replicas. The batchers group a lengths-only view of the batch that keeps what they
    derive from the lengths (its longest-first order, its packed rows) for the others; the shapes of every kept
    setting's micro-batches are computed in one pass (:func:`_shapes_of`)."""
    options = options or BaselineOptions()
    batch = _Lengths(input_lens, target_lens)
    seen: set = set()
    kept = []
    for method in methods if methods is not None else candidate_baselines(padding_free):
        for value in knob_values(method, options):
            groups = _batcher(method, limits, value).flat_group(batch)
            key = groups.rows_key()
            if key in seen or len(groups) < num_replicas:
                continue
            seen.add(key)
            kept.append((method, value, groups))
    shapes = _shapes_of([groups for *_, groups in kept], batch, limits.family)
    return [_setting(method, value, groups, s, limits.family, num_replicas)
            for (method, value, groups), s in zip(kept, shapes)]


def _shapes_of(parts: Sequence[FlatGroups], batch: _Lengths, family: str) -> list[np.ndarray]:
    """:meth:`~dynabatch.data.baselines.FlatGroups.shapes` of each of ``parts``, computed for all of them at once
    on their concatenation (each part's fixed row lengths then set on its rows)."""
    if not parts:
        return []
    joined = FlatGroups.concatenated(parts).shapes(batch.input_lens, batch.target_lens, family)
    ends = np.cumsum([len(p) for p in parts]).tolist()
    out = [joined[lo:hi] for lo, hi in zip([0, *ends[:-1]], ends)]
    for part, shapes in zip(parts, out):
        if part.encoder_len or part.decoder_len:
            shapes[:] = part.shapes(batch.input_lens, batch.target_lens, family)
    return out


def _setting(method: str, value: int | None, groups: FlatGroups, shapes: np.ndarray, family: str,
             num_replicas: int) -> Setting:
    """A baseline's micro-batches with their shapes, dealt to replicas by :func:`deal_to_replicas` (by computed
    tokens)."""
    items = list(range(len(groups)))
    if num_replicas == 1 and items:  # deal_to_replicas' one replica: every micro-batch, in order (sizes unread)
        return Setting(method, value, family, groups, shapes, (items,))
    sizes = (shapes[:, 0] * (shapes[:, 1] + shapes[:, 2])).tolist()
    return Setting(method, value, family, groups, shapes, tuple(deal_to_replicas(items, sizes, num_replicas)))


def baseline_candidates(input_lens, target_lens, limits, num_stages: int, *, num_replicas: int = 1, options=None,
                        padding_free: bool = True, methods: Sequence[str] | None = None,
                        cost_model=None, work: dict | None = None, equal_counts: bool = False,
                        priced: dict | None = None, also: Sequence = ()) -> list[Candidate]:
    """The plans of :func:`baseline_settings` (the baselines at every knob value, equal micro-batches once, none with
    fewer micro-batches than replicas), as :class:`~dynabatch.plan.step_plan.StepPlan` s in the order the baseline runs
    its micro-batches, dealt to replicas by :func:`deal_to_replicas`. ``cost_model`` (a
    :class:`~dynabatch.plan.costs.MicroBatchCostModel`) sets each piece's ``time_s`` (its bottleneck-stage time;
    per-segment attention when ``padding_free``), every candidate's pieces in one call; else it is 0.
    ``equal_counts`` (``--zero 2``): every candidate then gets equal counts per replica (:func:`even_counts`), and
    a setting that cannot be evened is left out. ``priced`` (padding-free, with a ``cost_model``): a dict to which
    each micro-batch's ``(time, stored, peak)`` is added by its ``(rows, shape)`` (as :func:`~dynabatch.plan.formula.price_micro_batches`
    adds them), which :func:`~dynabatch.plan.formula.formula_prices` then reads instead of pricing the same micro-batches again; ``also``:
    further ``(rows, shape)`` micro-batches (the DP's) priced in the same call and added; ``work``: a dict to which
    the same micro-batches' :func:`~dynabatch.cost.pairs.row_work` is added by their rows."""
    family = limits.family
    settings = baseline_settings(input_lens, target_lens, limits, num_replicas=num_replicas, options=options,
                                 padding_free=padding_free, methods=methods)
    memo = cost_model is not None and padding_free
    groups, shapes = _micro_batches(settings, also if memo and priced is not None else ())
    work_arrays = _work(cost_model, groups, input_lens, target_lens, family, padding_free)
    costs = _costs(cost_model, shapes, work_arrays)
    if memo and (priced is not None or work is not None):
        _remember(groups, shapes, costs, work_arrays, priced, work)
    times = costs[0].tolist()
    even = _evener(equal_counts, _Lengths(input_lens, target_lens), family, cost_model, padding_free)
    out: list[Candidate] = []
    start = 0
    for setting in settings:
        setting_times = times[start:start + len(setting.groups)]
        start += len(setting.groups)
        try:
            plan = setting.plan(setting_times, num_stages, even)
        except ValueError:  # equal counts out of reach (single samples, too few of them)
            continue
        out.append(Candidate(setting.method, setting.value, plan))
    return out


def _micro_batches(settings: Sequence[Setting], extra: Sequence = ()) -> tuple[FlatGroups, np.ndarray]:
    """The micro-batches of ``settings``, setting after setting, then ``extra`` ones given as ``(rows, shape)``: their
    flat rows and (M, 3) int64 shapes, for one pricing pass."""
    groups = FlatGroups.concatenated([*(s.groups for s in settings), FlatGroups.of(rows for rows, _ in extra)])
    shapes = np.concatenate([*(s.shapes for s in settings),
                             np.array([shape for _, shape in extra], dtype=np.int64).reshape(-1, 3)])
    return groups, shapes


def _work(cost_model, groups: FlatGroups, input_lens, target_lens, family: str, padding_free: bool):
    """The attention pairs, calls and longest segments the micro-batches of ``groups`` compute
    (:func:`~dynabatch.cost.pairs.flat_work`'s arrays) where they are priced per segment (``padding_free``, with a
    cost model); else ``None``."""
    if cost_model is None or not padding_free:
        return None
    return flat_work(groups, input_lens, target_lens, family)


def _costs(cost_model, shapes: np.ndarray, work=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each micro-batch's ``(time, stored, peak)`` (float64, :func:`~dynabatch.plan.costs.evaluate_costs`) from its
    padded ``shapes`` (M, 3) and its work (:func:`_work`: the attention pairs, calls and longest segments its rows
    compute; ``None``: dense attention), in one cost-model call.
    The cost model prices entries independently, so any call holding the same micro-batch gives the same values.
    Without a cost model every time is 0 (``stored`` and ``peak`` too)."""
    if cost_model is None or not len(shapes):
        zeros = np.zeros(len(shapes))
        return zeros, zeros, zeros
    arr = shapes.astype(np.float64)
    t, stored, peak = evaluate_costs(cost_model, arr[:, 0], arr[:, 1], arr[:, 2],
                                     pairs=None if work is None else work_pairs(*work))
    return tuple(np.asarray(x, dtype=np.float64) for x in (t, stored, peak))


def _remember(groups: FlatGroups, shapes: np.ndarray, costs, work_arrays, priced: dict | None,
              work: dict | None) -> None:
    """Add the micro-batches of ``groups`` to ``priced`` (``(time, stored, peak)`` by rows and shape) and to ``work``
    (:func:`~dynabatch.cost.pairs.row_work` by rows), where given and not there yet: the memos
    :func:`~dynabatch.plan.formula.formula_prices` reads."""
    rows = [g.rows for g in groups.row_groups()]
    if priced is not None:
        for key, value in zip(zip(rows, map(tuple, shapes.tolist())), zip(*(c.tolist() for c in costs))):
            priced.setdefault(key, value)
    if work is not None:
        pairs, calls, longest = (map(tuple, a.tolist()) for a in work_arrays)
        for key, value in zip(rows, zip(pairs, calls, longest)):
            work.setdefault(key, value)


@dataclass(frozen=True, eq=False)
class PricedSettings:
    """The DP's plan and the baseline settings of one global batch with every whole-sample micro-batch of theirs
    priced in one cost-model call (:func:`price_settings`): what :func:`formula_choice` compares."""

    dp: StepPlan
    settings: tuple[Setting, ...]
    costs: tuple[np.ndarray, np.ndarray, np.ndarray]
    """``(time, stored, peak)`` of each setting's micro-batches, setting after setting, then of the DP's whole-sample
    pieces in plan order."""
    starts: tuple[int, ...]
    """Where each setting's micro-batches start among :attr:`costs`, then where the DP's pieces start."""


def price_settings(cost_model, dp: StepPlan, settings: Sequence[Setting], input_lens, target_lens,
                   family: str) -> PricedSettings:
    """The micro-batches of ``settings`` and the whole-sample pieces of the DP's plan ``dp`` priced per segment (with
    the attention pairs, calls and longest segments their rows compute in model ``family``) by ``cost_model``, in
    one call."""
    whole = [(p.row_samples, p.shape) for pieces in dp.replicas for p in pieces if not p.is_slice]
    groups, shapes = _micro_batches(settings, whole)
    costs = _costs(cost_model, shapes, _work(cost_model, groups, input_lens, target_lens, family, True))
    starts = np.cumsum([0, *(len(s.groups) for s in settings)]).tolist()
    return PricedSettings(dp, tuple(settings), costs, tuple(starts))


def formula_choice(priced: PricedSettings, cost_model, in_flight: int | None = None, timed: bool = True) -> Candidate:
    """The candidate :func:`choose` keeps among the DP's plan (first) and the baseline settings' plans by
    :func:`settings_prices` (:func:`~dynabatch.plan.formula.formula_prices`' prices): the cheapest, the first on ties. Only the kept
    baseline's plan is built, its pieces timed by their priced time (0 unless ``timed``)."""
    prices = settings_prices(priced, cost_model, in_flight)
    best = min(range(len(prices)), key=prices.__getitem__)  # the first of the cheapest, as choose keeps
    if best == 0:
        return Candidate(DP, None, priced.dp)
    setting, start = priced.settings[best - 1], priced.starts[best - 1]
    time = priced.costs[0][start:start + len(setting.groups)]
    times = time.tolist() if timed else [0.0] * len(setting.groups)
    return Candidate(setting.method, setting.value, setting.plan(times, priced.dp.num_stages))


def settings_prices(priced: PricedSettings, cost_model, in_flight: int | None = None) -> list[float]:
    """:func:`~dynabatch.plan.formula.formula_prices` (padding-free) of the DP's plan and of each setting's plan, the same prices computed
    from ``priced``'s arrays without building the settings' plans: each plan's step formula of its slowest replica,
    ``inf`` where a piece breaks the memory rule (:func:`~dynabatch.plan.formula.step_formula` for the DP's plan; the settings' replicas
    all at once, :func:`_replica_formulas`)."""
    dp = priced.dp
    held, budget = in_flight or dp.num_stages, float(getattr(cost_model, "memory_budget_bytes", np.inf))
    prices = [step_formula(_dp_replicas(dp, priced.costs, priced.starts[-1]), dp.num_stages, held, budget)]
    entries, replica_bounds, setting_bounds = _replica_entries(priced)
    values = _replica_formulas(priced.costs, entries, replica_bounds, dp.num_stages, held, budget)
    prices.extend(max(values[lo:hi], default=0.0) for lo, hi in zip(setting_bounds[:-1], setting_bounds[1:]))
    return prices


def _replica_entries(priced: PricedSettings) -> tuple[np.ndarray, list[int], list[int]]:
    """The non-empty replicas of every setting of ``priced``, one after another: their micro-batches' entries into
    :attr:`PricedSettings.costs` (int64, each replica's in its order), where each replica starts among them (then
    the end), and where each setting's replicas start among the replicas (then their number)."""
    replicas = [[(start, ks) for ks in setting.replicas if ks]
                for setting, start in zip(priced.settings, priced.starts)]
    laid = list(chain.from_iterable(replicas))
    sizes = [len(ks) for _, ks in laid]
    entries = np.fromiter(chain.from_iterable(ks for _, ks in laid), dtype=np.int64, count=sum(sizes))
    entries += np.repeat(np.array([start for start, _ in laid], dtype=np.int64), sizes)
    return entries, np.cumsum([0, *sizes]).tolist(), np.cumsum([0, *map(len, replicas)]).tolist()


def _replica_formulas(costs, entries: np.ndarray, bounds: list[int], num_stages: int, held: int,
                      budget: float) -> list[float]:
    """:func:`~dynabatch.plan.formula.step_formula` of each replica whose micro-batches are ``entries[bounds[r]:bounds[r + 1]]`` (entries into
    ``costs``, ``(time, stored, peak)``): ``sum(t) + (S - 1) max(t)``, ``inf`` when a micro-batch breaks
    ``held * stored + peak <= budget``. The memory rule and the maxima are computed for all replicas in a few numpy
    passes; each sum stays numpy's sum of that replica's times laid out contiguously, so rounding is the same as
    :func:`~dynabatch.plan.formula.step_formula`'s (a segmented sum would associate differently)."""
    time, stored, peak = costs
    times = time[entries]
    starts = bounds[:-1]
    over = np.logical_or.reduceat((held * stored + peak > budget)[entries], starts)
    longest = np.maximum.reduceat(times, starts)
    sums = np.array([times[lo:hi].sum() for lo, hi in zip(starts, bounds[1:])])
    values = sums + (num_stages - 1) * longest
    values[over] = np.inf
    return values.tolist()


def _dp_replicas(dp: StepPlan, costs, start: int) -> list[tuple]:
    """:func:`~dynabatch.plan.formula.step_formula`'s ``(times, stored, peak)`` of each replica of the DP's plan: its whole-sample pieces'
    priced costs (``costs`` from entry ``start`` on, in plan order); a slice keeps its own time."""
    out = []
    for pieces in dp.replicas:
        if not pieces:
            continue
        times = np.array([p.time_s for p in pieces])
        whole = np.array([not p.is_slice for p in pieces])
        if not whole.any():
            out.append((times, None, None))
            continue
        entries = np.arange(start, start + int(whole.sum()))
        start += len(entries)
        time, stored, peak = (c[entries] for c in costs)
        times[whole] = time
        out.append((times, stored, peak))
    return out


def baseline_plan(method: str, input_lens, target_lens, limits, num_stages: int, *, num_replicas: int = 1,
                  options=None, batcher_options=None, cost_model=None, padding_free: bool = True,
                  equal_counts: bool = False) -> StepPlan:
    """Baseline ``method``'s plan of a global batch of lengths ``input_lens``, ``target_lens`` at its knob value in
    ``options``: its micro-batches in the baseline's order, dealt to replicas by :func:`deal_to_replicas` (a
    ``ValueError`` when there are fewer micro-batches than replicas). What a run of that baseline executes, and
    exactly the candidate of the same value. ``cost_model``: each piece's ``time_s``, as in
    :func:`baseline_candidates`. ``batcher_options``: the batcher's fields as given (the DataLoader's
    ``method_options``) instead of ``options``. ``equal_counts`` (``--zero 2``): then every replica gets as many
    micro-batches as the one with the most (:func:`even_counts`)."""
    batch = _Lengths(input_lens, target_lens)
    if batcher_options is not None:
        batcher = make_batcher(method, limits, GROUPING_TOKENS, **batcher_options)
    else:
        batcher = _batcher(method, limits, (options or BaselineOptions()).value(method))
    groups = batcher.flat_group(batch)
    if len(groups) < num_replicas:  # a small batch (an evaluation pass's last): the knob decides, not the budget
        spec = baseline_spec(method)
        raise ValueError(
            f"{method}: this global batch of {len(batch)} samples makes {len(groups)} micro-batch(es), fewer than the "
            f"{num_replicas} replicas; lower {spec.option}, or use the dynamic method, which deals a small batch to "
            "every replica (a training stream: or raise global_batch_tokens)")
    shapes = groups.shapes(batch.input_lens, batch.target_lens, limits.family)
    setting = _setting(method, None, groups, shapes, limits.family, num_replicas)
    times = _times(cost_model, groups, setting.shapes, batch, limits.family, padding_free)
    even = _evener(equal_counts, batch, limits.family, cost_model, padding_free)
    return setting.plan(times, num_stages, even)


def _evener(equal_counts: bool, batch, family: str, cost_model, padding_free: bool):
    """What :meth:`Setting.plan` applies to the dealt micro-batches: :func:`even_counts` under ``equal_counts``, else
    nothing."""
    if not equal_counts:
        return None
    return lambda dealt: even_counts(dealt, batch, family, cost_model, padding_free)


@lru_cache(maxsize=256)
def _batcher(method: str, limits, value: int):
    """Baseline ``method``'s batcher at knob value ``value`` (lengths only). Batchers are frozen, so one is made per
    method, limits and value and kept: the candidates of every global batch use the same few."""
    return make_batcher(method, limits, GROUPING_TOKENS, **baseline_spec(method).batcher_fields(value, limits))


def even_counts(dealt, batch, family: str, cost_model=None, padding_free: bool = True) -> list[list]:
    """A baseline's micro-batches (per replica, ``(row group, shape, time)`` items as dealt) given equal counts
    for ``--zero 2`` by :func:`~dynabatch.plan.replicas.equalize_counts`, the rule the dynamic method's plans follow:
    on a replica with fewer, its costliest micro-batch of two or more rows is cut into its first and second half of
    rows (a row of several packed samples into two rows of half of them), each keeping the baseline's fixed row
    lengths; a replica with nothing left to cut takes the cheapest micro-batch of a replica with the most.
    Micro-batches are priced by ``cost_model`` (the halves too, with ``time_s`` set as the others'); without one by
    their computed tokens (and ``time_s`` stays 0). Raises ``ValueError`` (equalize_counts') when no cutting evens
    the counts (replicas of one-sample micro-batches and too few of them)."""
    if len({len(xs) for xs in dealt}) <= 1:
        return [list(xs) for xs in dealt]

    def item(g: RowGroup):
        shape = group_shape(batch, g, family)
        return g, shape, _times(cost_model, FlatGroups.of([g.rows]), np.array([shape]), batch, family, padding_free)[0]

    def price(xs) -> list[float]:
        return [t if cost_model is not None else b * (e + d) for _, (b, e, d), t in xs]

    def split(x):
        g = x[0]
        if len(g.rows) >= 2:
            half = len(g.rows) // 2
            parts = (g.rows[:half], g.rows[half:])
        elif len(g.rows[0]) >= 2:
            half = len(g.rows[0]) // 2
            parts = ((g.rows[0][:half],), (g.rows[0][half:],))
        else:
            return None
        return tuple(item(RowGroup(part, g.encoder_len, g.decoder_len)) for part in parts)

    return equalize_counts(dealt, price, split)


def _times(cost_model, groups: FlatGroups, shapes: np.ndarray, batch, family: str, padding_free: bool) -> list[float]:
    """Each micro-batch's time under ``cost_model`` (:func:`_costs`; 0 without one)."""
    return _costs(cost_model, shapes, _work(cost_model, groups, batch.input_lens, batch.target_lens, family,
                                            padding_free))[0].tolist()


def deal_to_replicas(items: list, sizes: list[int], num_replicas: int) -> list[list]:
    """Baseline micro-batches (``items``) to replicas, largest ``sizes`` first to the least-loaded replica, each
    replica keeping the baseline's order."""
    if len(items) < num_replicas:
        raise ValueError(f"{len(items)} micro-batches cannot feed {num_replicas} replicas; raise global_batch_tokens")
    if num_replicas == 1:  # every item to the one replica, in order
        return [list(items)]
    load = [0] * num_replicas
    owner = [0] * len(items)
    for k in sorted(range(len(items)), key=lambda k: (-sizes[k], k)):
        r = min(range(num_replicas), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += sizes[k]
    return [[g for g, o in zip(items, owner) if o == r] for r in range(num_replicas)]


def choose(candidates: Sequence[Candidate], price: Callable[[StepPlan], float],
           bound: Callable[[StepPlan], float] | None = None) -> Choice:
    """The candidate with the lowest ``price(plan)`` (``inf``: does not fit); the first on ties, so list the
    DP's plan first. ``bound(plan) <= price(plan)`` (optional) rules a candidate out without pricing it when
    its bound is not below the best price so far; the first candidate is always priced."""
    if not candidates:
        raise ValueError("choose needs at least one candidate")
    best, best_price = candidates[0], float(price(candidates[0].plan))
    rest = list(candidates[1:])
    if bound is not None:
        bounds = [float(bound(c.plan)) for c in rest]
        order = np.argsort(bounds, kind="stable")
        rest, bounds = [rest[k] for k in order], [bounds[k] for k in order]
    else:
        bounds = [-np.inf] * len(rest)
    priced = 1
    for c, low in zip(rest, bounds):
        if low * (1 - _BOUND_SLACK) >= best_price:
            break
        value = float(price(c.plan))
        priced += 1
        if value < best_price:
            best, best_price = c, value
    return Choice(best, best_price, len(candidates), priced)


_BOUND_SLACK = 1e-9
"""Relative slack on a bound before it rules a candidate out (a bound can equal the price up to rounding)."""


__all__ = ["DP", "DP_WHOLE", "Candidate", "Choice", "PricedSettings", "Setting", "baseline_candidates", "baseline_plan",
           "baseline_settings", "candidate_baselines", "choose", "deal_to_replicas", "even_counts", "formula_choice",
           "knob_values", "price_settings", "settings_prices"]
