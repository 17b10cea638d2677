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

``--resume`` continues the run in ``--output-dir`` (the same ``--model``); without one, with no checkpoint
there, or with another ``--model`` than the checkpoint's, it says so in one line (exit 2), as it does for a
``--steps`` or ``--token-budget`` it cannot run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import torch
from transformers import TrainingArguments

from dynabatch.data.mixture import MixtureSpec
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.builtin import default_mixture_path
from dynabatch.data.tokenize import load_tokenizer
from dynabatch.integrations.dataloader import DynaBatchDataLoader
from dynabatch.integrations.example_args import (EXAMPLE_MODELS, check_token_budget, length_limits,
                                                   positive, positive_float)
from dynabatch.integrations.trainer import DynaBatchTrainer
from dynabatch.model_presets import sequence_kind
from dynabatch.models.presets import build_config, build_model


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="t5-tiny", choices=EXAMPLE_MODELS,
                   help="model preset, built from its config (with --resume: the one the run trained)")
    p.add_argument("--output-dir", default=None, help="checkpoints (default: a temporary folder)")
    p.add_argument("--steps", type=positive, default=12,
                   help="optimizer steps of the run (with --resume: the total, counting the steps already trained)")
    p.add_argument("--token-budget", type=positive, default=4096, help="real tokens per global batch")
    p.add_argument("--lr", type=positive_float, default=3e-3, help="learning rate (constant after 2 warm-up steps)")
    p.add_argument("--threads", type=positive, default=1,
                   help="CPU threads (tiny models are dispatch-bound: 1 is fastest)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    args = p.parse_args()
    check_token_budget(p, args.token_budget, args.model)
    if args.resume:
        check_resumable(args.output_dir, args.model)
    return args


def check_resumable(output_dir: str | None, model: str) -> None:
    """``--resume`` needs the ``--output-dir`` of an earlier run holding a checkpoint of the same ``--model``: else
    one line and exit 2 (the Trainer would raise a traceback, without ``--output-dir`` each run writes to a new
    temporary folder, and another model fails to load the checkpoint's weights or data position)."""
    from transformers.trainer_utils import get_last_checkpoint

    checkpoint = get_last_checkpoint(output_dir) if output_dir is not None and os.path.isdir(output_dir) else None
    if output_dir is None:
        problem = "--resume continues a run in its --output-dir; pass the --output-dir DIR the run to continue used"
    elif checkpoint is None:
        problem = (f"--resume: --output-dir {output_dir!r} holds no checkpoint-N folder; run without --resume first "
                   "(with the same --output-dir)")
    elif (differ := config_differences(checkpoint, model)):
        problem = (f"--resume: {checkpoint} holds another model than --model {model} ({'; '.join(differ)}); pass the "
                   "--model the run trained, or another --output-dir")
    else:
        return
    print(f"hf_trainer.py: error: {problem}", file=sys.stderr)
    sys.exit(2)


def config_differences(checkpoint: str, model: str) -> list[str]:
    """The fields of the checkpoint's ``config.json`` that the ``model`` preset's config sets otherwise."""
    try:
        with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return [f"no readable config.json in {checkpoint}"]
    wanted = build_config(model).to_dict()
    if saved.get("model_type") != wanted["model_type"]:
        return [f"a {saved.get('model_type')} model there, {wanted['model_type']} for {model}"]
    keys = ("d_model", "n_embd", "num_layers", "n_layer", "num_heads", "n_head", "d_ff", "n_inner")
    return [f"{k} {saved.get(k)} there, {wanted[k]} for {model}" for k in keys
            if k in wanted and saved.get(k) != wanted[k]]


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
        report_to=[],
        disable_tqdm=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),  # also makes torchrun on CPU data-parallel (gloo)
    )
    family = sequence_kind(cli.model)
    tokenizer = load_tokenizer("builtin")
    spec = MixtureSpec.from_file(default_mixture_path())
    train_data = MixtureData.load(spec, tokenizer, family)
    eval_data = MixtureData.load(held_out(spec), tokenizer, family)
    model = build_model(cli.model, seed=args.seed)
    limits = length_limits(family)
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
