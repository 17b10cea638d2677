"""A GPU-like per-micro-batch fixed cost, emulated on CPU: how the planner copes when every micro-batch costs the same
whatever its size.

On the lent H200 (docs/benchmarks/gpu_h200/) every micro-batch of GPT-2 small cost 60-70 ms of launches and Python
whatever its size, so a plan of many small micro-batches lost 18x to packing_free. This script makes the executor's
every forward sleep ``--fwd-s`` and every backward ``--bwd-s`` (on top of the real compute), runs
``scripts/gpu_bench.py``'s CPU path (1 stage, interleaved methods) and prints, per method, the micro-batches,
measured and predicted seconds of every step:

    python scripts/bench_fixed_cost.py --methods dynamic,packing_free --plan-costs base
    python scripts/bench_fixed_cost.py --methods dynamic,packing_free --plan-costs calibrated

``--plan-costs`` sets what ``--plan-costs auto`` means for decoder-only models in this process (the
``PLAN_COSTS_AUTO`` registry), so ``dynamic`` plans with the base model or the online fit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="dynamic,packing_free")
    p.add_argument("--plan-costs", default=None, choices=("base", "scaled", "calibrated"),
                   help="what decoder-only models plan with under --plan-costs auto (default: the registry's)")
    p.add_argument("--fwd-s", type=float, default=0.2)
    p.add_argument("--bwd-s", type=float, default=0.3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--global-batch-tokens", type=int, default=16384)
    p.add_argument("--out", default="runs/bench_fixed_cost")
    args = p.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

    from dynabatch.engine import executor
    from dynabatch.schedule.ir import Op

    def slowed(handler, seconds):
        def run(ex, ins):
            time.sleep(seconds)
            return handler(ex, ins)
        return run

    executor.HANDLERS[Op.FORWARD] = slowed(executor.HANDLERS[Op.FORWARD], args.fwd_s)
    executor.HANDLERS[Op.BACKWARD] = slowed(executor.HANDLERS[Op.BACKWARD], args.bwd_s)
    if args.plan_costs:
        from dynabatch.training.config import PLAN_COSTS_AUTO

        PLAN_COSTS_AUTO["causal"] = args.plan_costs
    spec = importlib.util.spec_from_file_location("gpu_bench", os.path.join(ROOT, "scripts", "gpu_bench.py"))
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    code = gpu_bench.main(["--device", "cpu", "--quick", "--model", "gpt2-tiny", "--skip-profile",
                           "--lengths", os.path.join(ROOT, "data", "heavy_tail_2048.npz"), "--max-input-len", "2048",
                           "--global-batch-tokens", str(args.global_batch_tokens), "--steps", str(args.steps),
                           "--methods", args.methods, "--memory-gib", "8", "--out", args.out])
    with open(os.path.join(args.out, "bench_main.json"), encoding="utf-8") as f:
        result = json.load(f)
    for m, row in result["methods"].items():
        steps = [(s["micro_batches"], round(s["time_s"], 2), round(s["predicted_step_s"] or 0, 2)) for s in row["per_step"]]
        print(f"{m}: padding eff {row['padding_efficiency']:.3f}; per step (micro-batches, measured s, predicted s): {steps}")
    return code


if __name__ == "__main__":
    sys.exit(main())
