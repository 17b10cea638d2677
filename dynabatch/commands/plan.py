"""``dynabatch plan``: plan global batches with every method and compare them.

Forms global batches by the token budget (over-long samples truncated) from a lengths file or a
mixture, cuts each with the dynamic planner and with every baseline, prices every micro-batch with
the same cost model (the analytic one, or ``--cost-profile``'s measured tables; attention per segment, as the padding-free runtime computes it), and prints per method: real tokens, computed tokens, micro-batches,
predicted step time ``sum(t) + (S - 1) max(t)``, the peak memory and whether it fits the device (``simulate``'s
check, :mod:`dynabatch.commands.scheduled`: the simulated peak of the schedule ``choose_schedule`` gives each plan;
each method priced with the recomputation it runs with: a baseline's none; a plan that fits only with fewer than
``S`` micro-batches in flight, which the step formula assumes, is named under the table) and the
method's own wall time per global batch (median, p10-p90 and max over the batches;
``scripts/bench_plan_time.py`` times the dynamic method over more rounds). The speedup of the faster of
``dynamic`` and ``dynamic_sliced`` (those in ``--methods`` that fit; none when neither does) is over the best
whole-sample baseline that fits (over all of them when none does).
``--tune-baselines`` plans each baseline at every value of its knob's grid as well and compares dynamic with each
one's best setting that fits (:mod:`dynabatch.commands.tuning`). A method with micro-batches beyond a
``--cost-profile``'s grid has no price: ``n/a`` in the table (``None`` and ``priced_off_grid`` in ``--json``), never
the best nor fitting, and a line under the table names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass

import numpy as np

from dynabatch.commands.common import OFF_GRID_NOTE, check_output_file, compared_baselines, describe_dynamic_compared, describe_off_grid, dynamic_compared, dynamic_left_out, num_cell, print_workload, split_from_data, workload_summary, write_json, add_workload_arguments, compared_methods, method_recompute, resolve
from dynabatch.training.config.flags import add_fields, add_sections
from dynabatch.commands.scheduled import memory_limit_bytes, schedule_plan
from dynabatch.commands.tuning import print_tuned, tune, tune_baselines_arg, tuned_summary
from dynabatch.core.allocator import keep_freed_memory
from dynabatch.core.sequence import is_seq2seq
from dynabatch.core.methods import DYNAMIC_SLICED, is_planner, objective_note
from dynabatch.training.workload import global_batches, kept_limits, method_micro_batches
from dynabatch.plan.slice_costs import AnalyticSliceCostModel
from dynabatch.cost.planner_model import UNPRICED


@dataclass(frozen=True)
class PlanArgs:
    """``plan``'s own flags (the workload's are :mod:`dynabatch.commands.common`'s)."""

    _argument_group_name = "plan"

    tune_baselines: bool = tune_baselines_arg("plan and price")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    add_fields(p, ["slice_long"])
    add_sections(p, [PlanArgs])


def run(args: argparse.Namespace) -> int:
    keep_freed_memory()  # the planner's numpy temporaries reuse mapped pages (dynabatch.core.allocator)
    check_output_file(args.json, command="plan")
    w = resolve(args)
    methods = compared_methods(args.methods, w.family, args.model, args.cost_profile)
    batches = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, args.num_batches, args.tokenizer)
    # rows and budgets of the baselines as long as the longest kept sample, not the (maybe far longer) limit
    w = dataclasses.replace(w, limits=kept_limits(w.limits, batches))
    stages = w.cost_model.num_stages
    if args.slice_long and is_seq2seq(w.family):
        raise ValueError("--slice-long needs --model gpt (token slicing is for decoder-only models)")
    rows, left_out = {}, {}
    for method in methods:
        cost_model = _method_cost_model(method, batches, w, args)
        try:
            rows[method] = plan_method(method, batches, w, cost_model, args)
        except ValueError as e:  # a sample the planner cannot admit even alone
            if (line := dynamic_left_out(method, methods, e)) is not None:
                left_out[method] = line  # said once every other method has run (else their error alone)
                continue
            hint = (f" (or use --methods {DYNAMIC_SLICED} to cut such samples into token slices)"
                    if method == "dynamic" and not is_seq2seq(w.family) and not args.slice_long
                    and not args.cost_profile else "")
            raise ValueError(f"{e}{hint}") from e
    tuned = {}
    if args.tune_baselines:
        tuned = {m: tune(m, batches, w.limits, w.options, _trial(m, batches, w, args, rows[m]))
                 for m in methods if not is_planner(m)}
    for line in left_out.values():
        print(f"warning: {line}", file=sys.stderr)
    summary = _summary(args, w, batches, rows, tuned, left_out)
    if args.json and write_json(summary, args.json, command="plan"):
        return 0
    _print_table(summary, rows, tuned)
    return 0


def _slicer(cost_model, method: str, slice_long: bool, limits):
    """The slice cost model of a method that cuts token slices (``dynamic_sliced``, or ``dynamic`` with
    ``--slice-long``; the slowest stage for a sample of the longest input, as the trainer's planner picks
    it), else ``None``."""
    sliced = method == DYNAMIC_SLICED or (method == "dynamic" and slice_long)
    return AnalyticSliceCostModel.from_stage_model(cost_model, ref_length=limits.max_input_len) if sliced else None


def plan_method(method: str, batches, w, cost_model, args: argparse.Namespace) -> dict:
    """One row of the table: ``method`` (at its knob value in ``w.options``) planned on every global batch and
    priced by ``cost_model``: tokens, micro-batches, the predicted step, whether every micro-batch fits the
    memory under the planner's bound, and the planning time."""
    stages = cost_model.num_stages
    slice_model = _slicer(cost_model, method, args.slice_long, w.limits) if is_planner(method) else None
    real = computed = micro = sliced = 0
    peak, fits = 0.0, True  # simulate's memory check: the peak of the schedule choose_schedule gives each plan
    need = 0.0  # the largest S x stored + peak of a whole-sample micro-batch (the step formula's S in flight)
    step_times, wall, kept = [], [], {}
    for batch in batches:
        extra = {"slice_cost_model": slice_model, "pack_rows": args.pack_rows} if is_planner(method) else {}
        plan = method_micro_batches(method, batch, w.limits, cost_model, stages, w.options, **extra)
        if plan.predicted_times_s is not None and plan.num_sliced_samples:
            t = plan.predicted_times_s  # token slices are priced with their context by the planner
        else:  # per-segment (padding-free) attention, as the runtime computes it
            t, stored, peak_act = cost_model.evaluate(plan.shapes[:, 0], plan.shapes[:, 1], plan.shapes[:, 2],
                                                      pairs=plan.pairs)
            need = max(need, float(np.max(stages * np.asarray(stored) + np.asarray(peak_act))))
        _, result = schedule_plan(cost_model, slice_model, plan, batch.step)
        peak = max(peak, float(result.peak_memory_bytes.max()))
        fits &= bool(result.fits_memory)
        sliced += plan.num_sliced_samples
        step_times.append(float(t.sum() + (stages - 1) * t.max()))
        real += plan.real_tokens
        computed += plan.computed_tokens
        micro += plan.num_micro_batches
        wall.append(plan.plan_time_s)
        if plan.candidate:
            kept[plan.candidate] = kept.get(plan.candidate, 0) + 1
    row = {
        "layout": cost_model.layout.describe(),
        "real_tokens": real,
        "computed_tokens": computed,
        "efficiency": real / computed,
        "micro_batches": micro,
        "sliced_samples": sliced,
        "predicted_step_s": float(np.mean(step_times)),
        "predicted_tokens_per_s": real / float(np.sum(step_times)),
        # simulate's check (dynabatch.commands.scheduled): every batch's scheduled peak within the device limit
        "fits_memory": bool(fits),
        "peak_memory_gib": peak / 2**30,  # model states included, of its own layer split
        "memory_limit_gib": memory_limit_bytes(cost_model) / 2**30,
        # the step formula's assumption: S micro-batches in flight, S x stored + peak within the activation memory
        # (token slices: admitted by the planner's slice model, not counted here)
        "fits_in_flight": bool(need <= cost_model.memory_budget_bytes),
        "largest_micro_batch_gib": need / 2**30,
        "activation_budget_gib": cost_model.memory_budget_bytes / 2**30,  # of its own layer split
        "plan_wall_ms_median": 1e3 * float(np.median(wall)),
        "plan_wall_ms_p10": 1e3 * float(np.percentile(wall, 10)),
        "plan_wall_ms_p90": 1e3 * float(np.percentile(wall, 90)),
        "plan_wall_ms_max": 1e3 * float(np.max(wall)),
        **({"candidates": kept} if kept else {}),
        **({"changes_objective": objective_note(method)} if objective_note(method) else {}),
        # a micro-batch beyond a cost profile's grid (UNPRICED): its prices are n/a, not ~1e30 s (as bench's)
        "priced_off_grid": max(step_times) >= UNPRICED or peak >= UNPRICED,
    }
    if row["priced_off_grid"]:
        row.update(dict.fromkeys(PRICED_FIELDS), fits_memory=False)
    return row


PRICED_FIELDS = ("predicted_step_s", "predicted_tokens_per_s", "peak_memory_gib", "fits_in_flight",
                 "largest_micro_batch_gib")
"""A :func:`plan_method` row's fields that come from the cost model's prices (``None`` off a profile's grid)."""


def _method_cost_model(method: str, batches, w, args: argparse.Namespace):
    """The cost model ``method`` is priced with: with ``--layer-split data`` its layer split balanced over its own
    micro-batches (at its knob value in ``w.options``), and the recomputation it runs with (a baseline's auto:
    none, as train and simulate run it)."""
    cost_model = (split_from_data(w, batches, method) if args.layer_split == "data" else w).cost_model
    return dataclasses.replace(cost_model, recompute=method_recompute(method, w))


def _trial(method: str, batches, w, args: argparse.Namespace, default_row: dict):
    """``--tune-baselines``' ``run(value) -> (predicted tokens/s, note)`` of baseline ``method``
    (:func:`~dynabatch.commands.tuning.tune`), each value planned as its default is (its own layer split); the
    default's row is reused."""
    default = w.options.value(method)

    def run(value: int):
        tried = dataclasses.replace(w, options=w.options.with_value(method, value))
        row = default_row if value == default else plan_method(
            method, batches, tried, _method_cost_model(method, batches, tried, args), args)
        note = "" if row["fits_memory"] else OFF_GRID_NOTE if row["priced_off_grid"] else (
            f"does not fit memory (peak {row['peak_memory_gib']:.1f} of {row['memory_limit_gib']:.1f} GiB)")
        return row["predicted_tokens_per_s"], note

    return run


def _summary(args: argparse.Namespace, w, batches, rows: dict, tuned: dict, left_out: dict | None = None) -> dict:
    # the ratio is over the baselines that train on the whole samples (packing_free_split changes the objective)
    # and that the cost model prices (one beyond a profile's grid has no step)
    whole = {k: v for k, v in rows.items() if not is_planner(k) and not objective_note(k) and not v["priced_off_grid"]}
    fitting = {k: v for k, v in whole.items() if v["fits_memory"]}
    compared = fitting or whole
    best = min(compared, key=lambda k: compared[k]["predicted_step_s"]) if compared else None
    # the faster of dynamic and dynamic_sliced among those that fit the memory; none when neither does
    planners = {k: v for k, v in rows.items() if is_planner(k) and v["fits_memory"]}
    planner = min(planners, key=lambda k: planners[k]["predicted_step_s"]) if planners else None
    speedup = compared[best]["predicted_step_s"] / rows[planner]["predicted_step_s"] if best and planner else None
    out = {
        **workload_summary(args, w, batches),
        "methods": rows,
        "best_baseline": best,
        "dynamic_method": planner,
        "dynamic_methods_compared": dynamic_compared([k for k in rows if is_planner(k)], planner),
        "left_out": left_out or {},  # {method: warning}: dynamic that cannot plan a sample alone, beside dynamic_sliced
        "dynamic_speedup_vs_best_baseline": speedup,
        "baselines_compared": "fitting" if fitting else "none fits",
    }
    if tuned:
        entries, ratio = tuned_summary(tuned, rows[planner]["predicted_tokens_per_s"] if planner else None)
        out.update(entries, dynamic_speedup_vs_best_tuned_baseline=ratio)
    return out


def _print_table(summary: dict, rows: dict, tuned: dict) -> None:
    stages = summary["stages"]
    print_workload(summary)
    print(f"{'method':<19} {'real tok':>10} {'computed':>10} {'eff':>6} {'mbs':>5} {'step s':>8} {'peak GiB':>8} {'fits':>4}  "
          "plan ms/batch p50 [p10-p90] max")
    for method, r in rows.items():
        print(f"{method + ('*' if 'changes_objective' in r else ''):<19} {r['real_tokens']:>10d} {r['computed_tokens']:>10d} {r['efficiency']:>6.3f} "
              f"{r['micro_batches']:>5d} {num_cell(r['predicted_step_s'], 8, 3)} {num_cell(r['peak_memory_gib'], 8, 1)} "
              f"{'n/a' if r['priced_off_grid'] else 'yes' if r['fits_memory'] else 'NO':>4} "
              f"{r['plan_wall_ms_median']:>8.1f} [{r['plan_wall_ms_p10']:.1f}-{r['plan_wall_ms_p90']:.1f}] "
              f"{r['plan_wall_ms_max']:.1f}")
    for method, r in rows.items():
        if r["layout"] != summary["layout"]:
            print(f"  {method} layer split (balanced over its micro-batches): {r['layout']}")
    for method, r in rows.items():
        if "changes_objective" in r:
            print(f"* {method} {r['changes_objective']}")
    if (line := describe_off_grid([m for m, r in rows.items() if r["priced_off_grid"]])) is not None:
        print(line)
    for method, r in rows.items():
        if not r["fits_memory"] and not r["priced_off_grid"]:
            advice = (f"tune its knob ({'see below' if tuned else '--tune-baselines'}) or give it more memory"
                      if not is_planner(method) else "give it more memory, more stages or shorter length limits")
            print(f"  {method} does not fit: its simulated schedule peaks at {r['peak_memory_gib']:.2f} GiB of the "
                  f"{r['memory_limit_gib']:.2f} GiB device limit; {advice}")
    for method, r in rows.items():
        if r["fits_memory"] and not r["fits_in_flight"]:
            print(f"  {method} fits only with fewer than {stages} micro-batches in flight: a micro-batch needs "
                  f"{r['largest_micro_batch_gib']:.2f} GiB ({stages} x stored + peak) of the "
                  f"{r['activation_budget_gib']:.2f} GiB of activation memory, so its predicted step "
                  "(which assumes them) is optimistic; dynabatch simulate times its schedule")
    planners = [m for m in rows if is_planner(m)]
    if (line := describe_dynamic_compared(summary["dynamic_methods_compared"], planners)) is not None:
        print(line)
    if summary["dynamic_speedup_vs_best_baseline"] is not None:
        which = compared_baselines(summary["baselines_compared"])
        best = summary["best_baseline"]
        optimistic = (f"; {best}'s step assumes {stages} micro-batches in flight, which do not fit: see above"
                      if rows[best]["fits_memory"] and not rows[best]["fits_in_flight"] else "")
        print(f"{summary['dynamic_method']} vs best baseline ({best}; {which}; predicted step time): "
              f"{summary['dynamic_speedup_vs_best_baseline']:.2f}x{optimistic}")
    if tuned:
        print_tuned(tuned, {m: rows[m]["predicted_tokens_per_s"] for m in tuned}, "predicted")
        if summary["dynamic_speedup_vs_best_tuned_baseline"] is not None:
            print(f"{summary['dynamic_method']} vs best tuned baseline ({summary['best_tuned_baseline']}; whole-sample baselines), predicted "
                  f"real tokens/s: {summary['dynamic_speedup_vs_best_tuned_baseline']:.2f}x")
