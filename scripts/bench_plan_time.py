"""Planning time per global batch: ``dynabatch plan``'s dynamic method, and the main job's step planner.

Two measurements, each printed as median, p10-p90 and max over every timed batch (CPU time of this process,
``time.process_time``: less sensitive than wall time to other jobs on shared cores), with the parts:

* ``plan`` (default): what ``dynabatch plan --model MODEL --methods dynamic`` times per global batch (the wall
  time of ``GlobalPlanner.plan``, printed too, beside this process's CPU time), planned as the command plans it
  (the batches' kept length limits, the layer split balanced over dynamic's micro-batches), on the 65,536-token
  global batches of ``--lengths`` (default ``data/heavy_tail_1024.npz``). The batches of a lengths file are few,
  so each is planned ``--rounds`` times (after one warm-up batch); plans are deterministic, so every round repeats
  the same work. The parts: ``dp`` (the partition DP, ``plan_step``), ``candidates`` (the baselines' plans built
  and their micro-batches priced), ``choice`` (the step formula over every candidate), and the cost-model time
  inside each (``cost in ...``, with the entries priced per batch). Then the DP's cost-model calls of the first
  batch are replayed ``--replays`` times on their own (wall time, with the minimum: the cost model alone, the
  figure least moved by other jobs).
* ``--trainer``: the main job's planner in-process (``StepPlanner``: t5-tiny, the built-in mixture, 2 stages,
  8,192-token global batches, ``scripts/run.sh``'s setting), ``--steps`` steps after 3 warm-up steps, for each
  ``--pack-rows`` value given (default ``off,auto``), interleaved over ``--repeats`` rounds so both see the same
  background load; prints auto / off.

* ``--group-samples N``: each baseline batcher's grouping of one batch of the first ``N`` samples of ``--lengths``
  (lengths only, the batchers' own passes: best-fit rows, token budgets, sorting).

    python scripts/bench_plan_time.py --lengths data/heavy_tail_1024.npz
    python scripts/bench_plan_time.py --trainer --steps 20 --repeats 3
    python scripts/bench_plan_time.py --lengths data/heavy_tail_1024.npz --group-samples 2000

The last line is JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "numba"))

import numpy as np  # noqa: E402


def spread(values_s: list[float]) -> dict:
    """Median, p10, p90 and max in milliseconds."""
    ms = np.asarray(values_s) * 1e3
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "max_ms": float(ms.max()), "n": int(ms.size)}


def line(name: str, s: dict) -> str:
    return (f"{name:<22} median {s['median_ms']:7.1f} ms  p10-p90 {s['p10_ms']:6.1f}-{s['p90_ms']:<6.1f} "
            f"max {s['max_ms']:6.1f}  (n={s['n']})")


class _Parts:
    """CPU time spent inside named functions during a timed call, by wrapping them while it is installed (the
    planner's own code is not touched): the partition DP (``GlobalPlanner._dp``), the baseline candidates
    (``baseline_candidates``; on the step formula's path ``baseline_settings`` and ``price_settings``), the
    step-formula choice (``formula_prices``; ``formula_choice``), and the cost-model calls made inside each
    (``StageCostModel.evaluate``, and ``evaluate_variables`` where the DP prices its runs through it, with the
    entries priced). A name the tree lacks is left out (an older tree)."""

    def __init__(self) -> None:
        from dynabatch.cost import stages
        from dynabatch.plan import global_plan

        self.seconds: dict[str, float] = {}
        self.entries: dict[str, int] = {}
        self._inside: list[str] = []
        self._patched = [(global_plan.GlobalPlanner, "_dp", "dp"),
                         (global_plan, "baseline_candidates", "candidates"),
                         (global_plan, "baseline_settings", "candidates"),
                         (global_plan, "price_settings", "candidates"),
                         (global_plan, "formula_prices", "choice"),
                         (global_plan, "formula_choice", "choice"),
                         (stages.StageCostModel, "evaluate", None),
                         (stages.StageCostModel, "evaluate_variables", None)]
        self._patched = [(owner, name, label) for owner, name, label in self._patched if hasattr(owner, name)]
        self._saved = [getattr(owner, name) for owner, name, _ in self._patched]
        for owner, name, label in self._patched:
            setattr(owner, name, self._wrap(getattr(owner, name), label))

    def _wrap(self, fn, label):
        def timed(*args, **kwargs):
            if self._inside and self._inside[-1] is None:  # a cost-model call inside another (evaluate's own)
                return fn(*args, **kwargs)
            where = label or f"cost in {self._inside[-1] if self._inside else 'other'}"
            self._inside.append(label)
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[where] = self.seconds.get(where, 0.0) + time.process_time() - start
                self._inside.pop()
                if not label:
                    self.entries[where] = self.entries.get(where, 0) + _entries(fn, args[1:], kwargs)
        return timed

    def restore(self) -> None:
        for (owner, name, _), fn in zip(self._patched, self._saved):
            setattr(owner, name, fn)


def plan_command(a: argparse.Namespace) -> dict:
    """Per-batch time of ``dynabatch plan``'s dynamic method, as the command plans it (the batches' kept length
    limits, the layer split balanced over the method's micro-batches), with its parts."""
    import dataclasses

    from dynabatch.commands.common import add_workload_arguments, resolve, split_from_data
    from dynabatch.training.workload import global_batches, kept_limits, method_micro_batches

    if not a.default_malloc:  # as `dynabatch plan` runs (a tree without dynabatch.core.allocator: as it ran)
        try:
            from dynabatch.core.allocator import keep_freed_memory
        except ImportError:
            keep_freed_memory = None
        if keep_freed_memory is not None:
            keep_freed_memory()

    p = argparse.ArgumentParser()
    add_workload_arguments(p)
    argv = ["--model", a.model, "--global-batch-tokens", str(a.global_batch_tokens), "--num-batches", "100",
            "--pack-rows", a.pack_rows, "--max-input-len", str(a.max_input_len)]
    args = p.parse_args(argv + (["--lengths", a.lengths] if a.lengths else []))
    w = resolve(args)
    batches = global_batches(w.path, w.family, w.limits, args.global_batch_tokens, args.num_batches, args.tokenizer)
    w = dataclasses.replace(w, limits=kept_limits(w.limits, batches))  # as `dynabatch plan` does
    cost_model = split_from_data(w, batches, "dynamic").cost_model  # its default --layer-split data
    stages = cost_model.num_stages

    def plan(batch):
        return method_micro_batches("dynamic", batch, w.limits, cost_model, stages, w.options, pack_rows=a.pack_rows)

    plan(batches[0])  # warm
    wall, cpu, kept = [], [], {}
    parts: dict[str, list[float]] = {}
    entries: dict[str, list[int]] = {}
    for _ in range(a.rounds):
        for batch in batches:
            watch = _Parts()
            try:
                start = time.process_time()
                chosen = plan(batch)
                cpu.append(time.process_time() - start)
            finally:
                watch.restore()
            wall.append(chosen.plan_time_s)  # what `dynabatch plan` reports (wall time of GlobalPlanner.plan)
            kept[chosen.candidate] = kept.get(chosen.candidate, 0) + 1
            for k, v in watch.seconds.items():
                parts.setdefault(k, []).append(v)
            for k, v in watch.entries.items():
                entries.setdefault(k, []).append(v)
    replays = _replay_dp_cost_calls(plan, batches[0], a.replays)
    # every part over every batch (0 where a batch had none)
    parts = {k: v + [0.0] * (len(cpu) - len(v)) for k, v in parts.items()}
    samples = [len(b) for b in batches]
    out = {"mode": "plan", "model": a.model, "lengths": a.lengths, "pack_rows": a.pack_rows,
           "default_malloc": a.default_malloc,
           "global_batches": len(batches), "samples_per_batch": samples, "rounds": a.rounds,
           "layout": cost_model.layout.describe(), "per_batch_wall": spread(wall), "per_batch_cpu": spread(cpu),
           "parts_cpu": {k: spread(v) for k, v in sorted(parts.items())},
           "entries_priced_median": {k: float(np.median(v)) for k, v in sorted(entries.items())},
           "candidates_kept": kept, "dp_cost_calls": replays}
    print(f"{a.model}, {a.lengths or 'built-in mixture'}: {len(batches)} global batches of "
          f"{args.global_batch_tokens} tokens ({', '.join(map(str, samples))} samples), {a.rounds} rounds")
    print(line("per batch (wall)", out["per_batch_wall"]))
    print(line("per batch (cpu)", out["per_batch_cpu"]))
    for k, v in out["parts_cpu"].items():
        priced = out["entries_priced_median"].get(k)
        print(line(f"  {k}", v), "" if priced is None else f"{priced:.0f} entries priced (median)")
    print("kept:", kept)
    print(line("dp cost calls, replayed", replays), f"min {replays['min_ms']:.2f} ms ({replays['calls']} calls, "
          f"{replays['entries']} entries, first batch)")
    return out


def _entries(fn, args, kwargs) -> int:
    """The entries a cost-model call prices (``args``: its arguments after the model): ``evaluate(b, E, D, ...)``'s
    ``b``, ``evaluate_variables(x)``'s columns."""
    if fn.__name__ == "evaluate_variables":
        return int(np.shape(args[0] if args else kwargs["x"])[1])
    return int(np.size(args[0] if args else kwargs["b"]))


def _replay_dp_cost_calls(plan, batch, replays: int) -> dict:
    """The partition DP's cost-model calls of planning ``batch`` once (``StageCostModel.evaluate`` and
    ``evaluate_variables`` where the tree has it, recorded with their arguments), then replayed ``replays`` times:
    the wall time of the cost model alone on the DP's own queries, with its minimum (the least disturbed replay on a
    shared machine)."""
    from dynabatch.cost import stages
    from dynabatch.plan import global_plan

    calls, inside = [], []
    names = [name for name in ("evaluate", "evaluate_variables") if hasattr(stages.StageCostModel, name)]
    saved = {name: getattr(stages.StageCostModel, name) for name in names}
    dp = global_plan.GlobalPlanner._dp

    def recording(fn):
        def recorded(self, *args, **kwargs):
            if inside and inside[-1]:  # in the DP, not inside another cost-model call (evaluate's own)
                calls.append((fn, self, args, kwargs))
            inside.append(False)
            try:
                return fn(self, *args, **kwargs)
            finally:
                inside.pop()
        return recorded

    def in_dp(self, *args, **kwargs):
        inside.append(True)
        try:
            return dp(self, *args, **kwargs)
        finally:
            inside.pop()

    for name in names:
        setattr(stages.StageCostModel, name, recording(saved[name]))
    global_plan.GlobalPlanner._dp = in_dp
    try:
        plan(batch)
    finally:
        for name in names:
            setattr(stages.StageCostModel, name, saved[name])
        global_plan.GlobalPlanner._dp = dp
    times = []
    for _ in range(replays):
        start = time.perf_counter()
        for fn, model, args, kwargs in calls:
            fn(model, *args, **kwargs)
        times.append(time.perf_counter() - start)
    return {**spread(times), "min_ms": 1e3 * min(times), "calls": len(calls),
            "entries": sum(_entries(fn, args, kwargs) for fn, _, args, kwargs in calls)}


def trainer(a: argparse.Namespace) -> dict:
    """Per-step CPU time of the main job's planner for each ``--pack-rows`` value, interleaved."""
    from dynabatch.training.config import TrainConfig
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.training.trainer import load_training_data
    from dynabatch.data.tokenize import load_tokenizer
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model

    modes = a.pack_rows.split(",")
    base = TrainConfig(model="t5-tiny", stages=2)
    data = load_training_data(base, load_tokenizer("builtin"), "t5")
    model = build_model("t5-tiny", vocab_size=data.tokens.vocab_size)
    cost = planner_cost_model(base, model.config, layout_for(model, 2))
    limits = LengthLimits("t5", max_input_len=base.max_input_len, max_target_len=base.max_target_len)
    times: dict[str, list[float]] = {m: [] for m in modes}
    chosen: dict[str, dict[str, int]] = {m: {} for m in modes}
    for _ in range(a.repeats):
        for mode in modes:
            cfg = TrainConfig(model="t5-tiny", stages=2, pack_rows=mode)
            planner = StepPlanner(GlobalBatcher(data, limits, token_budget=cfg.global_batch_tokens), cfg, cost,
                                  data.tokens)
            for k in range(3 + a.steps):
                t0 = time.process_time()
                planned = planner()
                if k >= 3:
                    times[mode].append(time.process_time() - t0)
                    chosen[mode][planned.candidate] = chosen[mode].get(planned.candidate, 0) + 1
    out = {"mode": "trainer", "steps": a.steps, "repeats": a.repeats,
           **{m: {**spread(times[m]), "candidates": chosen[m]} for m in modes}}
    print(f"t5-tiny, built-in mixture, 2 stages, 8,192-token batches: {a.steps} steps x {a.repeats} rounds per mode")
    for m in modes:
        print(line(f"pack_rows={m}", out[m]), chosen[m])
    if "off" in out and "auto" in out:
        out["auto_over_off"] = out["auto"]["median_ms"] / out["off"]["median_ms"]
        print(f"auto / off (medians): {out['auto_over_off']:.2f}x")
    return out


def batchers(a: argparse.Namespace) -> dict:
    """Per-call wall time of each baseline batcher's grouping (``Batcher.group``, lengths only, no memo) on one batch
    of the first ``--group-samples`` samples of ``--lengths``, at the default knob values."""
    from dynabatch.core.methods import BASELINE_METHODS, check_method_family
    from dynabatch.data.baselines import Batcher, BaselineOptions, GROUPING_TOKENS, make_batcher
    from dynabatch.data.batching import LengthLimits

    lengths = np.load(a.lengths)
    e, d = lengths["input_len"][:a.group_samples], lengths["target_len"][:a.group_samples]
    family = "t5" if a.model == "t5" else "gpt"
    limits = LengthLimits("t5", max_input_len=int(e.max()), max_target_len=int(d.max())) if family == "t5" else \
        LengthLimits("gpt", max_input_len=int((e + d).max()), max_target_len=int(d.max()), max_seq_len=int((e + d).max()))

    class Lengths:  # a lengths-only batch, as the candidates group it
        input_lens, target_lens = e, d

        def __len__(self) -> int:
            return int(e.size)

    out = {}
    options = BaselineOptions()
    for method in BASELINE_METHODS:
        try:
            check_method_family(method, family)
        except ValueError:
            continue
        batcher = make_batcher(method, limits, GROUPING_TOKENS, **options.batcher_options(method, limits))
        if type(batcher).prepare is not Batcher.prepare:  # packing_free_split cuts samples first: packing_free's rows
            continue
        batcher.group(Lengths())  # warm (numba)
        times = []
        for _ in range(a.rounds * 4):
            start = time.perf_counter()
            batcher.group(Lengths())
            times.append(time.perf_counter() - start)
        out[method] = spread(times)
        print(line(method, out[method]))
    return {"mode": "batchers", "samples": int(e.size), "lengths": a.lengths, **out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", action="store_true", help="time the main job's step planner instead")
    p.add_argument("--model", default="t5")
    p.add_argument("--lengths", default="data/heavy_tail_1024.npz", help="lengths file ('' for the built-in mixture)")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--global-batch-tokens", type=int, default=65_536)
    p.add_argument("--pack-rows", default=None, help="plan: off (default); --trainer: off,auto")
    p.add_argument("--rounds", type=int, default=5, help="plan: times each global batch is planned")
    p.add_argument("--default-malloc", action="store_true",
                   help="plan: leave the C allocator as it is (dynabatch plan keeps freed memory, core.allocator)")
    p.add_argument("--group-samples", type=int, default=0,
                   help="time each baseline batcher's grouping of the first N samples of --lengths instead")
    p.add_argument("--replays", type=int, default=40,
                   help="plan: times the DP's cost-model calls of the first batch are replayed (timed alone)")
    p.add_argument("--steps", type=int, default=20, help="--trainer: timed steps per mode and round")
    p.add_argument("--repeats", type=int, default=3, help="--trainer: interleaved rounds")
    a = p.parse_args()
    a.pack_rows = a.pack_rows or ("off,auto" if a.trainer else "off")
    a.lengths = a.lengths or None
    print(json.dumps(trainer(a) if a.trainer else batchers(a) if a.group_samples else plan_command(a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
