"""Benchmark planning + scheduling end to end: simulated efficiency of the dynamic method vs the baselines.

A FLAN-like mixture (generated here with a fixed seed, written to a temporary ``.npz``): 60% NI-style
tasks (inputs lognormal median 300, p95 800; targets median 5), 25% summarisation (inputs median 1000
with a heavy tail to several thousand; targets median 60, tail to hundreds), 15% short tasks (inputs
median 60, targets median 10). For T5 (t5-large) and GPT (gpt-1.3b), 4 stages, 65,536-token global
batches and the analytic a100-40gb preset, at max input lengths 512, 1024, 2048 and 4096 (T5 targets
capped at 256; GPT sequences = inputs + targets capped at the max length), every method's micro-batches
are scheduled by ``choose_schedule`` and simulated (``dynabatch simulate``, see its docstring for the
metrics). Prints per configuration: efficiency (ideal / simulated step time) of each method, the bubble
fraction, dynamic's real-token throughput over the best baseline that fits memory, and the wall time of
planning and scheduling per step.

    python scripts/bench_schedule.py [--num-batches 8] [--lengths 512,1024,2048,4096] [--models t5,gpt]
                                     [--save-lengths flan_like.npz]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "numba"))

import numpy as np  # noqa: E402

from dynabatch.commands.common import resolve  # noqa: E402
from dynabatch.commands.simulate import add_arguments, simulate_method  # noqa: E402
from dynabatch.core.methods import whole_sample_baselines  # noqa: E402
from dynabatch.training.workload import global_batches  # noqa: E402

TASKS = (  # name, weight, input median, input sigma, target median, target sigma (lognormal)
    ("ni", 0.60, 300, 0.6, 5, 0.8),
    ("summarize", 0.25, 1000, 0.8, 60, 0.8),
    ("short", 0.15, 60, 0.5, 10, 0.6),
)


def write_flan_like(path: str, num_samples: int = 20_000, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    weights = np.array([t[1] for t in TASKS])
    which = rng.choice(len(TASKS), size=num_samples, p=weights / weights.sum())
    e, d = np.empty(num_samples), np.empty(num_samples)
    for k, (_, _, em, es, dm, ds) in enumerate(TASKS):
        sel = which == k
        e[sel] = rng.lognormal(np.log(em), es, sel.sum())
        d[sel] = rng.lognormal(np.log(dm), ds, sel.sum())
    np.savez(path, input_len=np.maximum(e, 1).astype(np.int64), target_len=np.maximum(d, 1).astype(np.int64),
             task=np.array([TASKS[k][0] for k in which]))


def _cell(row) -> str:
    """Efficiency right-aligned in 9 columns, ``*`` when the method does not fit memory."""
    return f"{row.efficiency:>8.3f}{' ' if row.fits_memory else '*'}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-batches", type=int, default=8)
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--models", default="t5,gpt")
    p.add_argument("--hardware", default="a100-40gb")
    p.add_argument("--save-lengths", default=None, help="also write the generated lengths .npz here")
    a = p.parse_args(argv)
    path = a.save_lengths or os.path.join(tempfile.mkdtemp(prefix="bench-schedule-"), "flan_like.npz")
    write_flan_like(path)
    methods = whole_sample_baselines("causal")  # the same for T5 and GPT (packing_free_split: another objective)
    header = f"{'model':<5} {'L':>5} | {'dynamic':>7} " + " ".join(f"{m[:8]:>8} " for m in methods)
    header += f" | {'eff am':>6} {'bubble':>6} {'util':>5} {'dyn/best':>8} {'best':>14}"
    header += f" | {'plan ms':>7} {'sched ms':>8}"
    print(f"efficiency = ideal / simulated step time (* = does not fit memory). Dynamic's: eff am = efficiency "
          f"with amortised per-sample ideal, bubble, util = busiest stage busy / step time; dyn/best = dynamic real "
          f"tokens/s over the best baseline that fits; {a.num_batches} global batches each")
    print(header)
    start = time.perf_counter()
    for model in a.models.split(","):
        for max_len in (int(x) for x in a.lengths.split(",")):
            parser = argparse.ArgumentParser()
            add_arguments(parser)
            args = parser.parse_args(["--lengths", path, "--model", model, "--max-input-len", str(max_len),
                                      "--num-batches", str(a.num_batches), "--hardware", a.hardware])
            w = resolve(args)
            batches = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, args.num_batches)
            rows = {m: simulate_method(m, batches, w) for m in ("dynamic", *methods)}
            fitting = [r for m, r in rows.items() if m != "dynamic" and r.fits_memory]
            best = max(fitting, key=lambda r: r.tokens_per_s) if fitting else None
            dyn = rows["dynamic"]
            cells = " ".join(_cell(rows[m]) for m in methods)
            ratio = f"{dyn.tokens_per_s / best.tokens_per_s:>8.2f}" if best else f"{'n/a':>8}"
            print(f"{model:<5} {max_len:>5} | {_cell(dyn)[2:]} {cells} | "
                  f"{dyn.efficiency_amortised:>6.3f} {dyn.bubble_fraction:>6.3f} "
                  f"{dyn.bottleneck_utilisation:>5.3f} {ratio} "
                  f"{best.method if best else '-':>14} | "
                  f"{dyn.plan_ms_median:>7.1f} {dyn.schedule_ms_median:>8.1f}")
            sys.stdout.flush()
    print(f"total wall time {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
