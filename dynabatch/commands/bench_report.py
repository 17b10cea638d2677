"""What ``dynabatch bench`` prints: the human-readable table (:func:`print_table`) and the last line, one
JSON object with every method's real tokens/s that scripts check (:func:`summary_line`)."""

from __future__ import annotations

import json
import sys

from dynabatch.training.config.sections import PLAN_COSTS
from dynabatch.commands.common import describe_off_grid, num_cell
from dynabatch.commands.tuning import describe
from dynabatch.core.words import counted

PEER = "pipelining"
"""The external peer method (``torch.distributed.pipelining`` on packing's rows)."""
PLAN_VARIANTS = {f"dynamic_plan_{costs}": costs for costs in PLAN_COSTS}
"""bench methods: dynamic calibrated with the fit every calibrated method shares and planned with each ``--plan-costs``
(base, scaled, calibrated), whatever ``--plan-costs`` says: the measurement behind its default, in one interleaved run."""
PACK_ROWS_OF = {"dynamic_packed": "auto", "dynamic_flat": "flat"}
"""bench methods that are dynamic with another ``--pack-rows`` (the value each runs with), next to dynamic's own:
the measurement behind that flag's default. ``dynamic_packed``: several short samples per padding-free row where
the planner prices it cheaper; ``dynamic_flat``: every micro-batch one padding-free row."""


def print_progress(step: int, num_steps: int, timed: bool, seconds: dict[str, float]) -> None:
    """One line per step on stderr, each method's time: a long run (a GPU's first compiles) shows progress."""
    print(f"bench step {step + 1}/{num_steps} ({'timed' if timed else 'untimed'}): "
          + ", ".join(f"{m} {t:.3f} s" for m, t in seconds.items()), file=sys.stderr, flush=True)


def summary_line(result: dict) -> str:
    """The last line ``dynabatch bench`` prints: one JSON object a script can check."""
    c, rows = result["config"], result["methods"]
    line = {
        "model": c["model"], "max_input_len": c["max_input_len"], "max_target_len": c["max_target_len"],
        "stages": c["stages"], "lengths": c["lengths"], "data": c.get("data"), "best_baseline": result["best_baseline"],
        "tokens_per_s": {m: round(r["tokens_per_s"], 1) for m, r in rows.items()},
        "ratio_to_best_baseline": {m: round(r["ratio_to_best_baseline"], 4) for m, r in rows.items()
                                   if "ratio_to_best_baseline" in r},
    }
    if "tuned" in result:  # --tune-baselines: each baseline's best knob value and its measured tokens/s
        line["tuned"] = {m: {t["knob"]: t["value"], "tokens_per_s": None if t["tokens_per_s"] is None
                             else round(t["tokens_per_s"], 1)} for m, t in result["tuned"].items()}
        line["best_tuned_baseline"] = result["best_tuned_baseline"]
        line["ratio_to_best_tuned_baseline"] = {m: round(r["ratio_to_best_tuned_baseline"], 4)
                                                for m, r in rows.items() if "ratio_to_best_tuned_baseline" in r}
    return json.dumps(line)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


COLUMNS = ("columns, over the timed steps: tok/s = real tokens / seconds of all of them; p50, p10-p90 = of each step's "
           "tok/s; pad eff = real / computed tokens; bubble = predicted idle share (mean); mbs, slc = micro-batches "
           "and sliced samples per step (mean); step s, pred s = measured and predicted step time (medians); peak MiB = "
           "peak memory per device, the largest step's (measured on CUDA, predicted on CPU: the line below says which); "
           "vs best = tok/s / the best whole-sample baseline's; paired = the per-step ratios to it; vs pipe = tok/s / "
           "pipelining's (- without --methods pipelining)")
"""The legend printed under the table: what each column is computed over (a total, a mean or a median)."""


def print_table(result: dict) -> None:
    c = result["config"]
    print(f"{c['model']} on {c.get('data') or c['lengths'] or 'the built-in mixture'}: {c['stages']} stages, policy {c['policy']}, "
          f"{c['timed_steps']} timed steps (+{c['untimed_steps']} untimed) per method, interleaved; "
          f"{result['samples_per_step']:.0f} samples / {result['real_tokens_per_step']:.0f} real tokens per step; "
          f"device {result['machine']['device']}")
    w = max(20, *(len(m) for m in result["methods"]))
    print(f"{'method':<{w}} {'tok/s':>8} {'p50 tok/s':>9} {'p10-p90':>13} {'pad eff':>7} {'bubble':>6} "
          f"{'mbs':>5} {'slc':>4} {'step s':>7} {'pred s':>7} {'peak MiB':>8} {'vs best':>7} {'paired p50 [p10,p90]':>21} {'vs pipe':>7}")
    for m, r in result["methods"].items():
        s = r["tokens_per_s_per_step"]
        peak = r["measured_peak_memory_mib"] if r["measured_peak_memory_mib"] is not None else r["predicted_peak_memory_mib"]
        paired = r.get("paired_ratio_to_best_baseline")
        pr = f"{paired['median']:.2f} [{paired['p10']:.2f},{paired['p90']:.2f}]" if paired else "-"
        vs_pipe = f"{r['ratio_to_pipelining']:.2f}x" if "ratio_to_pipelining" in r else "-"
        print(f"{m + ('*' if r.get('changes_objective') else ''):<{w}} {r['tokens_per_s']:>8.0f} {s['median']:>9.0f} {s['p10']:>6.0f}-{s['p90']:<6.0f} "
              f"{r['padding_efficiency']:>7.3f} {num_cell(r['bubble_fraction_predicted'], 6, 3)} {r['micro_batches_per_step']:>5.1f} {r.get('sliced_samples_per_step', 0):>4.1f} "
              f"{r['step_time_s']['median']:>7.3f} {num_cell(r['predicted_step_s_median'], 7, 3)} {num_cell(peak, 8, 1)} "
              f"{_ratio(r.get('ratio_to_best_baseline')):>7} {pr:>21} "
              f"{vs_pipe:>7}")
    print(COLUMNS)
    for m, r in result["methods"].items():
        if r.get("candidates"):  # the dynamic method: the DP's plan (dp) or a baseline's, per timed step
            ran = ", ".join(f"{label} {n}" for label, n in sorted(r["candidates"].items(), key=lambda kv: -kv[1]))
            print(f"{m} ran these plans (timed steps): {ran}")
    for m, r in result["methods"].items():
        if r.get("changes_objective"):
            print(f"* {m} {r['changes_objective']}")
    if (line := describe_off_grid([m for m, r in result["methods"].items() if r.get("priced_off_grid")])) is not None:
        print(line)
    kind = "measured (CUDA, max over ranks)" if result["methods"][next(iter(result["methods"]))][
        "measured_peak_memory_mib"] is not None else "predicted by the cost model (CPU)"
    print(f"best baseline: {result['best_baseline']}; peak memory per device {kind}; rank-0 peak RSS "
          f"{result['peak_rss_mib_rank0']:.0f} MiB (all methods together)")
    if "tuned" in result:
        print(f"tuned baselines (fastest knob value that fits --memory-gib over {counted(c['tune_steps'], 'measured step')} each, "
              f"then timed for {counted(c['timed_steps'], 'step')}; the default if that was faster):")
        for m, t in result["tuned"].items():
            print("  " + describe(m, t, result["methods"][m]["tokens_per_s"]))
        top = result["best_tuned_baseline"]
        if top is not None and "dynamic" in result["methods"]:
            print(f"dynamic vs best tuned baseline ({top}, {result['tuned'][top]['knob']} "
                  f"{result['tuned'][top]['value']}): {result['methods']['dynamic']['ratio_to_best_tuned_baseline']:.2f}x")
    recomputed = [f"{m} {r['recomputed_forwards_per_step']:.1f}" for m, r in result["methods"].items()
                  if r.get("recomputed_forwards_per_step")]
    if recomputed:
        print(f"activation recomputation (--recompute {c.get('recompute', 'auto')}), stage forwards per step that "
              f"recompute: {', '.join(recomputed)}")
    saved = [f"{m} {r['measured_saved_activation_mib']:.1f}/{r['predicted_saved_activation_mib']:.1f}"
             for m, r in result["methods"].items()
             if r.get("measured_saved_activation_mib") is not None and r.get("predicted_saved_activation_mib")]
    if saved:
        print("activations saved for backward, largest stage, measured/predicted MiB: " + ", ".join(saved))
        over = [m for m, r in result["methods"].items() if r.get("fits_memory_measured") is False]
        print(f"measured saved activations + model states within --memory-gib {c['memory_gib']}: "
              + ("every measured method" if not over else "NOT " + ", ".join(over)))
    errors = [f"{m} {r['prediction_error_median']:.1%} ({r.get('calibration', 'off')})" for m, r in result["methods"].items()
              if r.get("prediction_error_median") is not None]
    if errors:
        print("step time, median |predicted - measured| / measured (calibration): " + ", ".join(errors))
    def seconds(values) -> str:
        return "/".join(f"{x:.2f}" for x in values)

    compute = [f"{m} {seconds(r['stage_compute_s_measured'])}"
               + (f" ({seconds(r['stage_compute_s_predicted'])})" if r.get("stage_compute_s_predicted") else "")
               for m, r in result["methods"].items() if r.get("stage_compute_s_measured")]
    if compute:
        print("forward + backward seconds per device, median step, measured (predicted): " + ", ".join(compute))
        busy = [f"{m} {'/'.join(f'{x:.2f}' for x in r['device_busy_fraction'])}"
                + (f" (eff bal {r['efficiency_balanced']:.3f})" if r.get("efficiency_balanced") is not None else "")
                for m, r in result["methods"].items() if r.get("device_busy_fraction")]
        print("measured busy fraction of each device (its compute / step time), median step (eff bal: amortised "
              "whole-model ideal / predicted work x mean busy): " + ", ".join(busy))
    rows = result["methods"]
    pairs = [("dynamic", "dynamic_uncalibrated", "calibrated"), ("dynamic", "dynamic_profiled", "calibrated"),
             ("dynamic", "dynamic_norecompute", f"--recompute {c.get('recompute', 'auto')}"),
             *((m, "dynamic", f"--pack-rows {value}") for m, value in PACK_ROWS_OF.items())]
    pairs += [(m, "dynamic_profiled", "calibrated") for m in PLAN_VARIANTS]
    for ours, other, what in pairs:
        if ours in rows and other in rows:
            print(f"{ours} ({what}) vs {other}: {rows[ours]['tokens_per_s'] / rows[other]['tokens_per_s']:.2f}x "
                  "real tokens/s, interleaved on the same global batches")
    if PEER in result["methods"]:
        shapes = ", ".join("x".join(map(str, s)) for s in result["methods"][PEER].get("fixed_shapes", []))
        print(f"{PEER}: torch.distributed.pipelining Schedule1F1B on packing's rows as fixed-shape micro-batches "
              f"(rows x E x D: {shapes}); not a baseline of 'vs best'")
