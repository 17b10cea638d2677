"""Per-step planning cost at paper scale: schedule search, lowering and validation against the simulated step.

For every global batch of ``dynabatch simulate`` (same flags; default ``--model t5 --num-batches 4``, 4 stages,
65,536 tokens), the dynamic method is planned and its schedule chosen exactly as ``simulate`` does
(:func:`~dynabatch.commands.simulate.simulate_step`; search time summed over its variants), then the kept
schedule is lowered to per-rank plans (:func:`~dynabatch.schedule.lower.lower`, ``check=False``) and validated
with memory (:func:`~dynabatch.engine.step.check_step_memory`), which is what rank 0 runs on every training
step. Steps run in order after one untimed warm-up step (a process's first call loads the numba kernels:
reported apart). Lowering and validation are repeated ``--repeat`` times and the fastest kept (a noisy shared
CPU); every lowering starts from the shared instruction table (:mod:`dynabatch.schedule.rows`) as the
earlier steps left it, as in training. Prints per step the milliseconds of each part and their sum as a share
of the simulated step time.

    python scripts/bench_lowering.py [--model t5|gpt] [--num-batches 4] [--repeat 3] [other simulate flags]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "numba"))

import numpy as np  # noqa: E402

from dynabatch.commands.common import resolve  # noqa: E402
from dynabatch.commands.simulate import SimulateOptions, add_arguments, simulate_step, simulation_workload  # noqa: E402
from dynabatch.schedule.step import check_step_memory  # noqa: E402
from dynabatch.schedule import rows  # noqa: E402
from dynabatch.schedule.ir import PipelineSpec  # noqa: E402
from dynabatch.schedule.lower import lower  # noqa: E402
from dynabatch.schedule.simulate import simulate, with_message_buffers  # noqa: E402
from dynabatch.training.workload import global_batches  # noqa: E402


def _best_of(repeat: int, fn, before=lambda: None):
    """``(result, fastest wall seconds)`` of ``repeat`` calls of ``fn``, each after an untimed ``before()``."""
    best, out = float("inf"), None
    for _ in range(repeat):
        before()
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def _kept_costs(plan, schedule, result, cm):
    """The per-stage costs the kept schedule was simulated with: the cost model's, or (``--recompute auto``)
    its no-recomputation variant's, whichever replays to the same makespan."""
    b, e, d = plan.shapes.T
    models = [cm] if cm.recompute != "auto" else [cm, dataclasses.replace(cm, recompute="none")]
    send = lambda n: cm.model.send_time(n, "intra")  # noqa: E731 (simulate's --link intra)
    for model in models:
        costs = model.per_stage(b, e, d, plan.pairs)
        replay = simulate(schedule, with_message_buffers(costs), send_time=send, model_state_bytes=cm.model_state_bytes)
        if np.isclose(replay.makespan_s, result.makespan_s, rtol=1e-9):
            return costs
    raise AssertionError("no cost model variant replays the kept schedule's makespan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--repeat", type=int, default=3, help="validate each step this many times, keep the fastest")
    a = p.parse_args(argv if argv is not None else sys.argv[1:])
    if a.num_batches == 8 and "--num-batches" not in (argv or sys.argv):
        a.num_batches = 4
    w = simulation_workload(resolve(a))
    cm = w.cost_model
    batches = global_batches(w.path, w.family, w.limits, a.global_batch_tokens, a.num_batches, a.tokenizer)
    spec = PipelineSpec.from_layout(cm.layout, cm.model.spec.d_model)
    options = SimulateOptions(search_steps=a.search_steps, pack_rows=a.pack_rows)
    limit = cm.device_memory_bytes * (1 - cm.memory_margin)
    print(f"{a.model}: {cm.num_stages} stages, {len(batches)} global batches of {a.global_batch_tokens} tokens")
    print(f"{'step':>4} {'mbs':>4} {'instrs':>6} {'step s':>7} {'search ms':>9} {'lower ms':>8} {'valid ms':>8} "
          f"{'total ms':>8} {'share':>6}")
    shares = []
    for k, batch in enumerate([batches[0], *batches]):
        plan, schedule, result, _, search_s = simulate_step("dynamic", batch, w, options)
        costs = _kept_costs(plan, schedule, result, cm)
        tables = {spec: dict(rows._TABLES.get(spec, {}))}
        plans, lower_s = _best_of(a.repeat, lambda: lower(schedule, plan.shapes, spec, step=batch.step, fwd_s=costs.fwd_s,
                                                          bwd_s=costs.bwd_s, check=False, recompute=costs.recompute),
                                  lambda: rows._TABLES.update({spec: dict(tables[spec])}))
        if k == 0:
            rows._TABLES.clear()
            print(f"warm-up (first calls of the process): search {1e3 * search_s:.1f} ms, lowering "
                  f"{1e3 * lower_s:.1f} ms")
            continue
        _, valid_s = _best_of(a.repeat, lambda: check_step_memory(plans, [costs], limit, cm.model_state_bytes,
                                                                  step=batch.step, policy="auto"))
        total = search_s + lower_s + valid_s
        shares.append(total / result.makespan_s)
        n = sum(len(x.instructions) for x in plans.values())
        print(f"{batch.step:>4} {plan.num_micro_batches:>4} {n:>6} {result.makespan_s:>7.3f} {1e3 * search_s:>9.1f} "
              f"{1e3 * lower_s:>8.1f} {1e3 * valid_s:>8.1f} {1e3 * total:>8.1f} {total / result.makespan_s:>6.1%}")
    print(f"search + lowering + validation: median {np.median(shares):.1%}, max {np.max(shares):.1%} of the "
          "simulated step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
