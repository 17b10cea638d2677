"""``dynabatch simulate``: plan and schedule global batches with every method, simulate each step.

For each method (the dynamic planner and every baseline) and each global batch: micro-batches ->
per-stage costs (the analytic model, or ``--cost-profile``'s measured tables), attention priced per segment as the padding-free runtime computes it (each
sample's own block of every row, :attr:`~dynabatch.training.workload.MethodPlan.pairs`) -> :func:`~dynabatch.schedule.policies.choose_schedule` (GPipe, 1F1B and the
memory-aware adaptive policy over a few micro-batch orders) -> simulated step. Prints per method:
real tokens/s (real tokens / simulated step time), padding efficiency (real / computed tokens),
bubble fraction, the busiest stage's utilisation, peak memory per device (and whether every step
fits: the check ``plan`` makes too, :mod:`dynabatch.commands.scheduled`), the policies chosen, schedule wall
time, and

    efficiency = ideal / simulated step time,  ideal = sum over samples of the sample's own unpadded
    (b = 1, E = e_i, D = d_i) fwd + bwd time on its bottleneck stage (the slowest stage for that sample).

``ideal`` ignores pipeline fill and drain (a perfectly padded step still loses its bubble), but it also
charges every sample its own kernel launches and weight reads, which batching amortises: with the
analytic A100 model a b = 1 sample costs 1.2-1.4x (GPT) and 2-4x (T5, short targets) its share of a
large batch, so efficiencies above 1 are common. ``efficiency_amortised`` prices each sample as its
share of a batch of identical copies (~8k tokens) instead: the stricter number to read next to the
bubble fraction.

Dynamic planner options: ``--objective-stages`` (default ``S,2``) plans each step with the objective
``sum(t) + (S' - 1) max(t)`` for every listed ``S'`` and keeps the plan whose schedule simulates
fastest (the adaptive schedule hides most of a large micro-batch's fill behind other work, so a smaller
max penalty than the real ``S - 1`` often wins); one-sample micro-batches only need to fit alone
(:class:`SingleSampleRelief`), since the adaptive policy admits micro-batches by actual memory.

``--methods`` picks the methods (default: ``dynamic`` and every baseline of the registry); the ratio line is
the faster of ``dynamic`` and ``dynamic_sliced`` among those that fit (none, said plainly, when neither does);
``--tune-baselines`` also simulates each baseline at every value of its knob's grid and reports its
fastest setting that fits memory next to the default (:mod:`dynabatch.commands.tuning`). The table and ``--json``
are :mod:`dynabatch.commands.simulate_report`'s; a method with micro-batches beyond a ``--cost-profile``'s grid
reads ``n/a`` there, as in ``plan`` and ``bench``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np

from dynabatch.core.allocator import keep_freed_memory
from dynabatch.commands.common import OFF_GRID_NOTE, check_output_file, dynamic_left_out, placement_cost_model, split_from_data, write_json, add_workload_arguments, check_positive, compared_methods, method_recompute, resolve
from dynabatch.training.config.flags import add_fields, add_sections
from dynabatch.training.config.placement_choice import pick_placement, placement_candidates
from dynabatch.training.config.sections import arg
from dynabatch.cost.planner_model import UNPRICED
from dynabatch.plan.ideal import AMORTISED_TOKENS, ideal_step_time
from dynabatch.plan.slice_costs import AnalyticSliceCostModel, piece_costs
from dynabatch.plan.step import DEFAULT_PACK_ROWS, with_pairs
from dynabatch.schedule.placement import Placement
from dynabatch.core.sequence import is_seq2seq
from dynabatch.core.methods import DYNAMIC_SLICED, is_planner
from dynabatch.training.workload import global_batches, kept_limits, method_micro_batches
from dynabatch.schedule.virtual import placed_step
from dynabatch.commands.scheduled import memory_limit_bytes, schedule_pieces, schedule_plan, send_times
from dynabatch.commands.simulate_report import MethodSummary, off_grid, print_table, summary as simulate_summary
from dynabatch.commands.simulate_traces import TRACED_METHODS, check_trace_dir, write_traces
from dynabatch.commands.tuning import Tuned, tune, tune_baselines_arg


@dataclass(frozen=True)
class SimulateArgs:
    """``simulate``'s own flags (the workload's are :mod:`dynabatch.commands.common`'s)."""

    _argument_group_name = "simulation"

    in_flight: int | None = arg(None, "dynamic planner: micro-batches assumed live per stage (default: stages; "
                                      "one-sample micro-batches only need to fit alone)")
    cap_tolerance: float = arg(0.01, "dynamic planner: cap thinning tolerance")
    max_samples: int | None = arg(None, "dynamic planner: samples per micro-batch at most")
    link: Literal["intra", "inter"] = arg("intra", "link between pipeline neighbours")
    objective_stages: str = arg("S,2", "dynamic planner: comma list of S' for the objective sum(t) + (S'-1) max(t) "
                                       "('S': the real stages); each is planned and scheduled and the shortest "
                                       "simulated step is kept")
    search_steps: int = arg(24, "local-search moves per step in choose_schedule")
    trace_dir: str | None = arg(None, "write Chrome traces (.json, open in Perfetto) and PNG timelines of the first "
                                      "global batch for the dynamic and packing methods, on the linear placement "
                                      "(--placement auto: where it picks linear)")
    tune_baselines: bool = tune_baselines_arg("simulate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    add_fields(p, ["slice_long", "placement"])  # train's --placement: the same choices, auto included
    add_sections(p, [SimulateArgs])


@dataclass(frozen=True)
class SimulateOptions:
    """How the dynamic planner and the scheduler run in ``dynabatch simulate``."""

    in_flight: int | None = None
    """Dynamic planner: micro-batches assumed live per stage (``None``: the number of stages)."""
    cap_tolerance: float = 0.01
    """Dynamic planner: relative thinning of the caps on the largest micro-batch time."""
    max_samples: int | None = None
    """Dynamic planner: samples per micro-batch at most."""
    objective_stages: tuple[int | None, ...] = (None, 2)
    """Dynamic planner: ``S'`` of the objective ``sum(t) + (S' - 1) max(t)`` (``None``: the real number of
    stages). Each value is planned and scheduled; the step keeps the shortest simulated one. ``2`` helps
    because the adaptive schedule hides most of a large micro-batch's fill behind other work."""
    link: str = "intra"
    """Link between pipeline neighbours (``intra`` or ``inter`` node)."""
    search_steps: int = 24
    """Local-search moves of ``choose_schedule`` per step."""
    pack_rows: str = DEFAULT_PACK_ROWS
    """Dynamic planner: ``auto`` also plans with packed rows (per-segment pricing), ``off`` does not."""
    slice_long: bool = False
    """Dynamic planner, decoder-only: cut samples that dominate the bubble or do not fit into token slices
    (TeraPipe), priced with their context and scheduled as chains (on every chunk of a placement), as
    ``train --slice-long``."""

    def __post_init__(self) -> None:
        if not self.objective_stages or any(v is not None and v < 1 for v in self.objective_stages):
            raise ValueError(f"objective_stages must be a non-empty list of ints >= 1, got {self.objective_stages}")
        if self.search_steps < 0:
            raise ValueError(f"search_steps must be >= 0, got {self.search_steps}")


def run(args: argparse.Namespace) -> int:
    keep_freed_memory()  # the planner's numpy temporaries reuse mapped pages (dynabatch.core.allocator)
    check_positive(args, "in_flight", "max_samples")
    check_output_file(args.json, command="simulate")
    if not (np.isfinite(args.cap_tolerance) and args.cap_tolerance >= 0):
        raise ValueError(f"--cap-tolerance must be a finite number >= 0, got {args.cap_tolerance}")
    w = simulation_workload(resolve(args))
    methods = compared_methods(args.methods, w.family, args.model, args.cost_profile)
    check_trace_dir(args.trace_dir, methods, args.placement)
    if args.slice_long and is_seq2seq(w.family):
        raise ValueError("--slice-long cuts decoder-only samples into token slices; drop it, or use --model gpt")
    if args.moving_boundaries and args.placement not in ("linear", "auto"):
        raise ValueError(f"--moving-boundaries moves the cuts of a linear layout; --placement {args.placement} has "
                         "several chunks per device: use --placement linear or drop --moving-boundaries")
    batches = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, args.num_batches, args.tokenizer)
    # rows and budgets of the baselines as long as the longest kept sample, not the (maybe far longer) limit
    w = dataclasses.replace(w, limits=kept_limits(w.limits, batches))
    options = SimulateOptions(
        in_flight=args.in_flight, cap_tolerance=args.cap_tolerance, max_samples=args.max_samples,
        objective_stages=_objective_stages(args.objective_stages),
        link=args.link, search_steps=args.search_steps, pack_rows=args.pack_rows, slice_long=args.slice_long,
    )
    stages = w.cost_model.num_stages
    candidates = [Placement.parse(name, stages) for name in  # moving boundaries: the linear placement alone
                  placement_candidates("linear" if args.moving_boundaries else args.placement, stages,
                                       is_seq2seq(w.family))]
    rows, split, placed, left_out = {}, {}, {}, {}
    for method in methods:  # --layer-split data: each method's split balanced over its own micro-batches
        split[method] = split_from_data(w, batches, method) if args.layer_split == "data" else w
        # --placement auto: the trace is drawn once the linear placement is picked (else it shows a run not reported)
        trace_dir = args.trace_dir if method in TRACED_METHODS and len(candidates) == 1 else None
        tried = {}  # --placement auto: each candidate simulated, the one pick_placement takes kept
        try:
            for placement in candidates:
                own = None
                if placement.kind != "linear":
                    own = Placed(placement, placement_cost_model(split[method], batches, method, placement))
                tried[placement.describe()] = (own, simulate_method(method, batches, split[method], options,
                                                                    trace_dir=trace_dir, placed=own))
        except ValueError as e:  # a sample the planner cannot admit even alone
            if (line := dynamic_left_out(method, methods, e)) is None:
                raise
            left_out[method] = line  # said once every other method has run (else their error alone)
            continue
        name = pick_placement({k: float("inf") if r.priced_off_grid else r.step_s for k, (_, r) in tried.items()},
                              {p.describe(): p.chunks_per_device for p in candidates})
        placed[method], rows[method] = tried[name][0], dataclasses.replace(tried[name][1], placement=name)
        if args.trace_dir and method in TRACED_METHODS and len(candidates) > 1:
            _trace_picked(args.trace_dir, method, name, batches, split[method], options)
    tuned = {}
    if args.tune_baselines:
        def resplit(m):  # each knob value on its own layer split, as its default (--layer-split data)
            return (lambda tried: split_from_data(tried, batches, m)) if args.layer_split == "data" else None

        tuned = {m: tune_simulated(m, batches, split[m], options, rows[m], placed[m], resplit(m))
                 for m in methods if not is_planner(m)}
    for line in left_out.values():
        print(f"warning: {line}", file=sys.stderr)
    summary = simulate_summary(args, w, batches, rows, tuned, left_out)
    if args.json and write_json(summary, args.json, command="simulate"):
        return 0
    print_table(summary, rows, tuned)
    return 0


def simulation_workload(w):
    """``w`` (a resolved Workload) as ``simulate`` plans it: one-sample micro-batches need only fit alone
    (:class:`SingleSampleRelief`), also when their activation recomputation is chosen."""
    return dataclasses.replace(w, cost_model=dataclasses.replace(w.cost_model, single_sample_alone=True))


def _objective_stages(text: str) -> tuple[int | None, ...]:
    values = []
    for v in text.split(","):
        v = v.strip()
        if v != "S" and not v.isdigit():
            raise ValueError(f"--objective-stages takes a comma list of ints or 'S', got {text!r}")
        values.append(None if v == "S" else int(v))
    return tuple(values)


def simulate_method(method: str, batches, w, options: SimulateOptions = SimulateOptions(),
                    trace_dir: str | None = None, placed=None) -> MethodSummary:
    """Plan, schedule and simulate every global batch with one method (``w``: a resolved Workload). With
    ``placed`` (a :class:`Placed`), the plans are priced per chunk and list-scheduled on its placement."""

    if method == DYNAMIC_SLICED:  # the planner with token slices: --slice-long for this method
        options = dataclasses.replace(options, slice_long=True)
    w = dataclasses.replace(w, cost_model=dataclasses.replace(w.cost_model, recompute=method_recompute(method, w)))
    cm = w.cost_model
    ideal_model = dataclasses.replace(cm, recompute="none")  # the ideal never recomputes
    real = computed = micro = sliced = 0
    steps, ideals, amortised, balanced, bubbles, utils, peaks, sched_wall, plan_wall = [], [], [], [], [], [], [], [], []
    busy, busy_total = [], 0.0
    fits, policies = True, {}
    for k, batch in enumerate(batches):
        if placed is None:
            plan, schedule, result, plan_s, sched_s = simulate_step(method, batch, w, options)
            policy = schedule.policy
        else:
            plan, result, plan_s, sched_s = placed.step(method, batch, w, options)
            policy = f"{placed.placement.describe()} {result.policy}"
        sched_wall.append(sched_s)
        plan_wall.append(plan_s)
        real += plan.real_tokens
        computed += plan.computed_tokens
        micro += plan.num_micro_batches
        sliced += plan.num_sliced_samples
        steps.append(result.makespan_s)
        ideals.append(ideal_step_time(batch, ideal_model, w.family))
        amortised.append(ideal_step_time(batch, ideal_model, w.family, amortise_tokens=AMORTISED_TOKENS))
        balanced.append(ideal_step_time(batch, ideal_model, w.family, amortise_tokens=AMORTISED_TOKENS, balanced=True))
        busy.append(result.busy_s / result.makespan_s)
        busy_total += float(np.sum(result.busy_s))
        bubbles.append(result.bubble_fraction)
        utils.append(float(result.busy_s.max()) / result.makespan_s)
        peaks.append(float(result.peak_memory_bytes.max()))
        fits &= result.fits_memory
        policies[policy] = policies.get(policy, 0) + 1
        if trace_dir and k == 0 and placed is None:
            write_traces(trace_dir, method, result, plan.shapes)
    return off_grid(MethodSummary(
        method=method, real_tokens=real, computed_tokens=computed, micro_batches=micro, sliced_samples=sliced,
        step_s=float(np.mean(steps)), ideal_s=float(np.mean(ideals)), tokens_per_s=real / float(np.sum(steps)),
        padding_efficiency=real / computed, efficiency=float(np.sum(ideals) / np.sum(steps)),
        # a cost profile prices no batch beyond its grid (UNPRICED): no amortised efficiency rather than ~1e30
        efficiency_amortised=_priced(np.sum(amortised) / np.sum(steps), amortised),
        efficiency_balanced=_priced(np.sum(balanced) / np.sum(steps), balanced),
        work_efficiency=_priced(np.sum(balanced) * len(busy[0]) / busy_total, balanced),
        busy_fraction=busy_total / len(busy[0]) / float(np.sum(steps)),
        stage_busy=tuple(float(x) for x in np.mean(busy, axis=0)),
        layout=(cm if placed is None else placed.cost_model).layout.describe(),
        bubble_fraction=float(np.mean(bubbles)), bottleneck_utilisation=float(np.mean(utils)),
        peak_memory_gib=max(peaks) / 2**30, fits_memory=bool(fits),
        policies=policies, schedule_ms_median=1e3 * float(np.median(sched_wall)),
        schedule_ms_max=1e3 * float(np.max(sched_wall)), plan_ms_median=1e3 * float(np.median(plan_wall)),
    ), steps, peaks)  # a price beyond a cost profile's grid: n/a, not ~1e30 s


def _priced(value, ideals) -> float | None:
    """``value``, a ratio of the ideal steps ``ideals``, or ``None`` when one of them is beyond a cost profile's
    grid (:data:`~dynabatch.cost.planner_model.UNPRICED`: the amortised copies of a sample, ~8k tokens, outgrow its
    batch sizes), as ``train`` and ``bench`` leave such efficiencies out."""
    return None if max(ideals) >= UNPRICED else float(value)


def simulate_step(method: str, batch, w, options: SimulateOptions = SimulateOptions()):
    """``(plan, schedule, result, plan wall s, schedule wall s)`` of one global batch with one method.

    The dynamic method is planned once per ``options.objective_stages`` value; the plan whose chosen
    schedule fits memory and has the smallest makespan is kept (wall times add up over the variants).
    """

    cm = w.cost_model
    variants = [None] if not is_planner(method) else list(dict.fromkeys(
        cm.num_stages if v is None else min(v, cm.num_stages) for v in options.objective_stages))
    # auto recomputation is judged like the objective: the plan without recomputation (when it can be made) is
    # a variant too, so the kept step is never slower than --recompute none's (the DP's objective is not the
    # simulated step: admitting more micro-batches can lose a little). It is tried even when the auto plan
    # recomputes nothing: under auto a baseline candidate is priced with the recomputation its micro-batches need
    # to fit S in flight, without it as the baseline runs (the schedule admits by actual memory), so the two can
    # keep different candidates (T5-3B at 1,024 tokens, scripts/simulate_papers.py: 0.99x tuned packing_free
    # when this variant was skipped, 1.00x with it).
    models = [cm] if cm.recompute != "auto" else [cm, dataclasses.replace(cm, recompute="none")]
    best, plan_s, sched_s = None, 0.0, 0.0
    for objective_stages, model in [(v, m) for v in variants for m in models]:
        try:
            plan = _plan(method, batch, dataclasses.replace(w, cost_model=model), options, objective_stages)
        except ValueError:
            if model is cm:
                raise
            continue  # a sample that fits only with recomputation
        plan_s += plan.plan_time_s
        # per-segment (padding-free) attention; token slices priced with their context, scheduled as chains; the
        # memory check plan makes too (dynabatch.commands.scheduled)
        start = time.perf_counter()
        schedule, result = schedule_plan(model, _slicer(model, options, w), plan, batch.step, link=options.link,
                                         search_steps=options.search_steps)
        sched_s += time.perf_counter() - start
        key = (not result.fits_memory, result.makespan_s)
        if best is None or key < best[0]:
            best = (key, plan, schedule, result)
    _, plan, schedule, result = best
    return plan, schedule, result, plan_s, sched_s


@dataclass(frozen=True)
class Placed:
    """A placement of virtual stages (``--placement cyclic`` / ``interleaved:V``) and the per-chunk cost model of
    its layout: the method plans with the workload's one-chunk-per-device model (what a device holds and runs),
    then each plan is priced per chunk and ordered by the shortest of the list scheduler, interleaved 1F1B and the
    wait-free cyclic order (:func:`~dynabatch.schedule.virtual.placed_step`)."""

    placement: object
    cost_model: object
    """StageCostModel over the placement's chunks (no recomputation: a chunk's view of memory is the device's)."""

    def step(self, method: str, batch, w, options):
        """``(plan, result, plan wall s, schedule wall s)`` of one global batch."""

        cm, stages = self.cost_model, w.cost_model.num_stages
        variants = [stages] if not is_planner(method) else list(dict.fromkeys(
            stages if v is None else min(v, stages) for v in options.objective_stages))
        best, plan_s, sched_s = None, 0.0, 0.0
        for objective_stages in variants:  # as simulate_step: the shortest simulated step that fits is kept
            plan = _plan(method, batch, w, options, objective_stages)
            plan_s += plan.plan_time_s
            costs = piece_costs(cm, _slicer(cm, options, w), plan.shapes, plan.contexts, plan.slice_links, plan.pairs)
            send = send_times(cm, costs.send_bytes, options.link)
            start = time.perf_counter()
            result = placed_step(costs, self.placement, cm.model_state_bytes,
                                 memory_limit_bytes(cm), send, links=plan.slice_links)
            sched_s += time.perf_counter() - start
            key = (not result.fits_memory, result.makespan_s)
            if best is None or key < best[0]:
                best = (key, plan, result)
        return best[1], best[2], plan_s, sched_s


def _plan(method: str, batch, w, options: SimulateOptions, objective_stages: int | None):

    stages = w.cost_model.num_stages
    if not is_planner(method):
        return method_micro_batches(method, batch, w.limits, w.cost_model, stages, w.options)
    in_flight = stages if options.in_flight is None else options.in_flight
    view = SingleSampleRelief(w.cost_model, in_flight)
    return method_micro_batches(method, batch, w.limits, view, objective_stages, w.options, in_flight=in_flight,
                                cap_tolerance=options.cap_tolerance, max_samples=options.max_samples,
                                pack_rows=options.pack_rows, slice_cost_model=_slicer(w.cost_model, options, w),
                                price=_simulated_price(w, batch, options))


def _simulated_price(w, batch, options: SimulateOptions):
    """The price of a candidate plan (:mod:`dynabatch.plan.candidates`) in ``simulate``: its simulated makespan
    under the schedule :func:`simulate_step` would give it (``choose_schedule``: every policy and order, then the
    seeded search), per segment (token slices with their contexts and chains), with the workload's link and
    memory limit (``inf`` when it does not fit). Priced
    under the adaptive schedule alone, a baseline's plan of many small micro-batches looked slower than the DP's
    although its best schedule was faster: T5-large at 4,096 tokens kept the DP's plan and simulated at 0.96x the
    tuned ``packing_free`` whose plan it had (``scripts/bench_sweep.py``)."""
    cm = w.cost_model
    slicer = _slicer(cm, options, w)

    def price(plan) -> float:
        plan = with_pairs(plan, batch.input_lens, batch.target_lens)
        pieces = plan.replicas[0]
        _, result = schedule_pieces(cm, slicer, [p.shape for p in pieces], plan.contexts(0), plan.slice_links(0),
                                    plan.pairs(0), seed=batch.step, link=options.link,
                                    search_steps=options.search_steps)
        return result.makespan_s if result.fits_memory else float("inf")

    return price


def _slicer(cost_model, options: SimulateOptions, w):
    """The token-slice cost model of ``--slice-long`` (the analytic model's slowest stage for a sample of the
    workload's longest input, as the trainer's planner picks it), else ``None``."""
    if not options.slice_long:
        return None

    return AnalyticSliceCostModel.from_stage_model(cost_model, ref_length=w.limits.max_input_len)


@dataclass(frozen=True)
class SingleSampleRelief:
    """Planner view of a cost model in which a one-sample micro-batch only has to fit alone.

    The planner admits a run when ``in_flight * stored + peak <= budget``. A single sample cannot be
    split further, and the adaptive schedule admits micro-batches by their actual memory, so for
    ``b = 1`` this view reports ``stored / in_flight``: the test becomes ``stored + peak <= budget``.
    Runs of two or more samples keep the full ``in_flight`` bound. Times are unchanged.
    """

    cost_model: object
    """A MicroBatchCostModel (e.g. StageCostModel)."""
    in_flight: int
    """The ``in_flight`` the planner is called with."""

    def __getattr__(self, name: str):
        """Everything but ``evaluate`` is the wrapped model's (budget, device memory, model states, ...)."""
        if name == "cost_model":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.cost_model, name)

    def evaluate(self, b, E, D, pairs=None):
        t, stored, peak = self.cost_model.evaluate(b, E, D, **({} if pairs is None else {"pairs": pairs}))
        stored = np.where(np.asarray(b) == 1, stored / self.in_flight, stored)
        return t, stored, peak


def _trace_picked(trace_dir: str, method: str, picked: str, batches, w, options: SimulateOptions) -> None:
    """``--placement auto``'s trace of ``method``: its first step simulated again on the linear placement when
    :func:`pick_placement` took it, the step the table reports (the same deterministic plan and schedule); a
    virtual placement's steps are not drawn, which a line on stderr says."""
    if picked == "linear":
        simulate_method(method, batches[:1], w, options, trace_dir=trace_dir)
    else:
        print(f"--trace-dir: {method} ran on {picked}, whose steps are not drawn; no trace of it written",
              file=sys.stderr)


def tune_simulated(method: str, batches, w, options, default_summary=None, placed=None, resplit=None) -> Tuned:
    """``simulate --tune-baselines`` for one baseline (``w``: a resolved Workload; ``placed``: the placement
    it is simulated on, as in :func:`simulate_method`); ``default_summary``, the
    default's :class:`MethodSummary`, is reused instead of simulated again. ``resplit(workload) -> workload``: the
    layer split of each knob value (``--layer-split data``: balanced over that value's micro-batches); ``None``:
    ``w``'s split for every value."""
    default = w.options.value(method)

    def run(value: int):
        if default_summary is not None and value == default:
            s = default_summary
        else:
            tried = dataclasses.replace(w, options=w.options.with_value(method, value))
            s = simulate_method(method, batches, tried if resplit is None else resplit(tried), options, placed=placed)
        note = ("" if s.fits_memory else OFF_GRID_NOTE if s.priced_off_grid
                else f"does not fit memory (peak {s.peak_memory_gib:.1f} GiB)")
        return s.tokens_per_s, note

    return tune(method, batches, w.limits, w.options, run)
