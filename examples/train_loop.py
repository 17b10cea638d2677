"""Dynamic micro-batching in a plain PyTorch loop: DynaBatchDataLoader on the built-in mixture.

Each step is one token-budget global batch, cut by the planner into variable-size micro-batches; the
loss of micro-batch ``i`` is its summed token loss over the global batch's loss tokens, so the step's
gradient is that of the token-normalised loss however the batch was cut.

    python examples/train_loop.py                          # t5-tiny, 10 steps, CPU
    python examples/train_loop.py --model gpt2-tiny --method packing
    torchrun --nproc_per_node 2 examples/train_loop.py     # data parallel (gloo on CPU, nccl on GPU)

A ``--steps``, ``--threads``, ``--lr`` or ``--token-budget`` it cannot run (below 1, an lr not above 0, or a budget
below one maximal sample) is one line, exit 2, as in ``examples/hf_trainer.py``.

With several processes every rank builds the same loader with its own ``replica_index``; gradients are
summed (not averaged) over ranks, since each rank's loss is already divided by the global token count.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from dynabatch.data.mixture import MixtureSpec
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.builtin import default_mixture_path
from dynabatch.data.tokenize import load_tokenizer
from dynabatch.integrations.dataloader import METHODS, DynaBatchDataLoader
from dynabatch.integrations.example_args import (EXAMPLE_MODELS, check_token_budget, length_limits, positive,
                                                   positive_float)
from dynabatch.models.forward import forward_loss
from dynabatch.model_presets import sequence_kind
from dynabatch.models.presets import build_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="t5-tiny", choices=EXAMPLE_MODELS)
    p.add_argument("--method", default="dynamic", choices=METHODS)
    p.add_argument("--steps", type=positive, default=10)
    p.add_argument("--token-budget", type=positive, default=4096, help="real tokens per global batch")
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--threads", type=positive, default=1,
                   help="CPU threads (tiny models are dispatch-bound: 1 is fastest)")
    args = p.parse_args()
    check_token_budget(p, args.token_budget, args.model)  # one line, exit 2, before any data loads
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)

    family = sequence_kind(args.model)
    data = MixtureData.load(MixtureSpec.from_file(default_mixture_path()), load_tokenizer("builtin"), family)
    model = build_model(args.model, seed=0).to(device)  # same initial weights on every rank
    limits = length_limits(family)
    options = {"samples_per_micro_batch": 8} if args.method in ("padding", "length_grouped") else {}
    loader = DynaBatchDataLoader(
        data,
        limits,
        token_budget=args.token_budget,
        method=args.method,
        method_options=options,
        model_config=model.config if args.method == "dynamic" else None,
        num_replicas=world_size,
        replica_index=rank,
        max_steps=args.steps,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model.train()
    for step in loader:
        start = time.perf_counter()
        loss_total = torch.zeros((), device=device)
        for mb in step.micro_batches:
            loss = forward_loss(model, mb, loader.attention).loss_sum / step.num_loss_tokens  # as the loader priced it
            loss.backward()  # frees this micro-batch's activations before the next one
            loss_total += loss.detach()
        if world_size > 1:
            for p in model.parameters():  # variable micro-batch counts per rank: sum once, after the last
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
            dist.all_reduce(loss_total)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            shapes = " ".join("x".join(map(str, mb.shape)) for mb in step.micro_batches)
            print(
                f"step {step.step}: loss {loss_total.item():.4f} | {len(step.batch)} samples, "
                f"{step.num_loss_tokens} loss tokens | rank 0: {step.stats.num_micro_batches} micro-batches [{shapes}], "
                f"padding efficiency {step.stats.efficiency:.2f}, plan {step.stats.plan_time_s * 1e3:.1f} ms, "
                f"step {time.perf_counter() - start:.2f} s",
                flush=True,
            )
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
