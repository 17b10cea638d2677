"""What ``--zero 2``'s equal micro-batch counts cost: dynamic's planned step with every replica of a stage given the
same number of micro-batches (:func:`dynabatch.plan.replicas.equalize_counts`) against free counts (``--zero 1``).

For each replica count, the same global batches as ``dynabatch simulate`` draws (its flags: ``--lengths``,
``--model``, ``--hardware``, ``--stages``, ``--global-batch-tokens``, ``--num-batches`` ...) are planned by
:func:`~dynabatch.plan.step.plan_step` over the replicas twice, under ``--zero 1`` and ``--zero 2``, and the predicted
step (the slowest replica's ``sum(t) + (S - 1) max(t)``) compared. Both cost models get ``--zero 2``'s activation
budget (``--memory-gib`` large enough that memory does not bind), so the only difference is the equal counts.
Prints per replica count the micro-batches per replica (min-max over replicas and batches), the planned step of each
and the ratio (median and range over the batches) and writes them as JSON with ``--out``.

    python scripts/bench_equal_counts.py --lengths data/heavy_tail_2048.npz --replica-counts 2,8 --num-batches 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    from dynabatch.commands.common import resolve
    from dynabatch.commands.simulate import add_arguments, simulation_workload
    from dynabatch.plan.step import plan_step
    from dynabatch.training.workload import global_batches

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--replica-counts", default="2,8")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = []
    for replicas in [int(x) for x in args.replica_counts.split(",")]:
        plans = {}
        for zero in (1, 2):
            args.replicas, args.zero = replicas, zero
            w = simulation_workload(resolve(args))
            # the same activation budget for both: only the counts differ
            cm = dataclasses.replace(w.cost_model, zero=2) if zero == 1 else w.cost_model
            cm = _free_counts(cm) if zero == 1 else cm
            batches = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, args.num_batches,
                                     args.tokenizer)
            plans[zero] = [plan_step(b.input_lens, b.target_lens, cm, w.cost_model.num_stages, family=w.family,
                                     num_replicas=replicas) for b in batches]
        ratio = [e.objective_s / f.objective_s for f, e in zip(plans[1], plans[2])]
        counts = {z: [len(r) for plan in plans[z] for r in plan.replicas] for z in plans}
        row = {"replicas": replicas, "batches": len(ratio),
               "micro_batches_free": [min(counts[1]), max(counts[1])],
               "micro_batches_equal": [min(counts[2]), max(counts[2])],
               "unequal_steps_free": sum(len({len(r) for r in plan.replicas}) > 1 for plan in plans[1]),
               "step_free_s": statistics.median(p.objective_s for p in plans[1]),
               "step_equal_s": statistics.median(p.objective_s for p in plans[2]),
               "ratio_median": statistics.median(ratio), "ratio_min": min(ratio), "ratio_max": max(ratio)}
        assert all(len({len(r) for r in plan.replicas}) == 1 for plan in plans[2])
        rows.append(row)
        print(f"R={replicas}: micro-batches per replica free {row['micro_batches_free']} (unequal in "
              f"{row['unequal_steps_free']}/{len(ratio)} steps), equal {row['micro_batches_equal']}; planned step "
              f"free {row['step_free_s']:.4f} s, equal {row['step_equal_s']:.4f} s (medians); equal / free "
              f"{row['ratio_median']:.4f} (min {row['ratio_min']:.4f}, max {row['ratio_max']:.4f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


def _free_counts(cost_model):
    """``cost_model`` (under ``--zero 2``'s budget) with free micro-batch counts."""

    class Free(type(cost_model)):
        @property
        def equal_micro_batch_counts(self) -> bool:
            return False

    return Free(**{f.name: getattr(cost_model, f.name) for f in dataclasses.fields(cost_model) if f.init})


if __name__ == "__main__":
    sys.exit(main())
