"""`dynabatch simulate` on a measured cost profile instead of the analytic model: every method planned, scheduled and
simulated with a profile's per-layer tables (e.g. the t5-small profile measured on the H200,
``docs/benchmarks/gpu_h200/t5_small_h200_profile_2026-12-04.json``).

    python scripts/simulate_profile.py --profile docs/benchmarks/gpu_h200/t5_small_h200_profile_2026-12-04.json \\
        --stages 1,2,4 --max-input-len 2048 --global-batch-tokens 65536 [--lengths data/heavy_tail_2048.npz]

Prints, per stage count, each method's simulated real tokens/s, micro-batches per step and bubble, and the ratio
of dynamic to the best baseline. Shapes beyond the profile's grid cannot be priced: a method whose micro-batches
fall outside it is reported as such (see ``dynabatch.cost.planner_model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--stages", default="1,2,4")
    p.add_argument("--methods", default="dynamic,packing_free,token_budget,padding")
    p.add_argument("--max-input-len", type=int, default=2048)
    p.add_argument("--max-target-len", type=int, default=512)
    p.add_argument("--global-batch-tokens", type=int, default=65536)
    p.add_argument("--num-batches", type=int, default=4)
    p.add_argument("--lengths", default=None)
    p.add_argument("--memory-gib", type=float, default=60.0)
    p.add_argument("--packing-free-rows", type=int, default=8)
    p.add_argument("--token-budget-tokens", type=int, default=16384)
    p.add_argument("--samples-per-micro-batch", type=int, default=16)
    p.add_argument("--pack-rows", default="off", choices=("off", "auto", "flat"))
    p.add_argument("--link-preset", default="h200", help="hardware preset whose links price the sends between stages")
    p.add_argument("--tune", action="store_true", help="also each baseline at its best knob value (simulate --tune-baselines)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from dynabatch.commands.common import Workload
    from dynabatch.commands.simulate import SimulateOptions, simulate_method, simulation_workload
    from dynabatch.commands.simulate import tune_simulated
    from dynabatch.cost.planner_model import UNPRICED, ProfiledLayerModel
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.cost.tables import CostTables
    from dynabatch.data.baselines import BaselineOptions
    from dynabatch.data.batching import LengthLimits
    from dynabatch.data.builtin import default_mixture_path
    from dynabatch.training.workload import global_batches

    from dynabatch.cost.hardware import hardware_spec

    class ProfiledWithLinks(ProfiledLayerModel):
        """The profile's layers, and sends between stages priced by the ``--link-preset`` hardware's NVLink
        (the profile measured one device: it has no p2p times)."""

        hardware = hardware_spec(args.link_preset)

        def send_time(self, num_bytes, link: str = "intra"):
            return self.hardware.send_time(num_bytes, link)

    tables = CostTables.load(args.profile)
    layer_model = ProfiledWithLinks(tables)
    family = tables.family
    limits = LengthLimits(family, max_input_len=args.max_input_len, max_target_len=args.max_target_len,
                          max_seq_len=args.max_input_len)
    options = BaselineOptions(samples_per_micro_batch=args.samples_per_micro_batch,
                              token_budget_tokens=args.token_budget_tokens, packing_free_rows=args.packing_free_rows)
    path = args.lengths or default_mixture_path()
    batches = global_batches(path, family, limits, args.global_batch_tokens, args.num_batches, "builtin")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    out = {"profile": args.profile, "device": tables.meta.get("device"), "lengths": path, "stages": {}}
    for stages in (int(s) for s in args.stages.split(",")):
        layout = balanced_layout(layer_model, stages, ref_shape=(4, min(args.max_input_len, 512), min(args.max_target_len, 128)))
        cost = StageCostModel(layer_model, layout, args.memory_gib * 2**30)
        w = simulation_workload(Workload(path, family, limits, cost, options, split_blocks=False))
        rows, tuned = {}, {}
        sim_options = SimulateOptions(pack_rows=args.pack_rows)
        for m in methods:
            s = simulate_method(m, batches, w, sim_options)
            priced = s.step_s < UNPRICED  # micro-batches beyond the profile's grid cannot be priced
            rows[m] = {"tokens_per_s": s.tokens_per_s if priced else None, "fits": s.fits_memory,
                       "micro_batches_per_step": s.micro_batches / len(batches), "bubble": s.bubble_fraction}
            if args.tune and m != "dynamic":
                t = tune_simulated(m, batches, w, sim_options, s if priced else None)
                tuned[m] = {"knob": t.option, "value": t.value, "tokens_per_s": t.tokens_per_s}
        best_of = {m: max(x for x in (r["tokens_per_s"], tuned.get(m, {}).get("tokens_per_s")) if x is not None)
                   for m, r in rows.items() if m != "dynamic" and (r["tokens_per_s"] or tuned.get(m, {}).get("tokens_per_s"))}
        best = max(best_of, key=best_of.get) if best_of else None
        out["stages"][stages] = {"methods": rows, "tuned": tuned, "best_baseline": best}

        def show(m, r):
            speed = f"{r['tokens_per_s']:,.0f} tok/s" if r["tokens_per_s"] is not None else "off the profile's grid"
            extra = f", tuned {tuned[m]['knob']} {tuned[m]['value']}: {tuned[m]['tokens_per_s']:,.0f}" if m in tuned and \
                tuned[m]["tokens_per_s"] else ""
            return f"{m} {speed} ({r['micro_batches_per_step']:.1f} mbs, bubble {r['bubble']:.3f}{extra})"

        print(f"{stages} stage(s): " + "; ".join(show(m, r) for m, r in rows.items()))
        if best and rows.get("dynamic", {}).get("tokens_per_s"):
            print(f"  dynamic / best {'tuned ' if tuned else ''}baseline ({best}): "
                  f"{rows['dynamic']['tokens_per_s'] / best_of[best]:.3f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
