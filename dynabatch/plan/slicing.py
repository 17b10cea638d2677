"""Token slicing (TeraPipe, arXiv 2102.07988): cut one long decoder-only sequence into pipelined slices.

A causal model can pipeline *within* a sequence: slice ``j`` (tokens ``x_{j-1} .. x_j - 1``) attends to
its own tokens causally and to all ``c = x_{j-1}`` earlier tokens through their cached keys and values,
so one stage can run slice ``j`` while the stage before it runs slice ``j + 1``. With bottleneck-stage
slice times ``t_j = t(b, s_j, c_j)`` the sequence takes about ``sum_j t_j + (S - 1) max_j t_j`` on ``S``
stages (TeraPipe Sec. 3.3; the same form as the micro-batch objective of :mod:`.partition`). Slicing
trades a smaller bubble for per-slice overhead and for attention over a growing context.

DP. Boundaries lie on a grid of ``g`` tokens (the last slice may be shorter): ``n = ceil(L / g)``
points. All ``n (n + 1) / 2`` candidate slices are priced with ONE vectorised call to the
:class:`~dynabatch.plan.slice_costs.SliceCostModel`; slices over the memory budget get time ``inf``. As in the partition DP, a cap
``c`` on the max slice time is enumerated (the candidate slice times between the bottleneck value and
``(U - F(inf)) / (S - 1)``, thinned by ``cap_tolerance``, bisected best-first with the bound
``F(hi) + (S - 1) lo``), and under each cap ``F(c) = min sum`` comes from an O(n^2) DP that tracks the
max along its path (O(max_slices n^2) with ``max_slices``). ``cap_tolerance = 0`` is exact over all
boundary sets on the grid (tests check it against brute force).

Memory bound. Slices run their forward passes in order and their backward passes in reverse (a slice's
gradient flows into the keys and values of every earlier slice), so while slice ``j`` runs its backward
the stored activations of slices ``1 .. j`` are live. Each slice also keeps what the model's optional
``held_bytes(b, s, c)`` says (:meth:`~dynabatch.plan.slice_costs.AnalyticSliceCostModel.held_bytes`: its
in-flight buffers, loaded inputs and messages, and the concatenated context keys/values its attention saves);
``kept = stored + held``. The DP checks, for every candidate slice,

    kept(b, c_j, 0) + kept(b, s_j, c_j) + peak(b, s_j, c_j) + reserved_bytes <= memory_budget_bytes

where ``kept(b, c, 0)``, the unsliced prefix, bounds the earlier slices' stored bytes (their keys and
values included) whenever stored bytes are sub-additive along the sequence (true for both cost models
here: equal for linear terms and causal-pair terms, an over-estimate of the dense ``s (c + s)`` softmax
storage). It does not bound the earlier slices' context copies, which depend on the whole path: so the
chosen slices' real timeline, ``sum_{i <= j} kept_i + peak_j + reserved``, is checked, and where it is over
the budget the DP is solved again with the budget less the excess, and at least less what the bound missed on
a slice over the budget, so the refused chain cannot come back (at most :data:`MAX_TIGHTENINGS` times).
A model that knows its pipeline (``chain_memory``:
:meth:`~dynabatch.plan.slice_costs.AnalyticSliceCostModel.chain_memory`) gives that timeline as the schedule
validator counts it, on every stage and with the recompute modes the runtime uses (under ``full`` its peak
adds the largest block's stored bytes to the largest layer peak, more than the slice model's per-layer sum);
``SlicePlan.memory_bound_bytes`` reports it. Where that timeline refuses the chosen chain, such a model also
bounds each candidate slice that way on every stage before the budget is tightened (:func:`_stage_bounds`): the
stage whose memory binds need not be the slowest one the slice model prices. ``reserved_bytes`` is memory held
by other micro-batches in flight. Without the copies and buffers, gpt2-tiny at 0.0145 GiB planned a chain 3% over
the budget that the validator then refused mid-run.

Measured (2 shared CPU cores, warm, median; :class:`~dynabatch.plan.slice_costs.AnalyticSliceCostModel` of gpt-1.3b on a100-80gb,
slowest of 4 balanced stages = 7 blocks, one 2048-token sample, eager dense attention): unsliced
``4 t = 144.6 ms``; sliced 56.7 ms at g = 64 (8 slices, 320 .. 192 tokens, later slices shorter as
their context grows), 55.9 ms at g = 16, 55.5 ms at g = 1 (x2.6). ``attention="causal"`` gives 64.0 ms
(x2.26). plan_slices takes 0.5 ms at g = 64 and 2-6 ms at g = 16 (15-30 caps tried); g = 1 takes 1-2 s,
half of it pricing the 2.1 M candidate slices, so use g >= 8 for long sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dynabatch.cost.stages import in_flight_buffer_bytes
from dynabatch.plan._slicing_kernels import _solve_slices
from dynabatch.plan.costs import check_int, check_non_negative, evaluate_costs
from dynabatch.plan.slice_costs import SliceCostModel, slice_stage_costs

MAX_GRID_POINTS = 2048
"""Largest ``ceil(length / granularity)``: the DP holds dense (n + 1)^2 float64 matrices (33 MiB at 2048)."""
MAX_TIGHTENINGS = 8
"""Re-solves of :func:`plan_slices` with a tighter budget when the chosen slices' real timeline (context copies
on the path) exceeds the budget the DP's per-slice bound let through."""

_WHAT = "slice cost model"  # names the model in evaluate_costs' errors


# --------------------------------------------------------------------------- the DP


@dataclass(frozen=True, eq=False)
class SlicePlan:
    """Token slices of one sequence (or of ``batch_size`` sequences sliced together)."""

    length: int
    """Tokens ``L`` of the sequence."""
    batch_size: int
    """Samples ``b`` sliced together (all of length ``L``)."""
    num_stages: int
    """Pipeline stages ``S`` in the objective."""
    granularity: int
    """Slice boundaries lie on multiples of this many tokens (and at ``L``)."""
    boundaries: np.ndarray
    """(k + 1,) int64 token offsets ``0 = x_0 < ... < x_k = L``: slice ``j`` is tokens ``x_j .. x_{j+1} - 1``."""
    times_s: np.ndarray
    """(k,) float64 bottleneck-stage forward + backward time of each slice."""
    stored_bytes: np.ndarray
    """(k,) float64 activation bytes each slice stores on that stage."""
    peak_bytes: np.ndarray
    """(k,) float64 transient bytes while each slice runs."""
    memory_bound_bytes: np.ndarray
    """(k,) float64 the chain's memory while each slice runs its backward: the kept bytes (stored + held) of it and
    every earlier slice, its peak and the reserved bytes (module docstring)."""
    objective_s: float
    """Predicted time ``sum(times_s) + (num_stages - 1) * max(times_s)``."""
    unsliced_objective_s: float
    """``num_stages * t(b, L, 0)``: the whole sequence as one slice; ``inf`` if it does not fit in memory."""
    num_cap_candidates_tried: int
    """Caps on the max slice time for which the min-sum DP ran."""

    @property
    def num_slices(self) -> int:
        return len(self.times_s)

    @property
    def slice_lengths(self) -> np.ndarray:
        """(k,) int64 tokens per slice."""
        return np.diff(self.boundaries)

    @property
    def contexts(self) -> np.ndarray:
        """(k,) int64 tokens before each slice (its attention context)."""
        return self.boundaries[:-1].copy()

    @property
    def speedup(self) -> float:
        """``unsliced_objective_s / objective_s`` (``inf`` when the whole sequence does not fit)."""
        return self.unsliced_objective_s / self.objective_s


def plan_slices(
    length: int,
    cost_model: SliceCostModel,
    num_stages: int,
    *,
    batch_size: int = 1,
    granularity: int = 1,
    cap_tolerance: float = 0.0,
    max_slices: int | None = None,
    reserved_bytes: float = 0.0,
) -> SlicePlan:
    """Slice boundaries on multiples of ``granularity`` minimising ``sum(t) + (S - 1) max(t)``.

    Every slice satisfies the memory bound of the module docstring; ``reserved_bytes`` is memory other
    micro-batches hold meanwhile. Raises ``ValueError`` on bad arguments, when ``ceil(length /
    granularity)`` exceeds :data:`MAX_GRID_POINTS`, and when no slicing fits the budget (the message
    names the length, the budget and the slice that cannot fit).
    """
    for name, value in (("length", length), ("num_stages", num_stages), ("batch_size", batch_size)):
        check_int(name, value)
    check_int("granularity", granularity)
    if max_slices is not None:
        check_int("max_slices", max_slices)
    check_non_negative("cap_tolerance", cap_tolerance)
    check_non_negative("reserved_bytes", reserved_bytes)
    budget = float(cost_model.memory_budget_bytes)
    if not (np.isfinite(budget) and budget > 0):
        raise ValueError(f"cost model memory_budget_bytes must be finite and > 0, got {budget}")
    length, batch_size, granularity = int(length), int(batch_size), int(granularity)
    n = -(-length // granularity)
    if n > MAX_GRID_POINTS:
        raise ValueError(
            f"length {length} at granularity {granularity} gives {n} slice grid points, over "
            f"MAX_GRID_POINTS={MAX_GRID_POINTS}; use granularity >= {-(-length // MAX_GRID_POINTS)}"
        )

    points = np.minimum(np.arange(n + 1, dtype=np.int64) * granularity, length)
    ends, starts = np.tril_indices(n + 1, k=-1)  # slice (start i -> end j), i < j, flat index j (j-1)/2 + i
    s, c = points[ends] - points[starts], points[starts]
    t, stored, peak = evaluate_costs(cost_model, np.full_like(s, batch_size), s, c, what=_WHAT, axes=("s", "c"))
    held = getattr(cost_model, "held_bytes", None)  # in-flight buffers and context copies (module docstring)
    kept = stored if held is None else stored + held(np.full_like(s, batch_size), s, c)
    prefix = np.concatenate(([0.0], kept[starts == 0]))  # kept(b, x_i, 0) at grid point i
    memory = prefix[starts] + kept + peak + float(reserved_bytes)
    T = np.full((n + 1, n + 1), np.inf)
    chain = getattr(cost_model, "chain_memory", None)  # the validator's own accounting, when the model has it
    slack, every_stage = 0.0, False
    for _ in range(MAX_TIGHTENINGS):
        T[ends, starts] = np.where(memory + slack <= budget, t, np.inf)
        path, objective, num_tried = _solve_slices(T, int(num_stages), float(cap_tolerance), int(max_slices or n))
        if path.size == 0:
            _raise_infeasible(length, batch_size, granularity, max_slices, budget, reserved_bytes, T, points,
                              memory + slack, _recompute_advice(cost_model))
        flat = path[1:] * (path[1:] - 1) // 2 + path[:-1]
        # the chain's real timeline: slice j's backward runs with slices 0..j stored (their own copies included)
        timeline = chain(batch_size, points[path[1:]] - points[path[:-1]], points[path[:-1]]) if chain else None
        exact = (np.cumsum(kept[flat]) + peak[flat] if timeline is None else timeline) + float(reserved_bytes)
        over = float(exact.max()) - budget
        if over <= 0:
            break
        if not every_stage:  # the bound on every stage: priced only once a chain is refused (2.5x the DP's time)
            every_stage, bound = True, _stage_bounds(cost_model, batch_size, s, c, starts)
            if bound is not None:
                memory = np.maximum(memory, bound + float(reserved_bytes))
                continue
        # at least what the bound under-counted on a slice over the budget, so that slice is refused next time
        # (the overrun alone can be smaller than the bound's gap below the budget: the same path again)
        refused = exact > budget
        slack = max(slack + over, float((exact - memory[flat])[refused].min()))
    else:
        raise ValueError(f"sequence of length {length} (batch_size {batch_size}): no slicing at granularity "
                         f"{granularity} found within the activation memory budget of {budget / 2**30:.3f} GiB after "
                         f"{MAX_TIGHTENINGS} tightenings; raise the budget{_recompute_advice(cost_model)} or use more "
                         "pipeline stages")
    whole = n * (n - 1) // 2  # slice (0 -> n)
    unsliced = t[whole] + (num_stages - 1) * t[whole] if memory[whole] <= budget else np.inf
    return SlicePlan(
        length=length,
        batch_size=batch_size,
        num_stages=int(num_stages),
        granularity=granularity,
        boundaries=points[path],
        times_s=t[flat],
        stored_bytes=stored[flat],
        peak_bytes=peak[flat],
        memory_bound_bytes=exact,
        objective_s=float(objective),
        unsliced_objective_s=float(unsliced),
        num_cap_candidates_tried=int(num_tried),
    )


def _raise_infeasible(length, batch_size, granularity, max_slices, budget, reserved, T, points, memory,
                      advice: str = "") -> None:
    """``ValueError`` naming the first token no fitting slice reaches, and that slice's memory."""
    n = T.shape[0] - 1
    reach = np.zeros(n + 1, dtype=bool)
    reach[0] = True
    for j in range(1, n + 1):
        reach[j] = bool(np.any(reach[:j] & np.isfinite(T[j, :j])))
    gib = 2.0**30
    where = f"sequence of length {length} (batch_size {batch_size})"
    if reach[n]:  # reachable, so only max_slices is in the way
        raise ValueError(
            f"{where} needs more than max_slices={max_slices} slices of granularity {granularity} to fit the "
            f"activation memory budget of {budget / gib:.3f} GiB; raise max_slices or the budget"
        )
    frontier = int(np.flatnonzero(reach).max())
    flat = (frontier + 1) * frontier // 2 + frontier  # the smallest slice from the frontier, (frontier -> +1)
    raise ValueError(
        f"{where} does not fit the activation memory budget of {budget / gib:.3f} GiB ({int(budget)} bytes, "
        f"reserved {reserved / gib:.3f} GiB) even when sliced at granularity {granularity}: no slice reaches "
        f"past token {int(points[frontier])}; the smallest, tokens [{int(points[frontier])}, "
        f"{int(points[frontier + 1])}), needs {memory[flat] / gib:.3f} GiB (stored prefix + its stored + "
        f"peak + reserved). Use more pipeline stages, a larger budget{advice} or shorter sequences"
    )


def _recompute_advice(cost_model) -> str:
    """``, --recompute full`` where the slices are priced storing every activation but could be recomputed: under
    ``--recompute`` none, auto and selective the slice model prices none (the safe side, ``from_stage_model``),
    under ``full`` it prices and the runtime runs the slices' blocks recomputed. GPT-1.3B on 4 stages at 16 GiB
    fits a 7,038-token sample of the long tail only so, and the refusal named stages, budget and lengths alone."""
    model = getattr(cost_model, "model", None)
    return "" if getattr(model, "recompute", True) else ", --recompute full (the slices' blocks then recompute)"


# --------------------------------------------------------------------------- which samples to slice


@dataclass(frozen=True, eq=False)
class SliceDecision:
    """Samples of a batch that should run token-sliced, with their plans (sample order, ascending)."""

    sample_indices: np.ndarray
    """(K,) int64 indices into the ``lengths`` given, ascending."""
    plans: tuple[SlicePlan, ...]
    """Slice plan of each of those samples (``batch_size = 1``)."""
    reasons: tuple[str, ...]
    """``memory`` (the whole sample does not fit) or ``bubble`` (its unsliced bubble is too large)."""
    step_time_s: float
    """Step-time estimate the bubble threshold was taken from."""
    threshold_s: float
    """``bubble_fraction * step_time_s``: samples with ``(S - 1) t(1, L, 0)`` above it were considered."""

    def plan_of(self, sample_index: int) -> SlicePlan | None:
        """The slice plan of ``sample_index``, ``None`` if it runs whole."""
        k = np.searchsorted(self.sample_indices, sample_index)
        if k < len(self.sample_indices) and self.sample_indices[k] == sample_index:
            return self.plans[k]
        return None


def _stage_bounds(cost_model, batch_size: int, s: np.ndarray, c: np.ndarray, starts: np.ndarray) -> np.ndarray | None:
    """(P,) the per-slice bound of the module docstring on every stage of the pipeline, as the validator counts
    a slice (:func:`~dynabatch.plan.slice_costs.slice_stage_costs` of the model's ``stages``: recompute modes,
    in-flight buffers, context copies), the largest over the stages; ``None`` for a model without ``stages``.

    The slice model prices one stage, the slowest; the stage whose memory binds can be another one (the LM
    head's logits on the last stage): on gpt2-mini over 2 stages the DP's bound for a 427-token sample stayed
    under 12 MiB of a 28 MiB budget while the last stage's real timeline was over it, and no additive tightening
    of the budget could tell the slices that fit (short ones: the logits scale with the slice) from those that
    did not, so ``--slice-long`` refused a sample that small slices run within the budget."""
    stages = getattr(cost_model, "stages", None)
    if stages is None:
        return None
    lengths, inverse = np.unique(s, return_inverse=True)  # a slice's unsliced costs depend on its length alone
    whole = stages.per_stage(np.full(lengths.shape, float(batch_size)), lengths.astype(np.float64),
                             np.zeros(lengths.shape))
    per_slice = dataclasses.replace(whole, **{f.name: getattr(whole, f.name)[:, inverse]
                                              for f in dataclasses.fields(whole) if getattr(whole, f.name) is not None})
    costs = slice_stage_costs(per_slice, cost_model, np.full(s.shape, batch_size), s, c, memory_only=True)
    kept = costs.stored_bytes + in_flight_buffer_bytes(costs)  # (S, P)
    prefix = np.concatenate([np.zeros((kept.shape[0], 1)), kept[:, starts == 0]], axis=1)  # (S, n + 1)
    return (prefix[:, starts] + kept + costs.peak_bytes).max(axis=0)


def slice_long_samples(
    lengths: Sequence[int] | np.ndarray,
    cost_model: SliceCostModel,
    num_stages: int,
    *,
    bubble_fraction: float = 0.1,
    step_time_s: float | None = None,
    granularity: int = 16,
    cap_tolerance: float = 0.0,
    max_slices: int | None = None,
    reserved_bytes: float = 0.0,
    in_flight: int = 1,
    fits_whole: np.ndarray | None = None,
    must_slice: np.ndarray | None = None,
) -> SliceDecision:
    """Which samples to token-slice, and how: those that do not fit in memory whole (they must be
    sliced; ``in_flight`` copies of the stored activations plus the peak, the partition planner's
    test, so a sample left whole always fits its micro-batch), and those whose unsliced bubble ``(S - 1) t(1, L, 0)`` exceeds ``bubble_fraction *
    step_time_s`` when slicing lowers their own objective.

    ``step_time_s`` defaults to ``sum_i t_i + (S - 1) max_i t_i`` over the unsliced samples (one
    micro-batch each: a pessimistic step time); pass the partition planner's objective instead when
    known. Samples of one length share one plan. Raises ``ValueError`` naming the sample when one
    cannot be made to fit. ``fits_whole``: optional (N,) bools, the samples the partition planner can run
    whole anyway (with activation recomputation, :mod:`dynabatch.cost.recompute`): they are never forced
    into slices, and one the slicer cannot cut stays whole. ``must_slice``: optional (N,) bools, the samples
    the partition planner cannot run whole: forced into slices even where this model's own test keeps them
    whole (it prices one stage's blocks, the partition every stage of a whole micro-batch; under ``full``
    recompute they differ by a few percent, and a sample left whole between the two was refused).
    """
    lens = np.asarray(lengths)
    if lens.ndim != 1 or lens.size == 0 or not np.issubdtype(lens.dtype, np.integer) or lens.min() < 1:
        raise ValueError(f"lengths must be a non-empty 1-D sequence of ints >= 1, got {lengths!r:.200}")
    check_int("num_stages", num_stages)
    if not (np.isfinite(bubble_fraction) and bubble_fraction > 0):
        raise ValueError(f"bubble_fraction must be finite and > 0, got {bubble_fraction}")
    lens = lens.astype(np.int64)
    unique, inverse = np.unique(lens, return_inverse=True)
    t, stored, peak = evaluate_costs(
        cost_model, np.ones_like(unique), unique, np.zeros_like(unique), what=_WHAT, axes=("s", "c")
    )
    check_int("in_flight", in_flight)
    fits = in_flight * stored + peak + reserved_bytes <= float(cost_model.memory_budget_bytes)
    if fits_whole is not None:  # samples of one length share a shape: any of them stands for all
        whole = np.zeros(len(unique), dtype=bool)
        np.logical_or.at(whole, inverse, np.asarray(fits_whole, dtype=bool))
        fits = fits | whole
    if must_slice is not None:
        forced = np.zeros(len(unique), dtype=bool)
        np.logical_or.at(forced, inverse, np.asarray(must_slice, dtype=bool))
        fits = fits & ~forced
    if step_time_s is None:
        step_time_s = float(t[inverse].sum() + (num_stages - 1) * t.max())
    if not (np.isfinite(step_time_s) and step_time_s > 0):
        raise ValueError(f"step_time_s must be finite and > 0, got {step_time_s}")
    threshold = bubble_fraction * step_time_s
    plans: dict[int, tuple[SlicePlan, str]] = {}
    for u in np.flatnonzero(~fits | ((num_stages - 1) * t > threshold)):
        try:
            plan = plan_slices(
                int(unique[u]), cost_model, num_stages, granularity=granularity, cap_tolerance=cap_tolerance,
                max_slices=max_slices, reserved_bytes=reserved_bytes,
            )
        except ValueError as err:
            if fits[u]:  # a bubble candidate that cannot be cut runs whole
                continue
            first = int(np.flatnonzero(lens == unique[u])[0])
            raise ValueError(f"sample {first}: {err}") from err
        if not fits[u]:
            plans[int(u)] = (plan, "memory")
        elif plan.num_slices > 1 and plan.objective_s < plan.unsliced_objective_s:
            plans[int(u)] = (plan, "bubble")
    chosen = np.flatnonzero(np.isin(inverse, list(plans)))
    picked = [plans[int(inverse[i])] for i in chosen]
    return SliceDecision(
        sample_indices=chosen.astype(np.int64),
        plans=tuple(p for p, _ in picked),
        reasons=tuple(r for _, r in picked),
        step_time_s=float(step_time_s),
        threshold_s=float(threshold),
    )
