"""Does the background planner thread slow rank 0's training steps? A/B of ``dynabatch train`` runs.

Run under torchrun with the ``train`` flags after ``--``. ``--mode thread`` trains as ``dynabatch train`` does
(:class:`~dynabatch.training.plan_ahead.PlanAhead`: the planner thread plans while rank 0 trains); ``--mode
precomputed`` plans every step synchronously before the first one (the same plans: planning is
deterministic), so nothing plans while rank 0 trains. Needs ``--calibrate off`` (online calibration plans
step k from the measurements of step k - plan_ahead - 1, which a precomputed run does not have yet). Each
run's per-step ``step_time_s`` lands in its metrics.jsonl; ``--compare DIR_A DIR_B ...`` prints their medians
(the first step, which pays warm-up, left out) and the planner's share of the step::

    torchrun --standalone --nproc-per-node 2 scripts/bench_planner_overlap.py --mode thread -- \\
        --model gpt2-tiny --stages 2 --max-steps 30 --calibrate off --output-dir /tmp/ab/thread1 --no-timeline
    python scripts/bench_planner_overlap.py --compare /tmp/ab/thread1 /tmp/ab/pre1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


class Precomputed:
    """:class:`~dynabatch.training.plan_ahead.PlanAhead`'s interface over steps planned up front, synchronously."""

    def __init__(self, planner, num_steps: int, depth: int = 2):
        self._steps = [planner() for _ in range(num_steps)]

    def get(self, timeout_s: float = 600.0):
        return self._steps.pop(0), 0.0

    def close(self, timeout_s: float = 120.0) -> None:
        self._steps.clear()


def _compare(dirs: list[str]) -> int:
    for d in dirs:
        rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"), encoding="utf-8")]
        rows = [r for r in rows if "step_time_s" in r][1:]
        step = np.array([r["step_time_s"] for r in rows])
        plan = np.array([r["plan_time_s"] for r in rows])
        print(f"{d}: {len(rows)} steps, step_time_s median {np.median(step):.4f} (mean {step.mean():.4f}), "
              f"plan_time_s median {1e3 * np.median(plan):.1f} ms = {np.median(plan) / np.median(step):.1%} of the step")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--compare":
        return _compare(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("thread", "precomputed"), required=True)
    own, _, train = " ".join(argv).partition(" -- ")
    a = p.parse_args(own.split())
    if a.mode == "precomputed":
        import dynabatch.training.plan_ahead as planner

        planner.PlanAhead = Precomputed  # the trainer imports it when it starts
    from dynabatch.cli import main as cli

    return cli(["train", *train.split()])


if __name__ == "__main__":
    sys.exit(main())
