"""Row packing in the dynamic planner: simulated throughput with ``--pack-rows auto`` against ``off``.

For each workload (the built-in mixture and a heavy-tailed lengths file: 85% short samples, median about
200 tokens, 15% spread over [max/4, max], ``scripts/bench_slicing.py``'s ``heavy_tail_lengths``) and each
model (T5-large, GPT-1.3B on the analytic A100-40GB preset, 4 stages, 65,536-token global batches), every
global batch is planned by the dynamic planner with ``pack_rows`` off and auto and simulated exactly as
``dynabatch simulate`` does (adaptive/1F1B/GPipe over several orders, every micro-batch priced by the
attention pairs the padding-free runtime computes), next to the ``packing_free`` and ``token_budget``
baselines. Printed per row: real tokens/s of each, auto / off, the share of auto's micro-batches that hold
a packed row, padding efficiency and the planner's wall time per global batch (median).

    python scripts/bench_pack_rows.py                      # about 5-10 minutes on 2 shared cores
    python scripts/bench_pack_rows.py --num-batches 2 --models gpt --max-lens 2048

The last line is JSON with every figure.
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

from bench_slicing import heavy_tail_lengths  # noqa: E402


def workload_args(lengths: str | None, model: str, max_len: int, num_batches: int, tokens: int) -> argparse.Namespace:
    from dynabatch.commands.common import add_workload_arguments

    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    argv = ["--model", model, "--max-input-len", str(max_len), "--max-target-len", str(max(1, max_len // 4)),
            "--num-batches", str(num_batches), "--global-batch-tokens", str(tokens)]
    return p.parse_args(argv + (["--lengths", lengths] if lengths else []))


def run_one(lengths, model, max_len, num_batches, tokens, baselines) -> dict:
    from dynabatch.commands.common import resolve
    from dynabatch.commands.simulate import SimulateOptions, simulate_method, simulate_step
    from dynabatch.training.workload import global_batches

    args = workload_args(lengths, model, max_len, num_batches, tokens)
    w = resolve(args)
    batches = global_batches(w.path, w.family, w.limits, tokens, num_batches, args.tokenizer)
    out = {}
    for mode in ("off", "auto"):
        options = SimulateOptions(pack_rows=mode)
        summary = simulate_method("dynamic", batches, w, options)
        packed = total = 0
        for batch in batches[:2]:  # share of micro-batches with a packed row (first two batches)
            plan, *_ = simulate_step("dynamic", batch, w, options)
            packed += sum(any(len(r) > 1 for r in g.rows) for g in plan.groups)
            total += plan.num_micro_batches
        out[mode] = {"tokens_per_s": summary.tokens_per_s, "padding_efficiency": summary.padding_efficiency,
                     "micro_batches": summary.micro_batches, "plan_ms_median": summary.plan_ms_median,
                     "bubble": summary.bubble_fraction, "packed_share": packed / total, "fits": summary.fits_memory}
    for method in baselines:
        summary = simulate_method(method, batches, w, SimulateOptions())
        out[method] = {"tokens_per_s": summary.tokens_per_s, "padding_efficiency": summary.padding_efficiency,
                       "fits": summary.fits_memory}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="t5,gpt")
    p.add_argument("--max-lens", default="1024,2048")
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--global-batch-tokens", type=int, default=65_536)
    p.add_argument("--baselines", default="packing_free,token_budget")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    baselines = [m for m in a.baselines.split(",") if m]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for max_len in (int(x) for x in a.max_lens.split(",")):
            e, d = heavy_tail_lengths(a.global_batch_tokens * (a.num_batches + 1), max_len, a.seed)
            heavy = os.path.join(tmp, f"heavy_{max_len}.npz")
            np.savez(heavy, input_len=e, target_len=d)
            for model in a.models.split(","):
                for name, path in (("builtin", None), ("heavy-tailed", heavy)):
                    r = run_one(path, model, max_len, a.num_batches, a.global_batch_tokens, baselines)
                    row = {"workload": name, "model": model, "max_len": max_len, **r}
                    results.append(row)
                    off, auto = r["off"], r["auto"]
                    base = "  ".join(f"{m} {r[m]['tokens_per_s']:.0f}{'' if r[m]['fits'] else '*'}" for m in baselines)
                    print(f"{name:<13} {model:<4} {max_len:>5}  off {off['tokens_per_s']:>8.0f}  auto "
                          f"{auto['tokens_per_s']:>8.0f}  auto/off {auto['tokens_per_s'] / off['tokens_per_s']:.3f}  "
                          f"packed {auto['packed_share']:.2f}  pad eff {off['padding_efficiency']:.3f}->"
                          f"{auto['padding_efficiency']:.3f}  plan ms {off['plan_ms_median']:.0f}->"
                          f"{auto['plan_ms_median']:.0f}  | {base}", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
