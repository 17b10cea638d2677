"""Activation recomputation at paper scale (simulated): ``--recompute auto`` against ``none`` for the dynamic
planner, T5-3B and GPT-2.7B (analytic presets), 4 stages, A100-40GB, FLAN-like multi-task lengths
(``bench_schedule.write_flan_like``) at max lengths 2048, 4096 and 8192 (T5 targets: L/4), 65,536-token
global batches. Per point: simulated step time and tokens/s under each policy, whether every step fits
the device, the share of stage forwards that recompute, and, when ``none`` cannot run (a sample that does
not fit alone), its one-line refusal. Nothing is measured: every number is the analytic model's.

    python scripts/simulate_recompute.py [--lengths 2048,4096,8192] [--num-batches 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "numba"))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402

from bench_schedule import write_flan_like  # noqa: E402


def point(path: str, model: str, preset: str, max_len: int, policy: str, num_batches: int) -> dict:
    from dynabatch.commands.common import add_workload_arguments, resolve
    from dynabatch.commands.simulate import SimulateOptions, simulate_step, simulation_workload
    from dynabatch.training.workload import global_batches

    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    args = parser.parse_args(["--lengths", path, "--model", model, "--preset", preset, "--hardware", "a100-40gb",
                              "--stages", "4", "--max-input-len", str(max_len), "--max-target-len",
                              str(max(64, max_len // 4)), "--num-batches", str(num_batches), "--recompute", policy])
    w = simulation_workload(resolve(args))
    batches = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, args.num_batches)
    steps, real, fits, recomputed, forwards = [], 0, True, 0, 0
    options = SimulateOptions()
    try:
        for batch in batches:
            plan, schedule, result, _, _ = simulate_step("dynamic", batch, w, options)
            b, e, d = plan.shapes.T
            codes = w.cost_model.per_stage(b, e, d, plan.pairs).recompute
            recomputed += 0 if codes is None else int(np.count_nonzero(codes))
            forwards += w.cost_model.num_stages * len(b)
            steps.append(result.makespan_s)
            real += plan.real_tokens
            fits &= bool(result.fits_memory)
    except ValueError as e:  # a sample that cannot fit alone under this policy
        return {"policy": policy, "refused": str(e).split("; ")[0]}
    return {"policy": policy, "step_s": float(np.mean(steps)), "tokens_per_s": real / float(np.sum(steps)),
            "fits_memory": fits, "recomputed_share": recomputed / forwards}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="sim-recompute-"), "flan_like.npz")
    write_flan_like(path)
    rows = []
    print(f"{'model':<14} {'L':>5} | {'none step s':>11} {'auto step s':>11} {'auto/none':>9} | {'fits n/a':>8} "
          f"| recomputed forwards (auto)")
    for model, preset in (("t5", "t5-3b"), ("gpt", "gpt-2.7b")):
        for L in (int(x) for x in a.lengths.split(",")):
            none, auto = (point(path, model, preset, L, policy, a.num_batches) for policy in ("none", "auto"))
            rows.append({"model": model, "preset": preset, "max_len": L, "none": none, "auto": auto})

            def step(r):
                return f"{r['step_s']:>11.3f}" if "step_s" in r else f"{'refused':>11}"

            ratio = f"{none['step_s'] / auto['step_s']:>9.2f}" if "step_s" in none and "step_s" in auto else f"{'-':>9}"
            fit = "".join("y" if r.get("fits_memory") else "n" for r in (none, auto))
            share = f"{auto['recomputed_share']:.1%}" if "recomputed_share" in auto else "-"
            print(f"{model + ':' + preset:<14} {L:>5} | {step(none)} {step(auto)} {ratio} | {fit:>8} | {share}"
                  + (f"   none: {none['refused'][:110]}" if "refused" in none else ""), flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
