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

**Row packing** (``pack_rows="auto"``, for the padding-free runtime: attention per sample, pad never
computed). Every micro-batch is then priced by the attention pairs it really computes
(:mod:`dynabatch.cost.pairs`; a padded one-sample row pays its own length squared), and the step is
planned several ways: the dense planner's plan (``"off"``'s), the samples one per row with per-segment
pricing, and the samples packed best-fit-decreasing into rows of each capacity in :data:`ROW_CAPACITIES` (fractions of the step's longest sample;
:func:`~dynabatch.plan.rowpack.pack_units`), each partitioned by the same DP over its rows. The plan
with the lowest ``score`` (default: the predicted step ``sum(t) + (S - 1) max(t)`` with every
micro-batch re-priced with its attention pairs and calls, which the DP does not see) is kept, so
``auto`` never scores worse than ``off`` under the same pricing. ``"off"`` (the
default of this function) is the dense planner as before: one sample per row, attention priced as
dense ``b x E^2``, which suits a runtime that computes attention over whole padded rows. Pieces of a
packed plan carry their rows (:attr:`Piece.rows`) and pairs (:attr:`Piece.pairs`).

**Flat rows** (``pack_rows="flat"``, also one of ``auto``'s candidates): the samples are ordered and cut by
the same DP, but every micro-batch is laid out as *one* row of its samples back to back, priced at ``(1,
sum e, sum d)`` with its summed pairs and its longest segments (:attr:`Piece.longest`, T5's bias window;
``plan_partition(flat_rows=True)``): no layer computes pad. On CPU a flat row holds at most one row of the
length limits (``flat_row``, :data:`FLAT_ROW_LIMITS`). docs/algorithms/planner.md, "Row packing in the planner", has the
measurements (simulated T5 1.03-1.10x of ``off``; on the CPU runtime, bounded, T5 0.98-1.06x and GPT-2
0.95-0.99x, so ``off`` stays the default).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dynabatch.core.packing import PACK_ROWS  # ``pack_rows`` choices, one list for the config and the planner
from dynabatch.cost.pairs import fill_work, rows_work, sample_pairs
from dynabatch.plan.costs import MicroBatchCostModel, evaluate_costs
from dynabatch.plan.order import check_lengths, padded_lengths
from dynabatch.plan.replicas import equalize_counts, group_pricing, plan_replicas, wants_equal_counts
from dynabatch.plan.rowpack import PackedUnits, order_for_fill_drain, pack_units
from dynabatch.plan.slice_costs import SliceCostModel
from dynabatch.plan.slicing import slice_long_samples
from dynabatch.plan.step_plan import Piece, StepPlan
from dynabatch.core.sequence import is_seq2seq

DEFAULT_PACK_ROWS = "device"
"""The commands' and ``TrainConfig``'s default: the resolver's ``pack_rows`` rule (:mod:`dynabatch.training.config.resolve`)
decides it per device, ``auto`` on CUDA and ``off`` on CPU and in ``plan``/``simulate``."""


FILL_SCALES = (1.0, 0.5, 0.25)
"""Weights on the partition DP's fill-and-drain term that :func:`plan_step` tries when it has a simulated
``score`` (the trainer's and bench's planner): with measured (calibrated) costs, the plain formula's
``(S - 1) max(t)`` over-charges large micro-batches and cut a T5 step into 14-17 micro-batches where 10 ran
faster (docs/benchmarks/calibration/)."""
FLAT = "flat"
"""The row "capacity" of ``pack_rows="flat"``: every micro-batch is one row of its samples back to back."""
FLAT_ROW_LIMITS: dict[str, float] = {"cpu": 1.0}
"""Per device type: a flat micro-batch (``pack_rows="flat"``) holds at most this many rows of the length limits
(``max_input_len`` input and ``max_target_len`` target tokens a row, a decoder-only model's ``max_seq_len``),
the rows packing_free packs; unlisted device types (CUDA): no limit. On this CPU a stage's time per token
rises past about one such row (cache; bigger attention groups), which the cost model's per-token terms do not
see: the fitted model cut T5 steps at 1024 into 5-6.5 flat micro-batches that computed 7-12% more on the
first stage than packing_free's 7.6 rows of the same tokens (0.92-0.95x its tokens/s). Bounded, they come
out at 9.6 and ran 0.97-1.07x packing_free on the built-in mixture, 0.99-1.04x on the heavy-tailed file in
three rounds (before: 0.93-1.02x; docs/algorithms/planner.md, "Row packing in the planner")."""
ROW_CAPACITIES = (1.0, 0.5, 0.25)
"""Row capacities ``pack_rows="auto"`` tries, as fractions of the step's longest sample (T5: of the longest
input and of the longest target)."""


def flat_row_limit(device_type: str, family: str, max_input_len: int, max_target_len: int) -> tuple[int, int] | None:
    """``max_row`` of a flat row on ``device_type`` (:data:`FLAT_ROW_LIMITS`): ``(input, target)`` tokens, a
    decoder-only model's ``(max_input_len, 0)``; ``None`` where unbounded."""
    rows = FLAT_ROW_LIMITS.get(device_type)
    if rows is None:
        return None
    return int(rows * max_input_len), int(rows * max_target_len) if is_seq2seq(family) else 0


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
    pack_rows: str = "off",
    fill_scales: tuple[float, ...] | None = None,
    segment_pricing: bool = False,
    flat_row: tuple[int, int] | None = None,
    **partition_options,
) -> StepPlan:
    """Plan one global batch end to end (see the module docstring). ``score(plan)`` (lower is better;
    default :attr:`StepPlan.objective_s`) decides whether slicing for the bubble pays off and, with
    ``pack_rows="auto"``, which row packing to keep; the trainer passes the simulated step time
    (:func:`dynabatch.training.step_score.simulated_step_time`).

    ``fill_scales``: the partition DP's weights on its fill-and-drain term
    (:func:`~dynabatch.plan.partition.plan_partition`'s ``fill_scale``); each is planned and the best
    ``score`` kept. Default :data:`FILL_SCALES` when a ``score`` is given (the simulated step judges
    them), else the plain formula alone.

    ``segment_pricing`` (the padding-free runtime, ``pack_rows="off"``): the DP prices each run of
    one-sample rows by the attention pairs its samples really compute (the ``(0, 0)`` capacity of the row
    packing: each sample's own square) instead of dense ``b x E^2``. Dense pricing charges attention over
    pad the runtime never computes, so with measured per-pair costs it splits runs only to avoid pad.

    ``flat_row`` ``(input, target)`` tokens (:func:`flat_row_limit`): every flat micro-batch (``pack_rows``
    ``flat``, and ``auto``'s flat candidate) holds at most that many, or the step's longest sample's if longer;
    ``None``: unbounded."""
    e, d = check_lengths(input_lens, target_lens)
    n = len(e)
    if num_replicas < 1 or n < num_replicas:
        raise ValueError(f"need 1 <= num_replicas <= number of samples, got {num_replicas} replicas for {n} samples")
    if pack_rows not in PACK_ROWS:
        raise ValueError(f"pack_rows must be one of {', '.join(PACK_ROWS)}; got {pack_rows!r}")
    if fill_scales is None:
        fill_scales = FILL_SCALES if score is not None else (1.0,)
    if flat_row is not None:  # a sample longer than the limit still forms its own row
        top = padded_lengths(e, d, family)
        flat_row = (max(int(flat_row[0]), int(top[0].max())), max(int(flat_row[1]), int(top[1].max())))
    # one table of priced runs per way of forming rows, shared by the fill-and-drain weights (plan_partition's
    # runs_cache), and one score per distinct plan: the candidates repeat both
    # (pruned under the smallest weight: plan_partition's prune_fill_scale)
    options = {"runs_cache": {}, "prune_fill_scale": min(fill_scales), **partition_options}
    how = _Planning(cost_model, num_stages, family, num_replicas, fill_drain_order, options, pack_rows,
                    None if score is None else _once(score),
                    tuple(fill_scales), segment_pricing, flat_row, slice_cost_model,
                    _once(lambda plan: _priced_objective(plan, cost_model)))
    if slice_cost_model is None:
        return _plan(e, d, [], how)
    if is_seq2seq(family):
        raise ValueError(f"token slicing needs a decoder-only (causal) model, got {family!r}")
    # Which samples must run sliced is the partition's own memory test (the slice model prices one stage): what
    # fails it is sliced whatever the slice model says, and with activation recomputation what passes it is not
    # forced into slices either.
    in_flight = partition_options.get("in_flight") or num_stages
    lens = (e + d).astype(np.float64)
    _, stored, peak = cost_model.evaluate(np.ones_like(lens), lens, np.zeros_like(lens))
    fits_whole = in_flight * np.asarray(stored) + np.asarray(peak) <= float(cost_model.memory_budget_bytes)
    decision = slice_long_samples(
        e + d, slice_cost_model, num_stages, bubble_fraction=bubble_fraction, granularity=slice_granularity,
        in_flight=in_flight, fits_whole=fits_whole if getattr(cost_model, "recompute", "none") != "none" else None,
        must_slice=~fits_whole,
    )
    sliced = [
        (i, [Piece((i,), (1, hi - lo, 0), float(t), (lo, hi)) for lo, hi, t in zip(b[:-1], b[1:], plan.times_s)], why)
        for i, plan, why in zip(decision.sample_indices.tolist(), decision.plans, decision.reasons)
        for b in [plan.boundaries.tolist()]
    ]
    best = _plan(e, d, sliced, how)
    forced = [x for x in sliced if not fits_whole[x[0]]]
    if len(forced) < len(sliced):  # slicing for the bubble alone must pay off for the whole step
        fewer = _plan(e, d, forced, how)
        score = how.score or (lambda plan: plan.objective_s)
        if score(fewer) <= score(best):
            best = fewer
    return best


@dataclass(frozen=True)
class _Planning:
    """How :func:`plan_step` plans: the arguments every candidate plan shares."""

    cost_model: MicroBatchCostModel
    num_stages: int
    family: str
    num_replicas: int
    fill_drain_order: bool
    partition_options: dict
    pack_rows: str
    """:data:`PACK_ROWS`: ``auto`` tries row packings with per-segment pricing, ``flat`` lays every
    micro-batch out as one row."""
    score: Callable[[StepPlan], float] | None
    """The caller's score; ``None``: the predicted step (row packings: re-priced with attention calls)."""
    fill_scales: tuple[float, ...] = (1.0,)
    segment_pricing: bool = False
    """Without row packing: one sample per row priced by its own pairs (``(0, 0)``), not dense."""
    flat_row: tuple[int, int] | None = None
    """``max_row`` of every flat micro-batch (:func:`plan_step`'s ``flat_row``), or None."""
    slice_cost_model: SliceCostModel | None = None
    """Prices token slices (halves of a slice under ``--zero 2``'s equal counts), or None."""
    priced: Callable[[StepPlan], float] | None = None
    """The default score of the row packings, :func:`_priced_objective` under ``cost_model``."""
    row_work: dict = field(default_factory=dict)
    """``(flat, rows of units) -> (rows, pairs, calls, longest)`` of the pieces made so far: the fill-and-drain
    weights and the row packings cut many of the same micro-batches."""


def _once(score: Callable[[StepPlan], float]) -> Callable[[StepPlan], float]:
    """``score`` computed once per distinct plan (same pieces, same order): the fill-and-drain weights and the
    row packings often cut a step the same way. Scores are deterministic, so this changes no choice. A ``score``
    with a ``many(plans) -> scores`` attribute (the trainer's simulated step: one cost-model call for all the
    plans' pieces) is asked for the unscored plans of a :func:`_scores` call at once."""
    memo: dict = {}
    many = getattr(score, "many", None)

    def key(plan: StepPlan):
        return plan.family, plan.num_stages, plan.replicas, plan.sliced_samples

    def scored(plan: StepPlan) -> float:
        k = key(plan)
        if k not in memo:
            memo[k] = score(plan)
        return memo[k]

    def scored_many(plans: list[StepPlan]) -> list[float]:
        keys = [key(p) for p in plans]
        todo = dict((k, p) for k, p in zip(keys, plans) if k not in memo)  # distinct, in order
        if todo:
            values = many(list(todo.values())) if many is not None else [score(p) for p in todo.values()]
            memo.update(zip(todo, values))
        return [memo[k] for k in keys]

    scored.many = scored_many  # type: ignore[attr-defined]
    return scored


def _scores(score: Callable[[StepPlan], float], plans: list[StepPlan]) -> list[float]:
    """``score`` of each of ``plans``, through its ``many`` when it has one (:func:`_once`)."""
    many = getattr(score, "many", None)
    return list(many(plans)) if many is not None else [score(p) for p in plans]


def _plan(e, d, sliced, how: _Planning) -> StepPlan:
    """The best-scoring of the plans under each of ``how.fill_scales`` (:func:`_plan_at`)."""
    from dataclasses import replace

    hows = [replace(how, partition_options={**how.partition_options, "fill_scale": s}) for s in how.fill_scales]
    if len(hows) == 1:
        return _plan_at(e, d, sliced, hows[0])
    candidates = [_candidates_at(e, d, sliced, h) for h in hows]
    if len(candidates[0]) > 1:  # the row packings of every weight scored at once (_scores; then remembered)
        _scores(_packing_score(how), [p for c in candidates for p in c])
    score = how.score or (lambda plan: plan.objective_s)
    best = None
    for plans, h in zip(candidates, hows):
        plan = _best_of(plans, h)
        value = score(plan)
        if best is None or value < best[0]:
            best = (value, plan)
    return best[1]


def _plan_at(e, d, sliced, how: _Planning) -> StepPlan:
    """The step's plan with the samples of ``sliced`` (``(index, pieces, reason)``) run as slices; with
    ``pack_rows="auto"``, the best-scoring of the row packings (module docstring)."""
    return _best_of(_candidates_at(e, d, sliced, how), how)


def _candidates_at(e, d, sliced, how: _Planning) -> list[StepPlan]:
    """The plans :func:`_plan_at` chooses from: one, or with ``pack_rows="auto"`` one per way of forming rows."""
    if how.pack_rows == "flat":
        return [_plan_units(e, d, sliced, FLAT, how)]
    if how.pack_rows != "auto":
        return [_plan_units(e, d, sliced, (0, 0) if how.segment_pricing else None, how)]
    keep = _unsliced(len(e), sliced)
    plans = []
    for capacity in [None, (0, 0), FLAT, *_capacities(e[keep], d[keep], how.family)]:
        plan = _plan_units(e, d, sliced, capacity, how)
        if capacity is None:  # the dense planner's plan, priced per segment like the others
            plan = with_pairs(plan, e, d)
        plans.append(plan)
    return plans


def _packing_score(how: _Planning) -> Callable[[StepPlan], float]:
    return how.score or how.priced or (lambda plan: _priced_objective(plan, how.cost_model))


def _best_of(plans: list[StepPlan], how: _Planning) -> StepPlan:
    """The first of the lowest-scoring of ``plans`` (a single plan is not scored)."""
    if len(plans) == 1:
        return plans[0]
    best = None
    for value, plan in zip(_scores(_packing_score(how), plans), plans):
        if best is None or value < best[0]:
            best = (value, plan)
    return best[1]


def with_pairs(plan: StepPlan, e, d, work: dict | None = None) -> StepPlan:
    """``plan`` with the attention pairs and calls of every whole-sample piece (from its rows and the
    step's input / target lengths ``e``, ``d``): what the padding-free runtime computes. ``work`` (a dict the
    caller keeps for one step's lengths) holds each piece's :func:`~dynabatch.cost.pairs.row_work` by its rows,
    for plans that share micro-batches."""
    from dataclasses import replace

    work = {} if work is None else work  # the pieces rebuilt below keep every other field (faster than replace)
    fill_work(work, [p.row_samples for pieces in plan.replicas for p in pieces if not p.is_slice], e, d, plan.family)

    def priced(p: Piece) -> Piece:
        if p.is_slice:
            return p
        pairs, calls, longest = work[p.row_samples]
        return Piece(p.sample_ids, p.shape, p.time_s, p.token_range, p.rows, tuple(pairs), tuple(calls), tuple(longest))

    return replace(plan, replicas=tuple(tuple(priced(p) for p in pieces) for pieces in plan.replicas))


def _priced_objective(plan: StepPlan, cost_model) -> float:
    """The slowest replica's ``sum(t) + (S - 1) max(t)`` with every whole-sample piece re-priced with its
    attention pairs and calls (the DP priced pairs, not the per-call cost); slices keep their times."""
    worst = 0.0
    for r, pieces in enumerate(plan.replicas):
        if not pieces:
            continue
        times = np.array([p.time_s for p in pieces])
        whole = np.array([p.pairs is not None for p in pieces])
        if whole.any():
            shapes = np.array([p.shape for p in pieces], dtype=np.float64)[whole]
            t, _, _ = evaluate_costs(cost_model, shapes[:, 0], shapes[:, 1], shapes[:, 2], pairs=plan.pairs(r)[whole])
            times[whole] = t
        worst = max(worst, _time(times.tolist(), plan.num_stages))
    return worst


def _capacities(e, d, family) -> list[tuple[int, int]]:
    """Distinct row capacities of :data:`ROW_CAPACITIES` for samples of lengths ``(e, d)``."""
    if not len(e):
        return []
    if is_seq2seq(family):
        top = (int(e.max()), int(d.max()))
    else:
        top = (int((e + d).max()), 0)
    caps = [(max(1, int(top[0] * f)), max(1, int(top[1] * f)) if top[1] else 0) for f in ROW_CAPACITIES]
    return list(dict.fromkeys(caps))


def _plan_units(e, d, sliced, capacity, how: _Planning) -> StepPlan:
    """:func:`_plan` for one way of forming rows: ``capacity`` None (one sample per row, dense pricing), rows of
    ``capacity`` priced by their attention pairs (``(0, 0)``: one sample per row), or :data:`FLAT` (every
    micro-batch one row)."""
    keep = _unsliced(len(e), sliced)
    family, num_stages, num_replicas = how.family, how.num_stages, how.num_replicas
    partition_options = how.partition_options
    replica_pieces: list[list[Piece]] = [[] for _ in range(num_replicas)]
    whole_ids: list[tuple[tuple[int, ...], ...]] = []
    """Per replica, the units of each whole-sample micro-batch (for --zero 2's equal counts)."""
    if len(keep):
        # Fewer unsliced samples than replicas (every sample long): the DP fills as many replicas as it can,
        # the sliced samples below go to the empty ones first (their predicted time is 0).
        if capacity is None:
            rows = [(int(i),) for i in keep]
            ue, ud, options = e[keep], d[keep], partition_options
        else:
            units = (_single_units(e[keep], d[keep], family) if capacity in ((0, 0), FLAT)
                     else pack_units(e[keep], d[keep], family, capacity))
            kept = keep.tolist()
            rows = [tuple(kept[i] for i in r) for r in units.rows]
            ue, ud = units.input_lens, units.target_lens
            options = {**partition_options, "unit_pairs": units.pairs, "flat_rows": capacity == FLAT}
            if capacity == FLAT and how.flat_row is not None:
                options["max_row"] = how.flat_row
        num = min(num_replicas, len(rows))
        # --zero 2's equal counts are evened below, where token slices count (and may be halved) too
        try:
            rp = plan_replicas(ue, ud, how.cost_model, num_stages, num, family=family, equal_counts=False, **options)
        except ValueError as err:
            raise _named_sample(err, rows, e, d) from err
        unit_pairs = options.get("unit_pairs")

        def whole_pieces(groups, shapes, times) -> list[Piece]:
            grouped = [tuple(rows[i] for i in ids) for ids in groups]
            samples = [tuple(i for row in group for i in row) for group in grouped]
            if unit_pairs is None:
                return [Piece(s, tuple(shape), float(t)) for s, shape, t in zip(samples, shapes, times)]
            # the same rows give the same pairs, calls and longest: the calls and longest segments of those not
            # seen yet in one pass (rows_work)
            keys = [(capacity == FLAT, group) for group in grouped]
            laid = [(s,) if capacity == FLAT else group for s, group in zip(samples, grouped)]
            new = [k for k, key in enumerate(keys) if key not in how.row_work]
            totals = _group_sums(unit_pairs, [groups[k] for k in new])  # integers: exact in any order
            for k, total, (_, calls, longest) in zip(new, totals, rows_work([laid[k] for k in new], e, d, family)):
                how.row_work[keys[k]] = (laid[k], tuple(total), calls, longest)
            out = []
            for key, s, shape, t in zip(keys, samples, shapes, times):
                placed, total, calls, longest = how.row_work[key]
                packed = placed if any(len(row) > 1 for row in placed) else None
                out.append(Piece(s, tuple(shape), float(t), rows=packed, pairs=total, calls=calls, longest=longest))
            return out

        whole_ids = [part.micro_batches for part in rp.replicas]
        for r, part in enumerate(rp.replicas):
            replica_pieces[r] = whole_pieces(whole_ids[r], part.shapes.tolist(), part.times_s.tolist())
    # Sliced samples: longest first, whole, to the replica with the smallest predicted time.
    for i, pieces, _ in sorted(sliced, key=lambda x: (-sum(p.time_s for p in x[1]), x[0])):
        loads = [_time([p.time_s for p in rp_], num_stages) for rp_ in replica_pieces]
        replica_pieces[int(np.argmin(loads))].extend(pieces)
    if wants_equal_counts(how.cost_model) and len({len(p) for p in replica_pieces}) > 1:
        # --zero 2: whole micro-batches halved (priced as the DP prices them), token slices halved along their
        # tokens (priced by the slice model), a one-sample micro-batch of a decoder-only model cut into two token
        # slices; only whole micro-batches move between replicas (a chain stays on one)
        pricing = group_pricing(ue, ud, how.cost_model, family, options) if len(keep) else None
        whole_ids += [() for _ in range(num_replicas - len(whole_ids))]
        items = [[("whole", np.asarray(ids, dtype=np.int64)) for ids in whole_ids[r]] +
                 [("slice", p) for p in pieces if p.is_slice]
                 for r, pieces in enumerate(replica_pieces)]

        def price(xs) -> list[float]:
            return [pricing.shapes_and_times([x])[1][0] if kind == "whole" else x.time_s for kind, x in xs]

        def split(item):
            kind, x = item
            if kind == "whole" and x.size >= 2:
                return ("whole", x[: x.size // 2]), ("whole", x[x.size // 2:])
            if kind == "whole":
                if len(rows[x[0]]) > 1 or is_seq2seq(family):
                    return None
                i = rows[x[0]][0]
                x = Piece((i,), (1, int(e[i] + d[i]), 0), 0.0, (0, int(e[i] + d[i])))
            return None if (halves := _halve_slice(x, how.slice_cost_model)) is None else tuple(("slice", h) for h in halves)

        items = equalize_counts(items, price, split, movable=lambda item: item[0] == "whole")
        for r, xs in enumerate(items):
            groups = [x for kind, x in xs if kind == "whole"]
            whole = whole_pieces(groups, *(a.tolist() for a in pricing.shapes_and_times(groups))) if groups else []
            replica_pieces[r] = whole + [x for kind, x in xs if kind == "slice"]
    if how.fill_drain_order:
        replica_pieces = [_fill_drain(pieces) for pieces in replica_pieces]
    sliced_ids = [i for i, _, _ in sliced]  # and those --zero 2's equal counts cut into slices
    sliced_ids += sorted({p.sample_ids[0] for ps in replica_pieces for p in ps if p.is_slice} - set(sliced_ids))
    return StepPlan(family, num_stages, tuple(tuple(p) for p in replica_pieces), tuple(sliced_ids))


def _unsliced(n: int, sliced) -> np.ndarray:
    """The indices of the ``n`` samples that ``sliced`` (``(index, pieces, reason)``) does not run as slices."""
    everything = np.arange(n)
    return np.setdiff1d(everything, [i for i, _, _ in sliced]) if sliced else everything


def _group_sums(values, groups) -> list[list[float]]:
    """The sums of the rows of ``values`` (N, K) over each of ``groups`` (non-empty sequences of row indices), in
    one ``reduceat``."""
    if not groups:
        return []
    sizes = [len(g) for g in groups]
    ids = np.fromiter((i for g in groups for i in g), dtype=np.int64, count=sum(sizes))
    starts = np.cumsum([0, *sizes[:-1]])
    return np.add.reduceat(np.asarray(values, dtype=np.float64)[ids], starts, axis=0).tolist()


def _halve_slice(piece: Piece, slice_cost_model) -> tuple[Piece, Piece] | None:
    """A token slice cut in two along its tokens, each half priced by ``slice_cost_model`` with its context;
    ``None`` for a slice of one token (or without a slice model)."""
    lo, hi = piece.token_range
    if hi - lo < 2 or slice_cost_model is None:
        return None
    mid = lo + (hi - lo) // 2
    t, _, _ = slice_cost_model.evaluate(np.ones(2, dtype=np.int64), np.array([mid - lo, hi - mid], dtype=np.int64),
                                        np.array([lo, mid], dtype=np.int64))
    i = piece.sample_ids[0]
    return (Piece((i,), (1, mid - lo, 0), float(t[0]), (lo, mid)), Piece((i,), (1, hi - mid, 0), float(t[1]), (mid, hi)))


def _named_sample(err: ValueError, rows, e, d) -> ValueError:
    """The partition's error about ``sample K (input_len=.., target_len=..)`` of its units (rows: a GPT row is one
    sequence of inputs + targets) reworded to name the global batch's sample with its own lengths, when unit ``K``
    is one sample; ``err`` itself otherwise."""
    match = re.match(r"sample (\d+) \(input_len=\d+, target_len=\d+\)", str(err))
    if match is None or int(match.group(1)) >= len(rows) or len(rows[int(match.group(1))]) != 1:
        return err
    i = rows[int(match.group(1))][0]
    return ValueError(f"sample {i} (input_len={int(e[i])}, target_len={int(d[i])}){str(err)[match.end():]}")


def _single_units(e, d, family):
    """Every sample its own row, with its own attention pairs (per-segment pricing without packing)."""

    if is_seq2seq(family):
        ue, ud = e, d
    else:
        ue, ud = e + d, np.zeros_like(e)
    return PackedUnits(tuple((i,) for i in range(len(e))), ue, ud, sample_pairs(e, d, family))


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
