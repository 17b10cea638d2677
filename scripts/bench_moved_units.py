"""What a boundary move costs in compute: each stage's forward + backward time of one micro-batch with the unit
beside the cut on its own stage (``cut``), run by the stage below (``up``) or above (``down``), against stages built
without moving boundaries (``plain``), on one thread, the four interleaved and repeated (medians printed).

The layout is the long-tail benchmark's GPT-2 split (``docs/benchmarks/long_tail/``): embedding, four blocks and
block 4's attention half | its MLP half, three blocks and the 8,192-word output head. A move pays where the stages'
summed time stays the same and the busier stage's falls; this script measures the first part::

    python scripts/bench_moved_units.py --reps 7
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from dynabatch.cost.boundary_moves import DOWN, STAY, UP, stage_moves
from dynabatch.cost.stages import StageLayout
from dynabatch.data.collate import collate_causal
from dynabatch.data.sample import TokenizedSample
from dynabatch.models.presets import EOS_ID, PAD_ID, build_model
from dynabatch.models.split import build_stages, micro_batch_inputs, pipeline_spec_for

LAYOUT = StageLayout((("embedding", "gpt", "gpt", "gpt", "gpt", "gpt_attn"),
                      ("gpt_mlp", "gpt", "gpt", "gpt", "lm_head")))
SHAPES = ((1, 4096), (4, 512), (8, 256))
"""(samples, tokens each) of the micro-batches timed: one long sample, then short ones."""


def micro_batch(tokens: int, samples: int):
    rng = np.random.default_rng(tokens)
    rows = [TokenizedSample(task="t", input_ids=np.append(rng.integers(5, 8000, tokens - 9), EOS_ID).astype(np.int32),
                            target_ids=np.append(rng.integers(5, 8000, 7), EOS_ID).astype(np.int32))
            for _ in range(samples)]
    return collate_causal(rows, [[i] for i in range(samples)], pad_id=PAD_ID)


def stage_seconds(stages, spec, stage: int, mb, row) -> float:
    """Forward + backward seconds of ``stage`` on ``mb`` with boundary moves ``row`` (``None``: plain stages); the
    stages before it run untimed, without gradients, to give it its inputs."""
    received = {}
    for k in range(stage):
        with torch.no_grad():
            received = stages[k](received, micro_batch_inputs(mb, spec, k),
                                 **({} if row is None else {"moves": stage_moves(row, k, len(stages))})).sends
    recv = {k: v.detach().requires_grad_() for k, v in received.items()}
    start = time.perf_counter()
    out = stages[stage](recv, micro_batch_inputs(mb, spec, stage),
                        **({} if row is None else {"moves": stage_moves(row, stage, len(stages))}))
    if stage == len(stages) - 1:
        out.loss_sum.backward()
    else:
        torch.autograd.backward(list(out.sends.values()), [torch.full_like(v, 1e-3) for v in out.sends.values()])
    seconds = time.perf_counter() - start
    for st in stages:
        st.zero_grad(set_to_none=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model("gpt2-d256-8k", dropout=0.0, seed=0).train()
    spec = pipeline_spec_for(model, LAYOUT)
    moving, plain = build_stages(model, LAYOUT, moving_boundaries=True), build_stages(model, LAYOUT)
    variants = (("plain", plain, None), ("cut", moving, STAY), ("down", moving, DOWN), ("up", moving, UP))
    for samples, tokens in SHAPES:
        mb = micro_batch(tokens, samples)
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.reps):
            for name, stages, move in variants:
                row = None if move is None else np.array([move], dtype=np.int8)
                for s in range(len(stages)):
                    times.setdefault((name, s), []).append(stage_seconds(stages, spec, s, mb, row))
        med = {k: float(np.median(v)) for k, v in times.items()}
        cut = med[("cut", 0)] + med[("cut", 1)]
        print(f"{samples} x {tokens} tokens: " + ", ".join(
            f"{name} {med[(name, 0)]:.3f} + {med[(name, 1)]:.3f} = {med[(name, 0)] + med[(name, 1)]:.3f} s "
            f"({(med[(name, 0)] + med[(name, 1)]) / cut:.3f}x cut)" for name, _, _ in variants), flush=True)


if __name__ == "__main__":
    main()
