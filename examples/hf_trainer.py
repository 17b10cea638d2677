"""DynaBatchTrainer: Hugging Face Trainer with dynamic micro-batching on the built-in mixture.

One optimizer step = one token-budget global batch, cut into a variable number of variable-size
micro-batches; the logged ``loss`` is the token-normalised loss of the step. Logging, checkpoints,
evaluation and resuming are the Trainer's (``TrainingArguments``). Evaluation runs on a held-out set:
the same built-in tasks generated with other seeds.

    python examples/hf_trainer.py                               # t5-tiny, 12 steps, CPU, in a temporary folder
    python examples/hf_trainer.py --model gpt2-tiny
    python examples/hf_trainer.py --output-dir runs/hf                      # checkpoints in runs/hf
    python examples/hf_trainer.py --output-dir runs/hf --resume --steps 24  # continue from its last checkpoint
    torchrun --nproc_per_node 2 examples/hf_trainer.py          # data parallel

``--resume`` continues the run in ``--output-dir`` (the same ``--model``); without one, or with no checkpoint
there, it says so in one line (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import torch
from transformers import TrainingArguments

from dynabatch.data.batching import LengthLimits
from dynabatch.data.mixture import MixtureSpec
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.builtin import default_mixture_path
from dynabatch.data.tokenize import load_tokenizer
from dynabatch.integrations.dataloader import DynaBatchDataLoader
from dynabatch.integrations.trainer import DynaBatchTrainer
from dynabatch.models.presets import build_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="t5-tiny", choices=["t5-tiny", "t5-mini", "gpt2-tiny", "gpt2-mini"])
    p.add_argument("--output-dir", default=None, help="checkpoints (default: a temporary folder)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--token-budget", type=int, default=4096, help="real tokens per global batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (tiny models are dispatch-bound: 1 is fastest)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    args = p.parse_args()
    if args.resume:
        check_resumable(args.output_dir)
    return args


def check_resumable(output_dir: str | None) -> None:
    """``--resume`` needs the ``--output-dir`` of an earlier run holding a checkpoint: else one line and exit 2
    (the Trainer would raise a traceback, and without ``--output-dir`` each run writes to a new temporary folder)."""
    from transformers.trainer_utils import get_last_checkpoint

    if output_dir is None:
        problem = "--resume continues a run in its --output-dir; pass the --output-dir DIR the run to continue used"
    elif not os.path.isdir(output_dir) or get_last_checkpoint(output_dir) is None:
        problem = (f"--resume: --output-dir {output_dir!r} holds no checkpoint-N folder; run without --resume first "
                   "(with the same --output-dir)")
    else:
        return
    print(f"hf_trainer.py: error: {problem}", file=sys.stderr)
    sys.exit(2)


def held_out(spec: MixtureSpec, num_examples: int = 20) -> MixtureSpec:
    """The built-in tasks generated with other seeds: new examples of the same tasks."""
    sources = tuple(dataclasses.replace(s, seed=s.seed + 1000, num_examples=num_examples) for s in spec.sources)
    return dataclasses.replace(spec, sources=sources, name=f"{spec.name}-eval")


def main() -> None:
    cli = parse_args()
    torch.set_num_threads(cli.threads)
    args = TrainingArguments(
        output_dir=cli.output_dir or tempfile.mkdtemp(prefix="dynabatch-hf-"),
        max_steps=cli.steps,
        learning_rate=cli.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=max(cli.steps // 2, 1),
        save_steps=max(cli.steps // 2, 1),
        ignore_data_skip=True,  # resuming restores the loader's position from the checkpoint
        report_to=[],
        disable_tqdm=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),  # also makes torchrun on CPU data-parallel (gloo)
    )
    family = "t5" if cli.model.startswith("t5") else "gpt2"
    tokenizer = load_tokenizer("builtin")
    spec = MixtureSpec.from_file(default_mixture_path())
    train_data = MixtureData.load(spec, tokenizer, family)
    eval_data = MixtureData.load(held_out(spec), tokenizer, family)
    model = build_model(cli.model, seed=args.seed)
    limits = LengthLimits(family, max_input_len=256, max_target_len=64, max_seq_len=320)
    # Every process plans the whole global batch and keeps the micro-batches of its replica.
    shared = dict(
        token_budget=cli.token_budget,
        model_config=model.config,
        num_replicas=args.world_size,
        replica_index=args.process_index,
    )
    train_loader = DynaBatchDataLoader(train_data, limits, **shared)
    # Evaluation: every held-out row exactly once per evaluation, in global batches of the same token budget.
    eval_loader = DynaBatchDataLoader(eval_data, limits, each_row_once=True, **shared)
    trainer = DynaBatchTrainer(model=model, args=args, train_loader=train_loader, eval_loader=eval_loader)
    result = trainer.train(resume_from_checkpoint=True if cli.resume else None)
    if args.process_index == 0:
        print(f"train_loss {result.training_loss:.4f}; checkpoints in {args.output_dir}")
    end_distributed()


def end_distributed() -> None:
    """Under torchrun: wait for every rank, tear the process group down, and leave without the interpreter's
    finalization. At exit, gloo's worker threads can outlive the group and abort a rank ("terminate called
    without an active exception", exit -6, about 1 run in 5 on loaded cores), and after an explicit
    ``destroy_process_group`` a rank could still hang in finalization; everything this script writes is on
    disk by now."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
