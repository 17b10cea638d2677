"""Token slicing (TeraPipe) on a heavy-tailed mixture: step time and peak memory with and without slicing.

Both parts plan every global batch twice with the dynamic planner, once as is and once with
``slice_cost_model`` (long samples that dominate the pipeline bubble or do not fit memory whole run as
chains of token slices), and print the two side by side.

* ``simulated``: paper scale, analytic cost model (``--sim-model`` on ``--sim-hardware``, ``--sim-stages``
  stages, one device each). Each plan gets its stage costs (slices priced with their context,
  :func:`~dynabatch.plan.slice_costs.slice_stage_costs`), the best schedule (``choose_schedule``, slice
  chains respected) and its simulation: step time and the largest per-device memory (model states
  included). A batch whose longest sample does not fit a device unsliced is reported as such.
* ``measured``: this machine, GPT-2 ``--cpu-model`` split in 2 stages, 2 gloo processes, the real
  executor. Per global batch both variants run one training step each, alternating which goes first
  (the optimizer is not stepped, so both see the same weights); reported: the median step time over
  batches and the peak activation bytes autograd saved on the busiest rank
  (:class:`~dynabatch.engine.memory.SavedActivationMeter`; the CPU allocator has no peak counter).

Lengths (``heavy_tail_lengths``): 85% of the samples are FLAN-like short ones (lognormal, median about
200 tokens), 15% come from a long tail spread evenly over [max/4, max]; GPT sequences are input +
target, the target an eighth of the sample.

    python scripts/bench_slicing.py                          # both parts, about 3 minutes here
    python scripts/bench_slicing.py --part simulated --sim-max-lens 2048,4096,8192
    python scripts/bench_slicing.py --part measured --cpu-max-len 2048 --cpu-steps 4

The last line is JSON with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".cache", "numba"))

import numpy as np  # noqa: E402

VOCAB = 1024


def heavy_tail_lengths(num_tokens: int, max_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(input_len, target_len) of samples adding up to about ``num_tokens`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < num_tokens:
        if rng.random() < 0.15:
            n = int(rng.integers(max_len // 4, max_len + 1))
        else:
            n = int(np.clip(rng.lognormal(np.log(200), 0.6), 8, max_len))
        out.append(n)
        total += n
    lens = np.array(out, dtype=np.int64)
    target = np.maximum(1, lens // 8)
    return lens - target, target


def plan_sliced(e, d, stage_model, slicer, num_stages: int, memory=None):
    """The dynamic plan of one batch with token slicing, as the trainer plans it (one replica)."""
    from dynabatch.plan.step import plan_step
    from dynabatch.training.step_score import simulated_step_time

    return plan_step(e, d, stage_model, num_stages, family="gpt2", slice_cost_model=slicer,
                     score=simulated_step_time(stage_model, slicer, memory))


def plan_both(e, d, stage_model, slicer, num_stages: int, memory=None):
    """The dynamic plan of one batch without and with token slicing (one replica)."""
    from dynabatch.plan.step import plan_step

    return plan_step(e, d, stage_model, num_stages, family="gpt2"), plan_sliced(e, d, stage_model, slicer, num_stages, memory)


def plan_costs(plan, stage_model, slicer):
    """Per-stage costs and slice links of a plan's only replica."""
    from dynabatch.plan.slice_costs import piece_costs

    links = plan.slice_links(0)
    return piece_costs(stage_model, slicer, [p.shape for p in plan.replicas[0]], plan.contexts(0), links), links


# ------------------------------------------------------------------------------------------ simulated


def simulated(a) -> list[dict]:
    from dynabatch.cost.analytic import AnalyticCostModel
    from dynabatch.cost.hardware import hardware_spec
    from dynabatch.cost.model_specs import model_spec
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.plan.slice_costs import AnalyticSliceCostModel
    from dynabatch.schedule.policies import choose_schedule

    model = AnalyticCostModel(model_spec(a.sim_model), hardware_spec(a.sim_hardware))
    S = a.sim_stages
    print(f"\nsimulated: {a.sim_model} on {a.sim_hardware}, {S} stages, {a.sim_batch_tokens} tokens per global batch, "
          f"{a.sim_batches} batches per max length (analytic cost model, predicted)")
    print(f"{'max len':>7} | {'step s (whole)':>14} {'step s (sliced)':>15} {'speed-up':>8} | "
          f"{'peak GiB (whole)':>16} {'peak GiB (sliced)':>17} | {'sliced/batch':>12} {'slices/batch':>12}")
    rows = []
    for max_len in (int(x) for x in a.sim_max_lens.split(",")):
        layout = balanced_layout(model, S, ref_shape=(1, max_len, 0))
        stage_model = StageCostModel(model, layout, model.hardware.memory_bytes)
        slicer = AnalyticSliceCostModel.from_stage_model(stage_model, ref_length=max_len)
        limit = model.hardware.memory_bytes
        states = np.array(stage_model.model_state_bytes)
        res = {"whole": [], "sliced": [], "peak_whole": [], "peak_sliced": [], "num_sliced": [], "num_slices": [],
               "whole_fits": True}
        for k in range(a.sim_batches):
            e, d = heavy_tail_lengths(a.sim_batch_tokens, max_len, a.seed + k)
            try:
                plain, sliced = plan_both(e, d, stage_model, slicer, S, limit)
            except ValueError:  # some sample does not fit unsliced: only the sliced plan exists
                res["whole_fits"] = False
                plain, sliced = None, plan_sliced(e, d, stage_model, slicer, S, limit)
            for name, plan in (("whole", plain), ("sliced", sliced)):
                if plan is None:
                    continue
                costs, links = plan_costs(plan, stage_model, slicer)
                _, sim = choose_schedule(costs, limit, model_state_bytes=states, links=links)
                res[name].append(sim.makespan_s)
                res["peak_" + name].append(float(sim.peak_memory_bytes.max()))
            res["num_sliced"].append(len(sliced.sliced_samples))
            res["num_slices"].append(sum(p.is_slice for p in sliced.replicas[0]))
        row = {
            "max_len": max_len,
            "step_s_whole": float(np.mean(res["whole"])) if res["whole_fits"] else None,
            "step_s_sliced": float(np.mean(res["sliced"])),
            "peak_gib_whole": float(max(res["peak_whole"])) / 2**30 if res["whole_fits"] else None,
            "peak_gib_sliced": float(max(res["peak_sliced"])) / 2**30,
            "sliced_samples_per_batch": float(np.mean(res["num_sliced"])),
            "slices_per_batch": float(np.mean(res["num_slices"])),
        }
        row["speedup"] = row["step_s_whole"] / row["step_s_sliced"] if row["step_s_whole"] else None
        rows.append(row)
        whole = f"{row['step_s_whole']:>14.3f}" if row["step_s_whole"] else f"{'does not fit':>14}"
        peak = f"{row['peak_gib_whole']:>16.1f}" if row["peak_gib_whole"] else f"{'-':>16}"
        speed = f"{row['speedup']:>7.2f}x" if row["speedup"] else f"{'-':>8}"
        print(f"{max_len:>7} | {whole} {row['step_s_sliced']:>15.3f} {speed} | {peak} {row['peak_gib_sliced']:>17.1f} | "
              f"{row['sliced_samples_per_batch']:>12.1f} {row['slices_per_batch']:>12.1f}")
    return rows


# ------------------------------------------------------------------------------------------ measured


def _samples(e, d, seed):
    from dynabatch.data.sample import TokenizedSample

    rng = np.random.default_rng(seed)
    return [TokenizedSample("t", rng.integers(3, VOCAB, n).astype(np.int32), rng.integers(3, VOCAB, m).astype(np.int32))
            for n, m in zip(e.tolist(), d.tolist())]


def _worker(rank: int, a, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    from dynabatch.cost.analytic import AnalyticCostModel
    from dynabatch.cost.hardware import hardware_spec
    from dynabatch.models.families import analytic_spec
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.data.collate import collate_causal
    from dynabatch.models.presets import PAD_ID, build_model
    from dynabatch.models.split import build_stage, layout_for, pipeline_spec_for
    from dynabatch.plan.slice_costs import AnalyticSliceCostModel
    from dynabatch.engine.dist import init_distributed, shutdown
    from dynabatch.engine.executor import Executor
    from dynabatch.engine.memory import SavedActivationMeter
    from dynabatch.training.units import micro_batches_of, plan_units
    from dynabatch.engine.step import train_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ctx = init_distributed(2, 1, rank=rank, world_size=2, init_method=f"file://{workdir}/init", timeout_s=600)
    model = build_model(a.cpu_model, vocab_size=VOCAB, dropout=0.0, seed=0).train()
    layout = layout_for(model, 2)
    spec = pipeline_spec_for(model, layout, "float32")
    stage = build_stage(model, layout, ctx.stage_index)
    opt = torch.optim.SGD(stage.parameters(), lr=0.0)  # lr 0: both variants see the same weights every step
    ex = Executor(stage, ctx, opt)
    stage_model = StageCostModel(AnalyticCostModel(analytic_spec(model.config, dtype_bytes=4), hardware_spec("cpu")),
                                 layout, 4 * 2**30, memory_margin=0.0)
    slicer = AnalyticSliceCostModel.from_stage_model(stage_model, ref_length=a.cpu_max_len)
    del model
    times: dict[str, list[float]] = {"whole": [], "sliced": []}
    peaks: dict[str, list[int]] = {"whole": [], "sliced": []}
    counts = []
    step = 0
    for k in range(a.cpu_steps + 1):  # batch 0 warms up (numba, allocator) and is not reported
        variants = None
        if ctx.is_planner:
            e, d = heavy_tail_lengths(a.cpu_batch_tokens, a.cpu_max_len, a.seed + 1000 + k)
            samples = _samples(e, d, k)
            plain, sliced = plan_both(e, d, stage_model, slicer, 2)
            counts.append((len(sliced.sliced_samples), sum(p.is_slice for p in sliced.replicas[0])))
            variants = {}
            for name, plan in (("whole", plain), ("sliced", sliced)):
                mbs, links, _ = micro_batches_of(plan_units(plan, 0), lambda g: collate_causal(samples, g.rows, PAD_ID))
                variants[name] = (mbs, links)
        order = ("whole", "sliced") if k % 2 == 0 else ("sliced", "whole")
        for name in order:
            mbs, links = variants[name] if variants else (None, ())
            with SavedActivationMeter(exclude=stage.parameters()) as meter:
                dist.barrier()
                t0 = time.perf_counter()
                train_step(ex, ctx, step, [mbs] if mbs else None, spec=spec, policy="auto",
                           slice_links=[links] if mbs else None)
                dist.barrier()
                elapsed = time.perf_counter() - t0
            step += 1
            if k > 0:
                times[name].append(elapsed)
                peaks[name].append(meter.peak_bytes)
    gathered = [None, None]
    dist.all_gather_object(gathered, peaks)
    if ctx.is_planner:
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump({"times": times, "peaks": gathered, "counts": counts[1:]}, f)
    shutdown()


def measured(a) -> dict:
    import torch.multiprocessing as mp

    print(f"\nmeasured: {a.cpu_model}, 2 stages (gloo, 2 processes on this machine), max length {a.cpu_max_len}, "
          f"{a.cpu_batch_tokens} tokens per global batch, {a.cpu_steps} batches, each run whole and sliced")
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_worker, args=(a, workdir), nprocs=2, join=True)
        with open(os.path.join(workdir, "result.json")) as f:
            r = json.load(f)
    out = {"max_len": a.cpu_max_len, "model": a.cpu_model}
    print(f"{'variant':>7} | {'median step s':>13} {'min':>7} {'max':>7} | {'peak saved MiB (busiest rank)':>29}")
    for name in ("whole", "sliced"):
        t = np.array(r["times"][name])
        peak = max(max(p[name]) for p in r["peaks"]) / 2**20
        out[f"step_s_{name}"] = float(np.median(t))
        out[f"peak_mib_{name}"] = float(peak)
        print(f"{name:>7} | {np.median(t):>13.3f} {t.min():>7.3f} {t.max():>7.3f} | {peak:>29.1f}")
    out["speedup"] = out["step_s_whole"] / out["step_s_sliced"]
    out["memory_ratio"] = out["peak_mib_sliced"] / out["peak_mib_whole"]
    out["sliced_samples_per_batch"] = float(np.mean([c[0] for c in r["counts"]]))
    out["slices_per_batch"] = float(np.mean([c[1] for c in r["counts"]]))
    print(f"sliced / whole: step time {1 / out['speedup']:.2f}x (speed-up {out['speedup']:.2f}x), peak saved activations "
          f"{out['memory_ratio']:.2f}x; {out['sliced_samples_per_batch']:.1f} samples sliced into "
          f"{out['slices_per_batch']:.1f} slices per batch")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", default="simulated,measured", help="simulated, measured or both (comma-separated)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-model", default="gpt-1.3b")
    p.add_argument("--sim-hardware", default="a100-80gb")
    p.add_argument("--sim-stages", type=int, default=8)
    p.add_argument("--sim-max-lens", default="2048,4096,8192")
    p.add_argument("--sim-batch-tokens", type=int, default=32768)
    p.add_argument("--sim-batches", type=int, default=4)
    p.add_argument("--cpu-model", default="gpt2-mini")
    p.add_argument("--cpu-max-len", type=int, default=2048)
    p.add_argument("--cpu-batch-tokens", type=int, default=12288)
    p.add_argument("--cpu-steps", type=int, default=4)
    a = p.parse_args(argv)
    parts = a.part.split(",")
    result = {}
    if "simulated" in parts:
        result["simulated"] = simulated(a)
    if "measured" in parts:
        result["measured"] = measured(a)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
