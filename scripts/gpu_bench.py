"""One-GPU benchmark: dynamic micro-batching vs packing_free vs packing vs padding (bf16, padding-free attention), plus a cost-model profile.

    python scripts/gpu_bench.py                       # CUDA, bf16 autocast, about 5-8 minutes on one GPU
    python scripts/gpu_bench.py --device cpu --quick  # smoke run of the same code path (tests/unit/cost/test_gpu_bench.py)

What it measures, in one process on one device (the results go to ``--out``, default ``runs/gpu_bench``):

1. **Cost-model profile** (``dynabatch profile`` machinery: :func:`dynabatch.cost.profile.run_profile`):
   per-layer forward + backward time and memory of ``--model`` in bf16 over a grid of micro-batch
   shapes, saved as ``profile.json``, then a calibration check (:func:`dynabatch.cost.calibrate.run_check`)
   of the tables against freshly measured off-grid shapes: the relative error of the predicted time and
   memory (printed and saved as ``profile_check.json``).
2. **Throughput** (``dynabatch bench``'s :func:`~dynabatch.commands.bench_run.bench`, in this process): each
   method trains its own copy of the same seeded model on the same global batches of the built-in mixture
   through our :class:`~dynabatch.engine.executor.Executor` (fp32 master weights, bf16 autocast), steps
   interleaved across methods. ``dynamic`` plans with the profile just measured (``--cost-profile``);
   with ``--analytic`` also a second ``dynamic`` run planned with the analytic model is reported.

Why one stage. A single GPU cannot hold a meaningful pipeline: two NCCL ranks may not share one GPU,
and stages time-sharing one device would measure the GPU's scheduler, not pipeline bubbles. So this is
a 1-stage pipeline (the executor with no p2p): it measures what dynamic micro-batching gains *per
device* -- less padding than padding / token budgets, no attention over whole packed rows, micro-batch
sizes chosen by measured cost and memory -- but not the bubble reduction across stages, which the CPU
benchmark (``dynabatch bench --stages 2``) and the simulator cover. The JSON line at the end has, per
method, real tokens/s and the ratio to the best baseline (packing_free, packing, padding, token budget).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".cache", "numba"))

# (model, max input len, global batch tokens, profile grid) for the full run and for --quick
FULL = {"dtype": "bf16", "model": "t5-small", "max_input_len": 2048, "global_batch_tokens": 131072, "steps": 8, "warmup": 2,
        "token_budget_tokens": 16384, "packing_rows": 4, "packing_free_rows": 8, "samples_per_micro_batch": 16,
        "memory_gib": 60.0,
        "grid": {"batch_sizes": (1, 2, 4, 8, 16, 32, 64), "enc_lengths": (32, 64, 128, 256, 512, 1024, 2048),
                 "dec_lengths": (8, 32, 128, 512), "max_tokens": 32768},
        "check_shapes": 12}
QUICK = {"dtype": "fp32", "model": "t5-tiny", "max_input_len": 128, "global_batch_tokens": 2048, "steps": 2, "warmup": 1,
         "token_budget_tokens": 512, "packing_rows": 2, "packing_free_rows": 2, "samples_per_micro_batch": 8,
         "memory_gib": 2.0,
         "grid": {"batch_sizes": (1, 4), "enc_lengths": (16, 128), "dec_lengths": (4, 32), "max_tokens": 512},
         "check_shapes": 2}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke runs)")
    p.add_argument("--quick", action="store_true", help="tiny model, grid and batches: seconds, for a smoke test")
    p.add_argument("--model", default=None, help="model preset (default t5-small; --quick: t5-tiny)")
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--global-batch-tokens", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per method")
    p.add_argument("--methods", default="dynamic,dynamic_flat,packing_free,packing,padding,token_budget")
    p.add_argument("--analytic", action="store_true", help="also run dynamic planned with the analytic cost model")
    p.add_argument("--skip-profile", action="store_true", help="no profile: dynamic plans with the analytic model")
    p.add_argument("--lengths", default=None, help="a lengths file (e.g. data/heavy_tail_2048.npz) instead of the built-in mixture")
    p.add_argument("--memory-gib", type=float, default=None, help="the memory limit every method plans within (default 60; "
                   "a binding one, with --tune-baselines, is issue 16's regime)")
    for knob in ("token_budget_tokens", "packing_rows", "packing_free_rows", "samples_per_micro_batch"):
        p.add_argument("--" + knob.replace("_", "-"), type=int, default=None, help="a baseline's knob (default: the settings')")
    p.add_argument("--tune-baselines", action="store_true", help="also time each baseline at its best knob value that fits "
                   "--memory-gib (one step per value)")
    p.add_argument("--out", default="runs/gpu_bench", help="output directory")
    return p.parse_args(argv)


def profile(settings: dict, model: str, device: str, out: str) -> tuple[str, dict]:
    """Profile ``model`` on ``device`` (bf16 on CUDA), save it, check it; returns (path, check summary)."""
    from dynabatch.cost.calibrate import format_summary, run_check, summarize
    from dynabatch.cost.measure import MeasureSettings
    from dynabatch.cost.profile import ProfileGrid, run_profile, save_profile
    from dynabatch.cost.tables import CostTables
    from dynabatch.models.families import layer_builder

    cuda = device.startswith("cuda")
    start = time.perf_counter()
    prof = run_profile(model, ProfileGrid(**settings["grid"]), MeasureSettings(min_repeats=2, max_repeats=10, min_time_s=0.02),
                       device=device, dtype="bfloat16" if cuda else "float32", num_threads=None if cuda else 1,
                       p2p_backend=None, show_progress=False, layer_builder=layer_builder(model))
    path = str(save_profile(prof, os.path.join(out, "profile.json")))
    print(f"profile: {model} on {prof['device']['name']} in {time.perf_counter() - start:.1f} s -> {path}", flush=True)
    rows = run_check(CostTables.load(path), layer_builder(model), num_shapes=settings["check_shapes"], device=device, progress=False)
    summary = summarize(rows)
    print(format_summary(summary), flush=True)
    with open(os.path.join(out, "profile_check.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return path, summary


def bench_args(settings: dict, model: str, methods: str, cost_profile: str | None, out_json: str,
               lengths: str | None = None, tune: bool = False) -> argparse.Namespace:
    from dynabatch.commands.bench import add_arguments
    from dynabatch.commands.bench_run import resolve_defaults

    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = ["--model", model, "--stages", "1", "--methods", methods, "--max-input-len", str(settings["max_input_len"]),
            "--global-batch-tokens", str(settings["global_batch_tokens"]), "--timed-steps", str(settings["steps"]),
            "--untimed-steps", str(settings["warmup"]), "--token-budget-tokens", str(settings["token_budget_tokens"]),
            "--packing-rows", str(settings["packing_rows"]), "--packing-free-rows", str(settings["packing_free_rows"]),
            "--samples-per-micro-batch", str(settings["samples_per_micro_batch"]),
            "--memory-gib", str(settings["memory_gib"]), "--dtype", settings["dtype"], "--json", out_json]
    if cost_profile:
        argv += ["--cost-profile", cost_profile]
    if lengths:
        argv += ["--lengths", lengths]
    if tune:
        argv += ["--tune-baselines", "--tune-steps", "1"]
    args = p.parse_args(argv)
    resolve_defaults(args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    for key in ("model", "max_input_len", "global_batch_tokens", "steps", "memory_gib", "token_budget_tokens",
                "packing_rows", "packing_free_rows", "samples_per_micro_batch"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA device (use --device cpu --quick for a smoke run)", file=sys.stderr)
            return 2
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the executor picks CUDA whenever it sees one
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    from dynabatch.commands.bench_report import print_table, summary_line
    from dynabatch.commands.bench_run import bench

    profile_path, check = (None, None) if args.skip_profile else profile(settings, settings["model"], args.device, args.out)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    runs = [("", profile_path, methods)]
    if args.analytic and profile_path:
        runs.append(("analytic: ", None, ["dynamic"]))
    results = {}
    for label, cost_profile, ms in runs:
        name = "analytic" if label else "main"
        bargs = bench_args(settings, settings["model"], ",".join(ms), cost_profile, os.path.join(args.out, f"bench_{name}.json"),
                           args.lengths, args.tune_baselines and name == "main")
        result = bench(bargs, ms)
        with open(bargs.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(label, end="")
        print_table(result)
        results[name] = result
    main_rows = results["main"]["methods"]
    summary = json.loads(summary_line(results["main"]))
    summary.update({
        "device": results["main"]["machine"]["device"], "planned_with": "profile" if profile_path else "analytic",
        "padding_efficiency": {m: round(r["padding_efficiency"], 4) for m, r in main_rows.items()},
        "profile_check_time_median_rel_err": check["model"]["time_median"] if check and "model" in check else None,
        "wall_s": round(time.perf_counter() - start, 1),
    })
    if "analytic" in results:
        summary["tokens_per_s"]["dynamic_analytic"] = round(results["analytic"]["methods"]["dynamic"]["tokens_per_s"], 1)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
