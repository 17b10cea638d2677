"""Estimate what a 2-stage layer split that moves by one layer unit per step would save, from a ``bench`` run.

A pipeline runs one layer split for every step, and steps differ: a step of long samples loads the stage with more
attention, a step of short ones the stage with the output head. A boundary that moved per step (the boundary unit
held by both stages, its side chosen per step) could even them out. This script reads a ``dynabatch bench --json``
result of a 2-stage run and, for each timed step of a method, takes its measured compute per device
(``stage_compute_s_measured``), splits it by the analytic cost model's share of each layer unit for the step's
samples (whole samples, the global batches the bench drew again from the same lengths file), and tries three
splits: as run, the first stage's last unit moved to the second stage, and the second stage's first unit moved to
the first. A step's time falls by what the best split takes off its busier device. Prints, per method, the summed
step time as measured and as estimated with the moves, and their ratio::

    python scripts/estimate_split_moves.py docs/benchmarks/long_tail/cpu_gpt2-d256-8k_8192_10steps_context_passes_2026-12-07.json

With ``--per-micro-batch`` the boundary unit's side is chosen per micro-batch instead of per step, so any share of
the unit's time in the step can move (up to all of it): the bound of a boundary that follows each micro-batch,
assuming the micro-batches are fine enough to cut that share.

An estimate, not a measurement: it assumes a unit's time moves with it unchanged and that idle time does not
change. Decoder-only models; the layout is read from the result (``layouts.linear``).
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.hardware import hardware_spec
from dynabatch.data.batching import LengthLimits
from dynabatch.models.families import analytic_spec
from dynabatch.models.presets import build_model
from dynabatch.training.workload import global_batches


def _kinds(stage: str) -> list[str]:
    """``embedding+gptx4+gpt_attn`` -> ``[embedding, gpt, gpt, gpt, gpt, gpt_attn]``."""
    out = []
    for part in stage.strip().split("+"):
        kind, _, count = part.partition("x") if part.startswith("gptx") else (part, "", "")
        out += [kind] * (int(count) if count else 1)
    return out


def busier_after_move(a: float, b: float, last: float, first: float, per_micro_batch: bool = False) -> float:
    """The busier device's compute once the boundary unit is placed best.

    ``a`` and ``b`` are the two devices' compute in a step, ``last`` the first stage's last unit's share of ``a``,
    ``first`` the second stage's first unit's share of ``b``. Per step, a unit moves whole or not at all; per
    micro-batch, any part of it up to the whole moves, at most what evens the two devices out.
    """

    if per_micro_batch:
        to_second = min(last, max(a - b, 0.0) / 2)
        to_first = min(first, max(b - a, 0.0) / 2)
        return min(max(a - to_second, b + to_second), max(a + to_first, b - to_first))
    return min(max(a, b), max(a - last, b + last), max(a + first, b - first))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="a 2-stage `dynabatch bench --json` result of a decoder-only model")
    p.add_argument("--per-micro-batch", action="store_true",
                   help="choose the boundary unit's side per micro-batch (any share of it moves), not per step")
    p.add_argument("--vocab-size", type=int, default=8192, help="the run's vocabulary (default: the built-in tokenizer's)")
    args = p.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    config = result["config"]
    stages = [_kinds(s) for s in result["layouts"]["linear"].split("|")]
    if len(stages) != 2:
        raise SystemExit(f"{args.result}: a 2-stage run is needed, the layout has {len(stages)} stages")
    model = build_model(config["model"], vocab_size=args.vocab_size)
    analytic = AnalyticCostModel(analytic_spec(model.config), hardware_spec("cpu"))
    limits = LengthLimits("gpt2", max_input_len=config["max_input_len"], max_target_len=config["max_target_len"],
                          max_seq_len=config["max_input_len"])
    batches = global_batches(config["lengths"], "gpt2", limits, config["global_batch_tokens"],
                             config["untimed_steps"] + config["timed_steps"])[config["untimed_steps"]:]

    for method, row in result["methods"].items():
        measured = moved = 0.0
        for batch, step in zip(batches, row["per_step"]):
            lengths = np.asarray(batch.input_lens, dtype=np.float64) + np.asarray(batch.target_lens)

            def seconds(kind: str) -> float:
                c = analytic.layer_cost(kind, np.ones_like(lengths), lengths, None)
                return float(np.sum(c.fwd_time_s + c.bwd_time_s))

            totals = [sum(seconds(k) for k in kinds) for kinds in stages]
            a, b = step["stage_compute_s_measured"]
            last = seconds(stages[0][-1]) / totals[0] * a  # the first stage's last unit, measured seconds
            first = seconds(stages[1][0]) / totals[1] * b  # the second stage's first unit
            best = busier_after_move(a, b, last, first, args.per_micro_batch)
            measured += step["time_s"]
            moved += step["time_s"] - (max(a, b) - best)
        print(f"{method}: {measured:.1f} s measured, {moved:.1f} s with a moving boundary"
              f"{' (per micro-batch)' if args.per_micro_batch else ''}: {measured / moved:.4f}x")


if __name__ == "__main__":
    main()
