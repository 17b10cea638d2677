"""The engine on its own: one training step of variable-shape micro-batches through an HF model split in two.

dynabatch's lower layers are a library: this script uses the plan layer (the partition DP under a polynomial cost
model), the schedule layer (the 1F1B schedule lowered to per-rank instructions) and the pipeline engine (process
groups, plan delivery, p2p, the instruction executor) to run one step of a Hugging Face GPT-2 cut into two pipeline
stages, and never imports the training application (``dynabatch train``'s loop, planner service, calibration or
configuration). The micro-batches the planner makes have different shapes, which ``torch.distributed.pipelining``
(static shapes per schedule) cannot run in one step.

    python examples/engine_only.py                                            # starts its own two gloo ranks
    torchrun --standalone --nproc-per-node 2 examples/engine_only.py          # the same under torchrun

It takes no arguments (any is refused in one line, exit 2). Rank 0 prints the step's micro-batch shapes; every rank checks that no module of the training application was
imported and prints the step's loss (the global token-normalised loss, the same on both ranks).
tests/dist/test_engine_only.py runs it and compares the loss with the unsplit model's.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # it takes no arguments: one line and exit 2 for any (they were ignored)
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()

if __name__ == "__main__" and "RANK" not in os.environ:  # started directly: run as two local ranks, as
    from dynabatch.engine.launch import launch_local  # torchrun --standalone would (before the heavy imports)

    sys.exit(launch_local([os.path.abspath(__file__)], 2))  # 2 = NUM_STAGES

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dynabatch.data.collate import collate_causal
from dynabatch.data.microbatch import CausalMicroBatch
from dynabatch.data.sample import TokenizedSample
from dynabatch.models.split import build_stage, layout_for, pipeline_spec_for
from dynabatch.plan.costs import PolynomialCostModel
from dynabatch.plan.step import plan_step
from dynabatch.engine.dist import init_distributed, shutdown
from dynabatch.engine.executor import Executor
from dynabatch.engine.step import micro_batch_shape, train_step
from dynabatch.schedule.step import lower_step

NUM_STAGES = 2
VOCAB = 512
PAD_ID = 0
SEED = 0
LENGTHS = ((5, 3), (40, 12), (9, 6), (22, 20), (3, 2), (60, 4), (14, 9), (7, 30), (31, 8), (11, 2))
"""``(input, target)`` token lengths of the step's samples: short and long, so the DP cuts micro-batches of
different shapes."""
APP_MODULES = ("dynabatch.training.trainer", "dynabatch.training.planner", "dynabatch.training.calibration",
               "dynabatch.training.config", "dynabatch.commands")
"""Modules of the training application (and the commands above it) this script must not import."""
COST_MODEL = PolynomialCostModel(overhead_s=2e-5, time_per_token_s=1e-6, time_per_token_pair_s=1e-8)
"""A stage's time and memory as a polynomial in the padded micro-batch shape (a small fixed cost per micro-batch,
so the DP splits this small step rather than padding it into one)."""


def make_model() -> GPT2LMHeadModel:
    """A tiny GPT-2 built from its config (no download), without dropout; the same weights on every rank."""
    torch.manual_seed(SEED)
    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=4, n_head=4, bos_token_id=1,
                        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config).train()


def make_samples() -> list[TokenizedSample]:
    """The step's samples: random token ids of the lengths in :data:`LENGTHS`."""
    rng = np.random.default_rng(SEED)
    return [TokenizedSample(task="demo", input_ids=rng.integers(3, VOCAB, n_in).astype(np.int32),
                            target_ids=rng.integers(3, VOCAB, n_tgt).astype(np.int32))
            for n_in, n_tgt in LENGTHS]


def plan_micro_batches(samples: list[TokenizedSample]) -> list[CausalMicroBatch]:
    """The plan layer: cut the samples into micro-batches (the partition DP under :data:`COST_MODEL`), each
    collated to its planned shape, in execution order."""
    input_lens = np.array([s.input_len for s in samples], dtype=np.int64)
    target_lens = np.array([s.target_len for s in samples], dtype=np.int64)
    plan = plan_step(input_lens, target_lens, COST_MODEL, NUM_STAGES, family="gpt2")
    return [collate_causal(samples, group.rows, PAD_ID, group.encoder_len) for group in plan.to_row_groups(0)]


def say(line: str) -> None:
    """Print one line in a single write, so two ranks sharing a terminal or pipe never interleave within it."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    ctx = init_distributed(NUM_STAGES, 1, backend="gloo")  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the launcher
    torch.set_num_threads(1)
    model = make_model()
    layout = layout_for(model, NUM_STAGES)
    spec = pipeline_spec_for(model, layout, "float32")
    stage = build_stage(model, layout, ctx.stage_index)
    del model
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    executor = Executor(stage, ctx, optimizer, autocast_dtype=None)  # collective: both ranks build theirs
    micro_batches = plans = None
    if ctx.is_planner:  # rank 0 plans the step, lowers it (the schedule layer) and delivers each rank its part
        micro_batches = plan_micro_batches(make_samples())
        shapes = [micro_batch_shape(mb) for mb in micro_batches]
        plans = lower_step([shapes], spec, policy="1f1b", step=0)
        say(f"micro-batch shapes (b, T, 0): {shapes}")
    result = train_step(executor, ctx, 0, [micro_batches] if ctx.is_planner else None, spec=spec, plans=plans)
    imported = [m for m in APP_MODULES if m in sys.modules]
    if imported:
        raise SystemExit(f"rank {ctx.rank}: the engine imported the training application: {', '.join(imported)}")
    say(f"rank {ctx.rank}: app modules imported: none; loss {result.loss!r} over {result.num_loss_tokens} loss tokens")
    shutdown()


if __name__ == "__main__":
    main()
