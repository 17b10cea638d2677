"""The plan-candidates matrix: dynamic against every tuned baseline, measured, one ``dynabatch bench`` run per row.

Rows are model x max input length x lengths (the built-in mixture, or ``data/heavy_tail_<len>.npz``: most samples
short, a few long). Each row is a separate ``dynabatch bench --tune-baselines`` run on 2 stages: every baseline
sweeps its knob on the first global batches, then every method (the tuned baselines included) is timed
interleaved step by step on the same global batches through the same executor. A row whose JSON already
exists in ``--out`` is not rerun, so an interrupted sweep resumes; ``--table`` only prints the table of the
JSON files there.

The table gives dynamic's real tokens/s over the best tuned baseline's (whole-run tokens/s) and the paired step
ratio against the best untuned baseline (median [p10, p90] over the timed steps), the spread to read the first
number against.

    python scripts/bench_matrix.py --out docs/benchmarks/plan_candidates --date 2026-12-06 \\
        --models t5-tiny,t5-d256,gpt2-d256 --lengths 1024,2048 --data builtin,heavy
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

METHODS = "dynamic,packing_free,token_budget,length_grouped"


def row_file(out: str, model: str, length: int, data: str, date: str) -> str:
    return os.path.join(out, f"bench_{model}_{length}_{data}_{date}.json")


def bench_command(model: str, length: int, data: str, path: str, timed_steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "dynabatch", "bench", "--model", model, "--max-input-len", str(length),
           "--stages", "2", "--methods", METHODS, "--tune-baselines", "--tune-steps", "1",
           "--timed-steps", str(timed_steps), "--untimed-steps", "1", "--json", path]
    if data == "heavy":
        cmd += ["--lengths", f"data/heavy_tail_{length}.npz"]
    return cmd


def table_row(path: str) -> str:
    d = json.load(open(path))
    cfg, dyn = d["config"], d["methods"]["dynamic"]
    best = d["best_tuned_baseline"]
    tuned = d["tuned"][best]
    knob = f"{tuned['value']} ({tuned['knob']})"
    paired = dyn["paired_ratio_to_best_baseline"]
    data = "heavy-tailed" if cfg.get("lengths") else "built-in"
    return (f"| {cfg['model']} | {cfg['max_input_len']:,} | {data} | {dyn['tokens_per_s']:,.0f} | `{best}`, {knob} | "
            f"{tuned['tokens_per_s']:,.0f} | **{dyn['ratio_to_best_tuned_baseline']:.2f}x** | "
            f"{paired['median']:.2f} [{paired['p10']:.2f}, {paired['p90']:.2f}] | "
            f"{dyn['micro_batches_per_step']:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder of the rows' JSON files")
    p.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    p.add_argument("--models", default="t5-tiny,t5-d256,gpt2-d256")
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--data", default="builtin,heavy")
    p.add_argument("--timed-steps", type=int, default=10)
    p.add_argument("--table", action="store_true", help="only print the table of the JSON files in --out")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = [(m, int(n), d) for m in args.models.split(",") for n in args.lengths.split(",") for d in args.data.split(",")]
    if not args.table:
        for model, length, data in rows:
            path = row_file(args.out, model, length, data, args.date)
            if os.path.exists(path):
                continue
            start = time.time()
            log = path[:-5] + ".log"
            with open(log, "w") as f:
                rc = subprocess.call(bench_command(model, length, data, path, args.timed_steps), stdout=f,
                                     stderr=subprocess.STDOUT)
            print(f"{model} {length} {data}: rc={rc} in {time.time() - start:.0f} s", flush=True)
            if rc == 0:
                os.remove(log)
    print("| model | max len | data | dynamic tok/s | best tuned baseline | its tok/s | dynamic / best tuned | "
          "paired step ratio p50 [p10, p90] | dynamic micro-batches/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, length, data in rows:
        path = row_file(args.out, model, length, data, args.date)
        if os.path.exists(path):
            print(table_row(path))


if __name__ == "__main__":
    main()
