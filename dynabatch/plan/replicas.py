"""Split a global batch over ``R`` data-parallel replicas so that they finish their pipelines together.

Each replica runs its own ``S``-stage pipeline and the step ends at the gradient all-reduce, so the step
time is the *slowest* replica's ``sum(t) + (S - 1) * max(t)``. Two methods:

* ``assign`` (default): one partition DP over the whole global batch, then the micro-batches are dealt
  to replicas. The DP runs with ``S_eff = R (S - 1) + 1`` stages: a replica pays about
  ``sum(t) / R + (S - 1) max(t)``, which is ``(sum(t) + R (S - 1) max(t)) / R``, so the fill/drain term
  weighs ``R`` times more than for one pipeline and micro-batches come out smaller. Memory limits keep
  ``in_flight = S`` (each replica is an ``S``-stage 1F1B pipeline). Micro-batches are then assigned
  longest first, each to the replica whose predicted time grows least (LPT), and a local search moves
  or swaps micro-batches between the slowest replica and the others while that lowers the larger of the
  two (``_replica_kernels._refine``). If the DP yields fewer micro-batches than replicas, the slowest
  splittable micro-batch is halved (contiguously in planner order) until every replica gets one.
* ``split``: deal the samples in planner order to replicas like dealing cards (0, 1, .., R-1, R-1, .., 0)
  so that every replica gets the same length distribution, then run the DP per replica with ``S``.

Measured (N = 1024 FLAN-like samples from ``scripts/bench_planner.py``'s ``sample_lengths``, polynomial
cost model, S = 4, 16 GiB, tolerance 0.01, mean of 5 batches; imbalance = max / mean predicted replica
time; "vs 1/R" = slowest replica over the single-pipeline optimum divided by R, which no split reaches
because every replica pays its own fill/drain):

    family  R   assign: imbalance  vs 1/R   split: imbalance  vs 1/R   assign ms  split ms
    t5      2   1.00000            1.021    1.0016            1.035     9.9       4.6
    t5      4   1.00000            1.055    1.0049            1.087     9.8       3.8
    t5      8   1.00000            1.118    1.0110            1.178     9.8       4.9
    gpt2    2   1.00000            1.027    1.0004            1.034    12.4       7.1
    gpt2    4   1.00000            1.065    1.0017            1.083    11.9       5.0
    gpt2    8   1.00001            1.133    1.0036            1.167    12.2       5.1

LPT alone leaves 1.0005-1.007 imbalance (worst 1.015); the local search takes it to <= 1.00001 in
2-25 steps (< 1 ms). Running the DP with ``S_eff`` rather than ``S`` lowers the slowest replica by
0.2% (R = 2) up to 4% (T5, R = 8) and 7% (GPT, R = 8); the slowest replica lands at 0.999-1.000 of
``DP(S_eff) / R``. Replicas get different numbers of micro-batches (e.g. 28-32 each for T5 at R = 8);
the all-reduce does not need equal counts. Wall time (warm, median, 2 shared cores; R = 1: 8 / 11 ms)
is the DP over all N samples; ``split`` runs R smaller DPs and is faster but 1-5% slower in the
predicted step. Simulating 1F1B with :func:`dynabatch.plan.rowpack.order_for_fill_drain` per replica,
the replicas' makespans differ by <= 0.5% (max / mean) with ``assign``.

``R = 1`` returns exactly :func:`plan_partition`'s plan. Deterministic: the DP, the orderings, LPT and
the local search break ties by index.

**Equal counts** (``--zero 2``: the gradients are reduce-scattered after every micro-batch's backward, a
collective every replica of a stage must issue equally often): when the cost model asks for it
(``equal_micro_batch_counts``), :func:`equalize_counts` then splits micro-batches on the replicas that have
fewer, the most expensive splittable one first, into two contiguous halves priced by the cost model, until
every replica has as many as the one with the most (:func:`dynabatch.plan.step.plan_step` also counts, and
halves, token slices). Splitting the costliest keeps that replica's
``sum(t) + (S - 1) max(t)`` from growing (the halves cost about as much together and lower its ``max``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dynabatch.plan._replica_kernels import _lpt_assign, _refine, _replica_times
from dynabatch.plan.costs import MicroBatchCostModel, check_int, evaluate_costs
from dynabatch.plan.order import check_lengths, order_samples, padded_lengths
from dynabatch.plan.partition import PartitionPlan, plan_partition
from dynabatch.cost.pairs import AttentionPairs

METHODS = ("assign", "split")
REFINE_MAX_ROUNDS = 100_000
"""Safety cap on local-search steps (each strictly improves; in practice a few dozen run)."""


@dataclass(frozen=True, eq=False)
class ReplicaPlan:
    """Which data-parallel replica runs which micro-batches of one global batch."""

    family: str
    """``t5`` or ``gpt2``."""
    num_stages: int
    """Pipeline stages ``S`` of every replica."""
    method: str
    """``assign`` (one DP, then LPT + local search) or ``split`` (deal samples, DP per replica)."""
    replicas: tuple[PartitionPlan, ...]
    """Per replica (DP rank) its micro-batches as a plan; sample indices refer to the global batch."""
    times_s: np.ndarray
    """(R,) float64 predicted pipeline time of each replica, ``sum(t) + (S - 1) * max(t)``."""
    assignment: np.ndarray
    """(N,) int64 replica of each sample of the global batch."""

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def max_time_s(self) -> float:
        """Predicted step time: the slowest replica's."""
        return float(self.times_s.max())

    @property
    def imbalance(self) -> float:
        """Slowest replica time over the mean replica time (1.0 = perfectly balanced)."""
        return float(self.times_s.max() / self.times_s.mean())


def plan_replicas(
    input_lens,
    target_lens,
    cost_model: MicroBatchCostModel,
    num_stages: int,
    num_replicas: int,
    *,
    family: str,
    method: str = "assign",
    equal_counts: bool | None = None,
    **partition_options,
) -> ReplicaPlan:
    """Partition a global batch and split it over ``num_replicas`` pipelines that should finish together.

    ``partition_options`` go to :func:`plan_partition` (``order``, ``cap_tolerance``, ``max_samples``,
    ``max_tokens``, ``in_flight``; ``in_flight`` defaults to ``num_stages``; ``unit_pairs`` prices the
    runs and the replicas' micro-batches with per-segment attention). ``equal_counts``: give every replica
    the same number of micro-batches (:func:`equalize_counts`); ``None``: as the cost model's
    ``equal_micro_batch_counts`` says (``--zero 2``). Raises ``ValueError`` on bad arguments and when
    there are fewer samples than replicas.
    """
    if equal_counts is None:
        equal_counts = wants_equal_counts(cost_model)
    e, d = check_lengths(input_lens, target_lens)
    check_int("num_stages", num_stages)
    check_int("num_replicas", num_replicas)
    padded_lengths(e, d, family)  # validates family
    if method not in METHODS:
        raise ValueError(f"unknown replica method {method!r}; valid: {', '.join(METHODS)}")
    if e.size < num_replicas:
        raise ValueError(
            f"cannot split {e.size} sample(s) over num_replicas={num_replicas}: every replica needs at least "
            f"one sample; use at most {e.size} replicas or a larger global batch"
        )
    options = dict(partition_options)
    options.setdefault("in_flight", num_stages)
    if num_replicas == 1:
        plan = plan_partition(e, d, cost_model, num_stages, family=family, **options)
        return _result(family, num_stages, method, [plan], e.size)
    if method == "split":
        plans = _split_then_partition(e, d, cost_model, num_stages, num_replicas, family, options)
    else:
        plans = _partition_then_assign(e, d, cost_model, num_stages, num_replicas, family, options)
    if equal_counts and len({p.num_micro_batches for p in plans}) > 1:
        pricing = group_pricing(e, d, cost_model, family, options)
        groups = equalize_counts([[np.asarray(mb, dtype=np.int64) for mb in p.micro_batches] for p in plans],
                                 lambda gs: pricing.shapes_and_times(gs)[1])
        plans = [pricing.sub_plan(p, num_stages, gs) for p, gs in zip(plans, groups)]
    return _result(family, num_stages, method, plans, e.size)


def wants_equal_counts(cost_model) -> bool:
    """Whether ``cost_model`` asks every replica for the same number of micro-batches (``--zero 2``)."""
    return bool(getattr(cost_model, "equal_micro_batch_counts", False))


def equalize_counts(items_by_replica, price, split=None, movable=None) -> list[list]:
    """Per replica, its micro-batches split until every replica runs as many as the one with the most (module
    docstring, "Equal counts").

    Items are index arrays (samples or units, in planner order) unless ``split`` says otherwise: ``price(items) ->
    (len(items),) times``; ``split(item)``: its two halves in order, or ``None`` when it cannot be split (default:
    an array of two or more indices into contiguous halves); ``movable(item)``: may go to another replica (default:
    all). A replica short of micro-batches splits its costliest splittable item in place; one with none to split
    takes the cheapest movable item of a replica with the most (which then splits in its turn). Deterministic
    (ties by index). Raises ``ValueError`` when no splitting evens the counts."""
    split = split or _halve
    movable = movable or (lambda item: True)
    items = [list(xs) for xs in items_by_replica]
    num_replicas = len(items)
    times = [[float(t) for t in price(xs)] if xs else [] for xs in items]
    budget = 4 * (sum(len(xs) for xs in items) + num_replicas) + 64
    for _ in range(budget):
        counts = [len(xs) for xs in items]
        top = max(counts)
        short = [r for r in range(num_replicas) if counts[r] < top]
        if not short:
            return items
        r = min(short, key=lambda r: (counts[r], r))
        halves = {k: h for k, x in enumerate(items[r]) if (h := split(x)) is not None}
        if halves:
            k = max(halves, key=lambda k: (times[r][k], -k))
            items[r][k:k + 1] = list(halves[k])
            times[r][k:k + 1] = [float(t) for t in price(list(halves[k]))]
            continue
        donors = [q for q in range(num_replicas) if counts[q] == top and any(movable(x) for x in items[q])]
        if not donors:
            break
        q = min(donors)
        k = min((k for k, x in enumerate(items[q]) if movable(x)), key=lambda k: (times[q][k], k))
        items[r].append(items[q].pop(k))
        times[r].append(times[q].pop(k))
    raise ValueError(
        f"cannot give the {num_replicas} replicas the same number of micro-batches (they have "
        f"{[len(xs) for xs in items]}, and none left to split), which --zero 2 needs: raise the global batch tokens "
        "or use --zero 1"
    )


def _halve(group):
    group = np.asarray(group, dtype=np.int64)
    return None if group.size < 2 else (group[: group.size // 2], group[group.size // 2:])


def group_pricing(e, d, cost_model, family: str, options: dict) -> "_Pricing":
    """How :func:`plan_replicas` shapes and prices micro-batches (groups of the units ``e, d``) under
    ``options`` (``unit_pairs``, ``flat_rows``): padded rows, or one flat row."""
    return _Pricing(*padded_lengths(e, d, family), cost_model, options.get("unit_pairs"),
                    bool(options.get("flat_rows")))


def _result(family, num_stages, method, plans: list[PartitionPlan], n: int) -> ReplicaPlan:
    assignment = np.full(n, -1, dtype=np.int64)
    for r, p in enumerate(plans):
        assignment[p.order] = r
    assert (assignment >= 0).all(), "every sample on some replica"
    times = np.array([p.objective_s for p in plans], dtype=np.float64)
    return ReplicaPlan(family, num_stages, method, tuple(plans), times, assignment)


def _partition_then_assign(e, d, cost_model, num_stages, num_replicas, family, options) -> list[PartitionPlan]:
    effective_stages = num_replicas * (num_stages - 1) + 1
    plan = plan_partition(e, d, cost_model, effective_stages, family=family, **options)
    groups = [np.asarray(mb, dtype=np.int64) for mb in plan.micro_batches]
    pricing = group_pricing(e, d, cost_model, family, options)
    shapes, times = pricing.shapes_and_times(groups)
    while len(groups) < num_replicas:  # too few micro-batches: halve the slowest splittable one
        k = int(np.argmax(np.where(np.array([g.size for g in groups]) > 1, times, -np.inf)))
        half = len(groups[k]) // 2
        groups[k : k + 1] = [groups[k][:half], groups[k][half:]]
        shapes, times = pricing.shapes_and_times(groups)
    assign = assign_micro_batches(times, num_replicas, num_stages)
    return [pricing.sub_plan(plan, num_stages, [groups[k] for k in np.flatnonzero(assign == r)])
            for r in range(num_replicas)]


def _split_then_partition(e, d, cost_model, num_stages, num_replicas, family, options) -> list[PartitionPlan]:
    if not _each_sample_fits(e, d, cost_model, family, options):
        plan_partition(e, d, cost_model, num_stages, family=family, **options)  # raises, naming a global index
    perm = order_samples(e, d, family, options.get("order", "auto"))
    position = np.arange(perm.size)
    lap, seat = np.divmod(position, num_replicas)
    replica_of = np.where(lap % 2 == 0, seat, num_replicas - 1 - seat)  # deal 0..R-1, R-1..0, ...
    plans = []
    for r in range(num_replicas):
        index = np.sort(perm[replica_of == r])
        own = dict(options)
        if options.get("unit_pairs") is not None:
            own["unit_pairs"] = np.asarray(options["unit_pairs"])[index]
        p = plan_partition(e[index], d[index], cost_model, num_stages, family=family, **own)
        plans.append(dataclasses.replace(p, order=index[p.order]))
    return plans


def _each_sample_fits(e, d, cost_model, family, options) -> bool:
    e_pad, d_pad = padded_lengths(e, d, family)
    _, stored, peak = evaluate_costs(cost_model, np.ones_like(e_pad), e_pad, d_pad)
    fits = options["in_flight"] * stored + peak <= float(cost_model.memory_budget_bytes)
    if options.get("max_tokens") is not None:
        fits &= e_pad + d_pad <= options["max_tokens"]
    return bool(fits.all())


def assign_micro_batches(times_s, num_replicas: int, num_stages: int) -> np.ndarray:
    """Replica of each micro-batch: LPT, then the local search; minimises the slowest replica's
    ``sum(t) + (S - 1) max(t)``. ``times_s`` (M,) with ``M >= num_replicas``; returns (M,) int64."""
    times = np.asarray(times_s, dtype=np.float64)
    check_int("num_replicas", num_replicas)
    check_int("num_stages", num_stages)
    if times.ndim != 1 or times.size < num_replicas:
        raise ValueError(f"need a 1-D array of at least num_replicas={num_replicas} times, got shape {times.shape}")
    if not (np.isfinite(times).all() and (times >= 0).all()):
        raise ValueError(f"micro-batch times must be finite and >= 0, got min {times.min()} max {times.max()}")
    order = np.lexsort((np.arange(times.size), -times))  # longest first, ties by index
    assign = _lpt_assign(times, order, num_replicas, num_stages)
    _refine(times, assign, num_replicas, num_stages, REFINE_MAX_ROUNDS)
    return assign


def replica_times(times_s, assign, num_replicas: int, num_stages: int) -> np.ndarray:
    """(R,) predicted ``sum(t) + (S - 1) max(t)`` per replica for an assignment of micro-batches."""
    times = np.asarray(times_s, dtype=np.float64)
    replica = np.asarray(assign)
    check_int("num_replicas", num_replicas)
    check_int("num_stages", num_stages)
    if replica.shape != times.shape or times.ndim != 1 or not np.issubdtype(replica.dtype, np.integer):
        raise ValueError(f"need 1-D times and integer replicas of one shape, got {times.shape} and {replica.shape}")
    if replica.size and (replica.min() < 0 or replica.max() >= num_replicas):
        raise ValueError(f"replicas must lie in [0, {num_replicas}), got min {replica.min()} max {replica.max()}")
    return _replica_times(times, replica.astype(np.int64), num_replicas, num_stages)


@dataclasses.dataclass(frozen=True)
class _Pricing:
    """How micro-batches (groups of units, padded lengths ``e_pad, d_pad``) are shaped and priced, as
    :func:`~dynabatch.plan.partition.plan_partition` prices its runs: padded rows, or one flat row."""

    e_pad: np.ndarray
    d_pad: np.ndarray
    cost_model: MicroBatchCostModel
    unit_pairs: np.ndarray | None
    """(N, 3) attention pairs per unit, or None (dense pricing)."""
    flat: bool

    def shapes_and_pairs(self, groups):
        """(M, 3) int64 shapes and the :class:`~dynabatch.cost.pairs.AttentionPairs` (or None) of ``groups``."""
        padded = np.array([[g.size, self.e_pad[g].max(), self.d_pad[g].max()] for g in groups], dtype=np.int64)
        shapes = (np.array([[1, self.e_pad[g].sum(), self.d_pad[g].sum()] for g in groups], dtype=np.int64)
                  if self.flat else padded)
        if self.unit_pairs is None:
            return shapes, None

        total = np.array([np.asarray(self.unit_pairs)[g].sum(axis=0) for g in groups], dtype=np.float64).reshape(-1, 3)
        longest = (padded[:, 1], padded[:, 2]) if self.flat else None
        return shapes, AttentionPairs(total[:, 0], total[:, 1], total[:, 2], longest=longest)

    def shapes_and_times(self, groups) -> tuple[np.ndarray, np.ndarray]:
        shapes, pairs = self.shapes_and_pairs(groups)
        times, _, _ = evaluate_costs(self.cost_model, shapes[:, 0], shapes[:, 1], shapes[:, 2], pairs=pairs)
        return shapes, times

    def sub_plan(self, plan: PartitionPlan, num_stages, groups) -> PartitionPlan:
        """The micro-batches ``groups`` (in planner order) of ``plan`` as a plan of one ``S``-stage replica."""
        shapes, pairs = self.shapes_and_pairs(groups)
        times, stored, peak = evaluate_costs(self.cost_model, shapes[:, 0], shapes[:, 1], shapes[:, 2], pairs=pairs)
        return dataclasses.replace(
            plan,
            num_stages=num_stages,
            order=np.concatenate(groups).astype(np.int64),
            boundaries=np.concatenate(([0], np.cumsum([g.size for g in groups]))).astype(np.int64),
            shapes=shapes,
            times_s=times,
            stored_bytes=stored,
            peak_bytes=peak,
            objective_s=float(np.cumsum(times)[-1] + (num_stages - 1) * times.max()),
        )
