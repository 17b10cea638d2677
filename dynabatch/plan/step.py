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
from dataclasses import dataclass

import numpy as np

from dynabatch.core.packing import PACK_ROWS  # ``pack_rows`` choices, one list for the config and the planner
from dynabatch.cost.pairs import AttentionPairs, row_calls, row_longest, sample_pairs
from dynabatch.plan.costs import MicroBatchCostModel, evaluate_costs
from dynabatch.plan.order import check_lengths, padded_lengths
from dynabatch.plan.replicas import plan_replicas
from dynabatch.plan.rowpack import PackedUnits, order_for_fill_drain, pack_units
from dynabatch.plan.slice_costs import SliceCostModel
from dynabatch.plan.slicing import slice_long_samples
from dynabatch.core.sequence import is_seq2seq
from dynabatch.data.baselines import RowGroup

DEFAULT_PACK_ROWS = "device"
"""The commands' and ``TrainConfig``'s default: :func:`pack_rows_on` resolves it per device."""


def pack_rows_on(choice: str, device_type: str | None) -> str:
    """The ``pack_rows`` value the planner runs with: ``choice``, except that ``device`` is ``auto`` on a CUDA
    device and ``off`` on CPU and in ``plan``/``simulate`` (``device_type=None``). Both by measurement: on one
    H200 ``auto`` ran GPT-2 small 1.82x and T5-small 2.63x faster than ``off`` (docs/benchmarks/gpu_h200/); on this
    CPU's runtime ``off`` was as fast or faster, and simulated on the analytic presets ``auto`` was 0.986-1.020x
    of ``off`` at 3-6x the planning time (docs/algorithms/planner.md, "Row packing in the planner")."""
    if choice != "device":
        return choice
    return "auto" if device_type == "cuda" else "off"
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
    (:func:`dynabatch.runtime.planner.simulated_step_time`).

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
    how = _Planning(cost_model, num_stages, family, num_replicas, fill_drain_order, partition_options,
                    pack_rows, score, tuple(fill_scales), segment_pricing, flat_row)
    if slice_cost_model is None:
        return _plan(e, d, [], how)
    if is_seq2seq(family):
        raise ValueError(f"token slicing needs a decoder-only (causal) model, got {family!r}")
    # Which samples must run sliced is the partition's own memory test (the slice model prices one stage); with
    # activation recomputation the samples that fit whole that way are not forced into slices either.
    in_flight = partition_options.get("in_flight") or num_stages
    lens = (e + d).astype(np.float64)
    _, stored, peak = cost_model.evaluate(np.ones_like(lens), lens, np.zeros_like(lens))
    fits_whole = in_flight * np.asarray(stored) + np.asarray(peak) <= float(cost_model.memory_budget_bytes)
    decision = slice_long_samples(
        e + d, slice_cost_model, num_stages, bubble_fraction=bubble_fraction, granularity=slice_granularity,
        in_flight=in_flight, fits_whole=fits_whole if getattr(cost_model, "recompute", "none") != "none" else None,
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


def _plan(e, d, sliced, how: _Planning) -> StepPlan:
    """The best-scoring of the plans under each of ``how.fill_scales`` (:func:`_plan_at`)."""
    from dataclasses import replace

    if len(how.fill_scales) == 1:
        return _plan_at(e, d, sliced, replace(how, partition_options={**how.partition_options,
                                                                       "fill_scale": how.fill_scales[0]}))
    score = how.score or (lambda plan: plan.objective_s)
    best = None
    for scale in how.fill_scales:
        plan = _plan_at(e, d, sliced, replace(how, partition_options={**how.partition_options, "fill_scale": scale}))
        value = score(plan)
        if best is None or value < best[0]:
            best = (value, plan)
    return best[1]


def _plan_at(e, d, sliced, how: _Planning) -> StepPlan:
    """The step's plan with the samples of ``sliced`` (``(index, pieces, reason)``) run as slices; with
    ``pack_rows="auto"``, the best-scoring of the row packings (module docstring)."""
    if how.pack_rows == "flat":
        return _plan_units(e, d, sliced, FLAT, how)
    if how.pack_rows != "auto":
        return _plan_units(e, d, sliced, (0, 0) if how.segment_pricing else None, how)
    keep = np.setdiff1d(np.arange(len(e)), [i for i, _, _ in sliced])
    score = how.score or (lambda plan: _priced_objective(plan, how.cost_model))
    best = None
    for capacity in [None, (0, 0), FLAT, *_capacities(e[keep], d[keep], how.family)]:
        plan = _plan_units(e, d, sliced, capacity, how)
        if capacity is None:  # the dense planner's plan, priced per segment like the others
            plan = with_pairs(plan, e, d)
        value = score(plan)
        if best is None or value < best[0]:
            best = (value, plan)
    return best[1]


def with_pairs(plan: StepPlan, e, d) -> StepPlan:
    """``plan`` with the attention pairs and calls of every whole-sample piece (from its rows and the
    step's input / target lengths ``e``, ``d``): what the padding-free runtime computes."""
    from dataclasses import replace

    from dynabatch.cost.pairs import row_longest, row_pairs

    def priced(p: Piece) -> Piece:
        if p.is_slice:
            return p
        rows = p.row_samples
        return replace(p, pairs=row_pairs(rows, e, d, plan.family), calls=row_calls(rows, e, d, plan.family),
                       longest=row_longest(rows, e, d, plan.family))

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
    keep = np.setdiff1d(np.arange(len(e)), [i for i, _, _ in sliced])
    family, num_stages, num_replicas = how.family, how.num_stages, how.num_replicas
    partition_options = how.partition_options
    replica_pieces: list[list[Piece]] = [[] for _ in range(num_replicas)]
    if len(keep):
        # Fewer unsliced samples than replicas (every sample long): the DP fills as many replicas as it can,
        # the sliced samples below go to the empty ones first (their predicted time is 0).
        if capacity is None:
            rows = [(int(i),) for i in keep]
            ue, ud, options = e[keep], d[keep], partition_options
        else:
            units = (_single_units(e[keep], d[keep], family) if capacity in ((0, 0), FLAT)
                     else pack_units(e[keep], d[keep], family, capacity))
            rows = [tuple(int(keep[i]) for i in r) for r in units.rows]
            ue, ud = units.input_lens, units.target_lens
            options = {**partition_options, "unit_pairs": units.pairs, "flat_rows": capacity == FLAT}
            if capacity == FLAT and how.flat_row is not None:
                options["max_row"] = how.flat_row
        num = min(num_replicas, len(rows))
        try:
            rp = plan_replicas(ue, ud, how.cost_model, num_stages, num, family=family, **options)
        except ValueError as err:
            raise _named_sample(err, rows, e, d) from err
        unit_pairs = options.get("unit_pairs")
        for r, part in enumerate(rp.replicas):
            for ids, shape, t in zip(part.micro_batches, part.shapes.tolist(), part.times_s.tolist()):
                group = tuple(rows[i] for i in ids)
                samples = tuple(i for row in group for i in row)
                if unit_pairs is None:
                    replica_pieces[r].append(Piece(samples, tuple(shape), float(t)))
                else:
                    if capacity == FLAT:
                        group = (samples,)
                    total = tuple(float(x) for x in np.asarray(unit_pairs)[list(ids)].sum(axis=0))
                    packed = group if any(len(row) > 1 for row in group) else None
                    replica_pieces[r].append(Piece(samples, tuple(shape), float(t), rows=packed, pairs=total,
                                                   calls=row_calls(group, e, d, family),
                                                   longest=row_longest(group, e, d, family)))
    # Sliced samples: longest first, whole, to the replica with the smallest predicted time.
    for i, pieces, _ in sorted(sliced, key=lambda x: (-sum(p.time_s for p in x[1]), x[0])):
        loads = [_time([p.time_s for p in rp_], num_stages) for rp_ in replica_pieces]
        replica_pieces[int(np.argmin(loads))].extend(pieces)
    if how.fill_drain_order:
        replica_pieces = [_fill_drain(pieces) for pieces in replica_pieces]
    return StepPlan(family, num_stages, tuple(tuple(p) for p in replica_pieces), tuple(i for i, _, _ in sliced))


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


def _dense_pairs(shape) -> tuple[float, float, float]:
    b, e, d = (float(x) for x in shape)
    return b * e * e, b * d * d, b * d * e


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
