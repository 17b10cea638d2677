"""Prediction quality of `dynabatch train` with and without the online calibration.

For each model, trains ``--steps`` steps on 2 stages (torchrun, gloo) with ``--calibrate quick`` (the
default without a profile) and with ``--calibrate off`` (the analytic ``cpu`` preset alone), then prints
from each run's metrics.jsonl the median |predicted - measured| / measured of the step time over all
steps and over the last 10, the per-stage median error, and real tokens/s.

    python scripts/bench_calibration.py                      # t5-tiny and gpt2-tiny, 40 steps
    python scripts/bench_calibration.py --models gpt2-mini --steps 40 --extra="--max-input-len 1024"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from dynabatch.training.metrics import prediction_summary


def train(model: str, mode: str, steps: int, out: str, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dynabatch",
           "train", "--model", model, "--stages", "2", "--steps", str(steps), "--calibrate", mode, "--output-dir", out,
           "--log-every", "0", "--no-timeline", "--task-loss-every", "0", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="t5-tiny,gpt2-tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--modes", default="quick,off")
    p.add_argument("--extra", default="", help="more `dynabatch train` flags, one string")
    args = p.parse_args()
    print(f"{'model':12s} {'calibrate':9s} {'error all':>9s} {'last 10':>8s}  {'per stage':18s} {'tok/s':>7s}")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for mode in args.modes.split(","):
                records = train(model, mode, args.steps, os.path.join(tmp, f"{model}-{mode}"), shlex.split(args.extra))
                s = prediction_summary(records)
                steady = records[1:]
                tok_s = sum(r["real_tokens"] for r in steady) / sum(r["step_time_s"] for r in steady)
                stages = ", ".join(f"{x:.1%}" for x in s["stage_median"])
                print(f"{model:12s} {mode:9s} {s['median']:9.1%} {s['last10_median']:8.1%}  {stages:18s} {tok_s:7.0f}",
                      flush=True)


if __name__ == "__main__":
    main()
