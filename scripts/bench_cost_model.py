"""Benchmark the profiled cost model: profile time, prediction error off the grid, lookup cost.

For each model: profile the default CPU grid (one thread, thread CPU-time clock), then predict and
measure random off-grid micro-batch shapes (``dynabatch.cost.calibrate``), then time the numba
lookups from inside an ``@njit`` loop, as the planner's kernels call them.

    python scripts/bench_cost_model.py [--models gpt2-mini,t5-mini] [--num-shapes 20]
                                      [--profile-dir DIR] [--reuse] [--lookups 1000000]

Prints per model: profile time and points, median / p90 relative error of forward + backward time
(whole model as one stage, and per layer kind pooled), stored/peak bytes error, and ns per lookup
(``_interp2``, ``_interp3``, whole-stage ``_stage_cost``; thread CPU time, best of 7).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `dynabatch profile` does on CPU (before torch loads)
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "numba"))

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from dynabatch.cost import _kernels as K  # noqa: E402
from dynabatch.cost.calibrate import format_summary, run_check, summarize  # noqa: E402
from dynabatch.cost.layers import KindSpec  # noqa: E402
from dynabatch.models.families import layer_builder  # noqa: E402
from dynabatch.cost.profile import ProfileGrid, count_points, run_profile, save_profile  # noqa: E402
from dynabatch.cost.tables import CostTables  # noqa: E402


@njit(cache=True)
def _loop2(axis_b, axis_l, table, qb, ql):
    acc = 0.0
    for i in range(qb.shape[0]):
        acc += K._interp2(axis_b, axis_l, table, qb[i], ql[i])
    return acc


@njit(cache=True)
def _loop3(axis_b, axis_e, axis_d, table, qb, qe, qd):
    acc = 0.0
    for i in range(qb.shape[0]):
        acc += K._interp3(axis_b, axis_e, axis_d, table, qb[i], qe[i], qd[i])
    return acc


@njit(cache=True)
def _loop_stage(axis_b, axis_e, axis_d, tab_be, cnt_be, tab_bd, cnt_bd, tab_bed, cnt_bed, qb, qe, qd):
    acc = 0.0
    for i in range(qb.shape[0]):
        f, g, s, p = K._stage_cost(axis_b, axis_e, axis_d, tab_be, cnt_be, tab_bd, cnt_bd, tab_bed, cnt_bed,
                                   qb[i], qe[i], qd[i])
        acc += f + g + s + p
    return acc


def _ns_per_call(fn, args, n: int, repeats: int = 7) -> float:
    fn(*args)  # compile / warm
    best = min(_timed(fn, args) for _ in range(repeats))
    return best / n * 1e9


def _timed(fn, args) -> float:
    t0 = time.thread_time()  # CPU time of this thread: other processes on the box do not inflate it
    fn(*args)
    return time.thread_time() - t0


def lookup_costs(t: CostTables, n: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    qb = rng.uniform(1, t.axis_b[-1], n)
    qe = np.exp(rng.uniform(np.log(t.axis_e[0]), np.log(t.axis_e[-1]), n))
    qd = np.exp(rng.uniform(np.log(t.axis_d[0]), np.log(t.axis_d[-1]), n))
    a = t.kernel_arrays()
    out = {"_interp2": _ns_per_call(_loop2, (a.axis_b, a.axis_e, a.tab_be[0, K.FWD], qb, qe), n)}
    if a.tab_bed.shape[0]:
        out["_interp3"] = _ns_per_call(_loop3, (a.axis_b, a.axis_e, a.axis_d, a.tab_bed[0, K.FWD], qb, qe, qd), n)
    whole = t.stage_spec(0, sum(t.num_layers))
    cnt = t.stage_counts(whole)
    out[f"_stage_cost ({sum(u.count > 0 for u in whole.uses)} kinds)"] = _ns_per_call(
        _loop_stage, (a.axis_b, a.axis_e, a.axis_d, a.tab_be, cnt[0], a.tab_bd, cnt[1], a.tab_bed, cnt[2], qb, qe, qd),
        n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-mini,t5-mini")
    ap.add_argument("--num-shapes", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-dir", default="runs/profiles")
    ap.add_argument("--reuse", action="store_true", help="reuse existing profiles in --profile-dir")
    ap.add_argument("--lookups", type=int, default=1_000_000)
    args = ap.parse_args()

    for model in args.models.split(","):
        path = os.path.join(args.profile_dir, f"{model}.cpu.json")
        print(f"\n=== {model} ===")
        if not (args.reuse and os.path.exists(path)):
            profile = run_profile(model, num_threads=1, show_progress=False, layer_builder=layer_builder(model))
            save_profile(profile, path)
        t = CostTables.load(path)
        meta = t.meta
        with open(path) as f:
            raw = json.load(f)
        points = count_points(tuple(KindSpec(k, tuple(v["dims"])) for k, v in raw["layers"].items()), ProfileGrid())
        per_kind = ", ".join(f"{k} {v.get('time_s', 0):.1f}s" for k, v in raw["layers"].items())
        print(f"profile: {raw['profile_time_s']:.1f} s for {points} points ({meta['device']['name']}, "
              f"{meta['num_threads']} thread, clock {meta['settings']['clock']}; p2p included)")
        print(f"  per kind: {per_kind}")
        if raw.get("p2p"):
            p = raw["p2p"]
            print("  p2p gloo one-way: " + ", ".join(f"{n // 1024} KiB {s * 1e6:.0f} us (min {m * 1e6:.0f})"
                                                     for n, s, m in zip(p["sizes_bytes"], p["send_s"],
                                                                        p["send_min_s"])))
        start = time.perf_counter()
        rows = run_check(t, layer_builder(model), args.num_shapes, args.seed, progress=False)
        print(f"check: {args.num_shapes} off-grid shapes in {time.perf_counter() - start:.1f} s")
        print(format_summary(summarize(rows)))
        print(f"lookup cost inside an @njit loop ({args.lookups:.0e} random queries, thread CPU time, best of 7):")
        for name, ns in lookup_costs(t, args.lookups).items():
            print(f"  {name:28s} {ns:7.1f} ns/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
