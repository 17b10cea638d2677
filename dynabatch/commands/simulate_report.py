"""What ``dynabatch simulate`` reports: a method's simulated steps (:class:`MethodSummary`, what
:func:`~dynabatch.commands.simulate.simulate_method` returns), the ``--json`` summary of every method
(:func:`summary`: the best baseline, the dynamic method compared, tuned baselines) and the printed table under
the workload's lines (:func:`print_table`). A method priced beyond a ``--cost-profile``'s grid reads ``n/a``
(:func:`off_grid`), as in ``plan`` and ``bench``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from dynabatch.commands.common import compared_baselines, describe_dynamic_compared, describe_off_grid, dynamic_compared, num_cell, print_workload, workload_summary
from dynabatch.commands.tuning import print_tuned, tuned_summary
from dynabatch.core.methods import is_planner, objective_note
from dynabatch.cost.planner_model import UNPRICED


@dataclass(frozen=True)
class MethodSummary:
    """Simulated steps of one method over the global batches."""

    method: str
    real_tokens: int
    """Real (unpadded) tokens over all steps."""
    computed_tokens: int
    """Tokens computed on, padding included."""
    micro_batches: int
    """Micro-batches over all steps."""
    sliced_samples: int
    """Samples cut into token slices over all steps (``--slice-long``)."""
    step_s: float | None
    """Mean simulated step time."""
    ideal_s: float
    """Mean ideal step time (sum of per-sample unpadded bottleneck-stage times)."""
    tokens_per_s: float | None
    """Real tokens / simulated time, over all steps."""
    padding_efficiency: float
    """Real / computed tokens."""
    efficiency: float | None
    """Sum of ideal / sum of simulated step times."""
    efficiency_amortised: float | None
    """Like ``efficiency`` with each sample priced as its share of a batch of identical copies of it
    (about ``AMORTISED_TOKENS`` tokens): a stricter ideal without per-sample launch and weight-read costs.
    ``None`` (and so ``efficiency_balanced`` and ``work_efficiency``) where a ``--cost-profile``'s grid does not
    reach such batches."""
    efficiency_balanced: float | None
    """The physical limit: the whole model's amortised per-sample work (every stage's, summed) divided by the
    number of devices, over the simulated step time (``efficiency_amortised`` divides by the bottleneck stage's
    work instead, so it hides an imbalance between stages). The same quantity as the measured one of ``bench``
    and the train metrics, :func:`~dynabatch.plan.ideal.balanced_efficiency` with the simulated busy times."""
    work_efficiency: float | None
    """``W_ideal / W_plan`` (:mod:`dynabatch.plan.ideal`): the amortised whole-model ideal's work over the work of
    the plan's micro-batches (what padding, micro-batches smaller than the ideal's copies and recomputation add),
    summed over the steps. ``efficiency_balanced = work_efficiency x busy_fraction``: no schedule or placement
    can lift ``efficiency_balanced`` above it."""
    busy_fraction: float | None
    """Summed busy time of every device / (devices x summed step time): what the schedule leaves idle."""
    stage_busy: tuple | None
    """Per stage, the mean over steps of its busy time / step time."""
    layout: str
    """The stage layout the method ran with (``--layer-split data``: balanced over its own micro-batches)."""
    bubble_fraction: float | None
    """Mean over steps of the simulated idle share of all stages."""
    bottleneck_utilisation: float | None
    """Mean over steps of the busiest stage's busy time / step time (1: the schedule is as short as the
    busiest stage's work; the rest of the bubble is stage imbalance)."""
    peak_memory_gib: float | None
    """Largest simulated memory of any device in any step (model states included)."""
    fits_memory: bool
    """Every step stays within the device limit."""
    policies: dict
    """How often each policy was chosen."""
    schedule_ms_median: float
    """Wall time of choose_schedule per step (median)."""
    schedule_ms_max: float
    plan_ms_median: float
    """Wall time of the method's micro-batching per step (median)."""
    placement: str = "linear"
    """The placement the method ran on (``--placement auto``: the one :func:`pick_placement` took)."""
    priced_off_grid: bool = False
    """A micro-batch lies beyond the ``--cost-profile``'s grid (priced
    :data:`~dynabatch.cost.planner_model.UNPRICED`): every :data:`PRICED_FIELDS` entry is ``None`` and
    ``fits_memory`` false (:func:`off_grid`)."""


PRICED_FIELDS = ("step_s", "tokens_per_s", "efficiency", "efficiency_amortised", "efficiency_balanced", "work_efficiency",
                 "busy_fraction", "stage_busy", "bubble_fraction", "bottleneck_utilisation", "peak_memory_gib")
"""The fields of a :class:`MethodSummary` that come from the cost model's prices of the method's micro-batches."""


def off_grid(s: MethodSummary, times, peaks) -> MethodSummary:
    """``s`` as reported: when one of its simulated step times or peaks is a price beyond a cost profile's grid
    (at or above :data:`~dynabatch.cost.planner_model.UNPRICED`, ~1e30 s), ``None`` for every priced field
    rather than those numbers, not fitting, and ``priced_off_grid`` (as ``bench`` reports such a method)."""
    if max(times) < UNPRICED and max(peaks) < UNPRICED:
        return s
    return replace(s, **dict.fromkeys(PRICED_FIELDS), fits_memory=False, priced_off_grid=True)


def summary(args, w, batches, rows, tuned=None, left_out=None) -> dict:
    """``simulate --json``: the run (:func:`~dynabatch.commands.common.workload_summary`), every method's
    :class:`MethodSummary`, the best baseline and the dynamic method's ratio to it (and to the tuned baselines)."""

    # the whole-sample baselines (packing_free_split trains another objective and is reported beside them); the ratio
    # is over those that fit the memory, as plan's; when none does, over all of them, and the table says so; one
    # priced beyond a cost profile's grid has no tokens/s and is never compared
    baselines = {k: v for k, v in rows.items() if not is_planner(k) and not objective_note(k) and not v.priced_off_grid}
    fitting = {k: v for k, v in baselines.items() if v.fits_memory}
    best = max((fitting or baselines).values(), key=lambda r: r.tokens_per_s) if baselines else None
    # the faster of dynamic and dynamic_sliced among those whose simulated peak fits; none when neither fits
    planners = {k: v for k, v in rows.items() if is_planner(k) and v.fits_memory}
    planner = max(planners, key=lambda k: planners[k].tokens_per_s) if planners else None
    dynamic = planners[planner].tokens_per_s if planner else None
    out = {
        **workload_summary(args, w, batches),
        "layer_split": args.layer_split,
        "placement": args.placement,
        "methods": {k: {**asdict(v), **({"changes_objective": objective_note(k)} if objective_note(k) else {})}
                    for k, v in rows.items()},
        "best_baseline": best.method if best else None,
        "baselines_compared": "fitting" if fitting else "none fits",
        "dynamic_method": planner,
        "dynamic_methods_compared": dynamic_compared([k for k in rows if is_planner(k)], planner),
        "left_out": left_out or {},  # {method: warning}: dynamic that cannot plan a sample alone, beside dynamic_sliced
        "dynamic_throughput_vs_best_baseline": dynamic / best.tokens_per_s if best and dynamic else None,
    }
    if tuned:
        entries, ratio = tuned_summary(tuned, dynamic)
        out.update(entries, dynamic_throughput_vs_best_tuned_baseline=ratio)
    return out


def _ratio(value: float | None, width: int, off_grid: bool) -> str:
    """A table cell of an efficiency: ``n/a`` for a method priced off a cost profile's grid, ``-`` where only the
    ideal's batches are (:func:`~dynabatch.commands.simulate.simulate_method`)."""
    return num_cell(value, width, 3) if off_grid or value is not None else f"{'-':>{width}}"


def print_table(summary: dict, rows: dict, tuned: dict | None = None) -> None:
    """The workload's lines, one row per :class:`MethodSummary` and the comparisons under it."""
    print_workload(summary)
    print(f"{'method':<19} {'tok/s':>9} {'pad eff':>7} {'eff':>6} {'eff am':>6} {'eff bal':>7} {'bubble':>6} "
          f"{'step s':>7} "
          f"{'peak GiB':>8} {'fits':>4} "
          f"{'mbs':>5} {'sched ms p50/max':>16}  stage busy  policies")
    for r in rows.values():
        pol = ",".join(f"{k}:{v}" for k, v in sorted(r.policies.items()))
        off = r.priced_off_grid
        busy = "n/a" if off else "/".join(f"{100 * b:.0f}" for b in r.stage_busy) + "%"
        print(f"{r.method + ('*' if objective_note(r.method) else ''):<19} {num_cell(r.tokens_per_s, 9, 0)} "
              f"{r.padding_efficiency:>7.3f} {num_cell(r.efficiency, 6, 3)} "
              f"{_ratio(r.efficiency_amortised, 6, off)} {_ratio(r.efficiency_balanced, 7, off)} "
              f"{num_cell(r.bubble_fraction, 6, 3)} {num_cell(r.step_s, 7, 3)} {num_cell(r.peak_memory_gib, 8, 1)} "
              f"{'n/a' if off else 'yes' if r.fits_memory else 'NO':>4} "
              f"{r.micro_batches:>5d} {r.schedule_ms_median:>7.1f}/{r.schedule_ms_max:<8.1f} "
              f"{busy}  {pol}")
    if summary["placement"] == "auto":
        print("--placement auto: " + ", ".join(f"{r.method} {r.placement}" for r in rows.values()))
    for r in rows.values():
        if r.layout != summary["layout"]:
            print(f"  {r.method} layer split (balanced over its micro-batches): {r.layout}")
    for r in rows.values():
        if objective_note(r.method):
            print(f"* {r.method} {objective_note(r.method)}")
    if (line := describe_off_grid([m for m, r in rows.items() if r.priced_off_grid])) is not None:
        print(line)
    planners = [m for m in rows if is_planner(m)]
    if (line := describe_dynamic_compared(summary["dynamic_methods_compared"], planners)) is not None:
        print(line)
    if summary["dynamic_throughput_vs_best_baseline"] is not None:
        which = compared_baselines(summary["baselines_compared"])
        print(f"{summary['dynamic_method']} vs best baseline ({summary['best_baseline']}; {which}), real tokens/s: "
              f"{summary['dynamic_throughput_vs_best_baseline']:.2f}x")
    if tuned:
        print_tuned(tuned, {m: rows[m].tokens_per_s for m in tuned}, "simulated")
        if summary["dynamic_throughput_vs_best_tuned_baseline"] is not None:
            print(f"{summary['dynamic_method']} vs best tuned baseline ({summary['best_tuned_baseline']}; whole-sample baselines), "
                  "real tokens/s: "
                  f"{summary['dynamic_throughput_vs_best_tuned_baseline']:.2f}x")
