"""Step time of the dynabatch executor vs torch.distributed.pipelining's Schedule1F1B, in one run.

What is compared (every rank holds both, built from the same seeded model, and runs them alternately):

* model: an HF ``GPT2LMHeadModel`` with *untied* head (``--layers``, ``--d-model``, vocab 8192),
  cut into ``--stages`` stages by ``dynabatch.models.split.layout_for``; each rank builds its
  ``GPT2Stage`` twice (two identical parameter copies);
* work: ``--micro-batches`` micro-batches of the same fixed shape (``--rows`` x ``--seq``, no
  padding), forward + backward with 1F1B order, then one AdamW step (lr 1e-4);
* ours: ``Executor.run`` of the lowered 1f1b plan (plan and token ids delivered once, reused every
  step: ``executor``), and the full ``train_step`` (planning, lowering, validation and delivery from
  rank 0 every step: ``train_step``). The step includes ``REDUCE`` (a no-op: one replica, no tied
  parameters) and ``STEP`` (a 2-float all-reduce for loss and grad norm, ``optimizer.step``);
* theirs: :class:`dynabatch.engine.torch_pipelining.TorchPipeliningPeer` (also ``dynabatch bench``'s
  method ``pipelining``): ``PipelineStage`` (static shapes) over the same ``GPT2Stage`` module, the
  segment ids and labels travelling with the activations, the last stage's token-loss sum divided by
  the step's tokens in ``loss_fn``, ``Schedule1F1B`` with ``scale_grads=False``, then the grad-norm
  all-reduce and ``optimizer.step()`` (no clipping here, like ours).

Timing: per step ``barrier; t0; step; barrier; t1`` on every rank (rank 0 reports), after warm-up
steps, the implementations interleaved step by step so that machine noise hits both alike; the
median and the ratio ours / theirs are printed (target <= 1.05). Losses of the first step are
printed for both as a sanity check (same parameters, same data).

Run: ``python scripts/bench_executor.py`` spawns ``--stages`` local processes (gloo on CPU, NCCL on
GPUs); under ``torchrun --nproc_per_node S scripts/bench_executor.py ...`` it uses torchrun's ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="measured steps per implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (CPU)")
    p.add_argument("--json", default=None, help="also write the results here (rank 0)")
    return p.parse_args(argv)


def build_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=8192, n_positions=max(1024, args.seq), n_embd=args.d_model, n_layer=args.layers,
        n_head=args.heads, n_inner=4 * args.d_model, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=1, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False, use_cache=False,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def worker(rank: int, world: int, args, init_method: str) -> None:
    from dynabatch.data.microbatch import CausalMicroBatch
    from dynabatch.models.split import build_stage, layout_for, micro_batch_inputs, pipeline_spec_for
    from dynabatch.engine.delivery import receive_step, send_step
    from dynabatch.engine.dist import init_distributed, shutdown
    from dynabatch.engine.executor import Executor
    from dynabatch.engine.step import step_payloads, train_step
    from dynabatch.schedule.step import lower_step as plan_step
    from dynabatch.engine.torch_pipelining import TorchPipeliningPeer, fixed_shape_inputs

    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    ctx = init_distributed(args.stages, 1, rank=rank, world_size=world, init_method=init_method, timeout_s=600)
    device, S, M = ctx.device, args.stages, args.micro_batches
    model = build_model(args)
    layout = layout_for(model, S)
    spec = pipeline_spec_for(model, layout, "float32" if device.type == "cpu" else "bfloat16")
    ours_stage = build_stage(model, layout, ctx.stage_index).to(device)
    theirs_stage = build_stage(model, layout, ctx.stage_index).to(device)
    del model

    # data: M fixed-shape micro-batches, no padding (targets are the next tokens)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 8192, (M * args.rows, args.seq + 1), generator=g)
    inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    seg = torch.ones(args.rows, args.seq, dtype=torch.long)
    pos = torch.arange(args.seq).expand(args.rows, args.seq).contiguous()
    mbs = [
        CausalMicroBatch(inputs[i * args.rows:(i + 1) * args.rows], targets[i * args.rows:(i + 1) * args.rows],
                         pos, seg, tuple((i * args.rows + r,) for r in range(args.rows)))
        for i in range(M)
    ]
    total_tokens = targets.numel()

    # ours
    opt_ours = torch.optim.AdamW(ours_stage.parameters(), lr=1e-4)
    ex = Executor(ours_stage, ctx, opt_ours)
    if ctx.is_planner:
        plans = plan_step([[(args.rows, args.seq, 0)] * M], spec, policy="1f1b")
        own, pending = send_step(step_payloads(plans, [mbs], spec, micro_batch_inputs), ctx.delivery_group, world)
        pending.wait()
    else:
        own = receive_step(ctx.delivery_group)
    step_counter = [0]

    def ours_executor():
        return ex.run(own).loss

    def ours_train_step():
        step_counter[0] += 1
        return train_step(ex, ctx, step_counter[0], [mbs] if ctx.is_planner else None, spec=spec, policy="1f1b",
                          inputs_fn=micro_batch_inputs).loss

    # theirs
    opt_theirs = torch.optim.AdamW(theirs_stage.parameters(), lr=1e-4)
    peer = TorchPipeliningPeer(theirs_stage, spec, ctx, opt_theirs)
    fixed = fixed_shape_inputs(mbs, spec, args.rows)[0] if ctx.stage_index == 0 else None

    def theirs():
        return peer.step(M, (args.rows, args.seq, 0), total_tokens, fixed)

    impls = {"executor": ours_executor, "train_step": ours_train_step, "pipelining_1f1b": theirs}
    first_loss = {}
    times: dict[str, list[float]] = {k: [] for k in impls}
    for i in range(args.warmup + args.steps):
        for name, fn in impls.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = fn()
            dist.barrier()
            t1 = time.perf_counter()
            if i == 0:
                first_loss[name] = loss
            if i >= args.warmup:
                times[name].append(t1 - t0)
    last_losses: list = [None] * world
    dist.all_gather_object(last_losses, first_loss)
    if ctx.is_planner:
        med = {k: statistics.median(v) for k, v in times.items()}
        report = {
            "config": vars(args) | {"device": str(device), "layout": layout.describe()},
            "median_step_s": med,
            "ratio_executor_vs_pipelining": med["executor"] / med["pipelining_1f1b"],
            "ratio_train_step_vs_pipelining": med["train_step"] / med["pipelining_1f1b"],
            "first_step_loss": {"ours": last_losses[-1]["executor"], "pipelining": last_losses[-1]["pipelining_1f1b"]},
        }
        print(f"layout {layout.describe()}; {M} micro-batches of {args.rows}x{args.seq}; {device}")
        for k, v in times.items():
            print(f"  {k:16s} median {med[k] * 1e3:8.1f} ms   min {min(v) * 1e3:8.1f}   max {max(v) * 1e3:8.1f}")
        print(f"  ratio executor / pipelining   {report['ratio_executor_vs_pipelining']:.3f}")
        print(f"  ratio train_step / pipelining {report['ratio_train_step_vs_pipelining']:.3f}")
        print(f"  first-step loss: ours {report['first_step_loss']['ours']:.6f}, "
              f"pipelining {report['first_step_loss']['pipelining']:.6f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
    shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
        return
    import torch.multiprocessing as mp

    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(worker, args=(args.stages, args, init), nprocs=args.stages, start_method="spawn")


if __name__ == "__main__":
    main()
