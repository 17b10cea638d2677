"""Rank 0's per-step data-path overhead and every rank's peak RSS of a ``dynabatch train`` run.

Run it as torchrun's script in place of ``-m dynabatch``, with the train command's arguments::

    torchrun --standalone --nproc-per-node 2 scripts/measure_data_path.py --out DIR -- \\
        train --stages 2 --max-steps 30 --output-dir RUN --overwrite-output-dir --no-timeline

Each rank times, per step, from the training loop asking its background planner for the step
(``PlanAhead.get`` / ``ProcessPlanAhead.get``) to its executor starting the step (``Executor.run``): on rank 0
that is the wait for the planner, taking the step in (unpickling, resolving the batch, collating) and building
and starting the deliveries (the other ranks have no planner: their lists stay empty). ``DIR/rank{R}.json`` holds
the per-step seconds, the planner's waits, where ranks collate their own micro-batches the seconds each took
(``StepData.micro_batches``), and the rank's peak RSS (``ru_maxrss``; the largest of its waited-for child
processes, such as rank 0's planner process, as ``children_peak_rss_bytes``). ``--summary DIR...`` prints the medians and spreads of earlier
runs side by side. It patches by name (``get``, ``Executor.run``), so the same script measures older trees.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time


def _patch(times: dict) -> None:
    from dynabatch.engine.executor import Executor
    from dynabatch.training import plan_ahead, planner_process

    mark = {"start": None}

    def wrap_get(cls):
        original = cls.get

        def get(self, *a, **k):
            mark["start"] = time.perf_counter()
            item, wait = original(self, *a, **k)
            times["wait_s"].append(wait)
            return item, wait

        cls.get = get

    for cls in (plan_ahead.PlanAhead, planner_process.ProcessPlanAhead):
        wrap_get(cls)
    run = Executor.run

    def timed_run(self, inputs, *a, **k):
        if mark["start"] is not None:
            times["to_run_s"].append(time.perf_counter() - mark["start"])
        mark["start"] = None
        return run(self, inputs, *a, **k)

    Executor.run = timed_run
    try:  # trees where every rank collates its own micro-batches
        from dynabatch.training.step_data import StepData
    except ImportError:
        return
    collate = StepData.micro_batches

    def timed_collate(self, layout):
        t0 = time.perf_counter()
        try:
            return collate(self, layout)
        finally:
            times["collate_s"].append(time.perf_counter() - t0)

    StepData.micro_batches = timed_collate


def _summary(dirs: list[str]) -> None:
    for d in dirs:
        print(d)
        for name in sorted(os.listdir(d)):
            if not name.startswith("rank"):
                continue
            with open(os.path.join(d, name)) as f:
                r = json.load(f)
            steps = r["to_run_s"][2:]  # the first steps wait for the start-up
            line = f"  {name[:-5]}: peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB"
            if r.get("children_peak_rss_bytes"):
                line += f" (largest child process {r['children_peak_rss_bytes'] / 2**20:.0f} MiB)"
            if steps:
                q = statistics.quantiles(steps, n=10) if len(steps) > 2 else [min(steps), max(steps)]
                line += (f"; get->run median {1e3 * statistics.median(steps):.1f} ms (p10 {1e3 * q[0]:.1f}, p90 "
                         f"{1e3 * q[-1]:.1f}) over {len(steps)} steps")
            if r.get("collate_s"):
                line += f"; own collation median {1e3 * statistics.median(r['collate_s'][2:] or r['collate_s']):.1f} ms"
            if r["wait_s"][2:]:
                line += f"; planner wait median {1e3 * statistics.median(r['wait_s'][2:]):.1f} ms"
            print(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="folder for rank{R}.json")
    p.add_argument("--summary", nargs="+", metavar="DIR", help="print the figures of earlier runs and exit")
    args, rest = p.parse_known_args()
    if args.summary:
        _summary(args.summary)
        return 0
    rest = rest[1:] if rest and rest[0] == "--" else rest
    times: dict = {"to_run_s": [], "wait_s": [], "collate_s": []}
    _patch(times)
    from dynabatch.cli import main as cli

    code = cli(rest)
    os.makedirs(args.out, exist_ok=True)
    out = dict(times, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               children_peak_rss_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
    with open(os.path.join(args.out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(out, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
