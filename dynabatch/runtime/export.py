"""Export a training checkpoint to a plain Hugging Face ``save_pretrained`` directory.

A checkpoint holds one shard per rank with stage-local parameter names. The export rebuilds the
model from the run's config (stored in the manifest), builds each stage of replica 0 the same way
the trainer did to learn its ``parameter_map`` (stage name -> HF name), copies every shard's weights
into the model under their HF names (tied copies are identical, so any holder serves), checks that
every model parameter was covered, and calls ``save_pretrained``. The result loads with
``T5ForConditionalGeneration.from_pretrained(out)`` / ``GPT2LMHeadModel.from_pretrained(out)``.
"""

from __future__ import annotations

import argparse
import os

import torch

from dynabatch.config import TrainConfig
from dynabatch.runtime.checkpoint import CheckpointError, latest_checkpoint, load_shard, verify


def export_checkpoint(checkpoint: str, out_dir: str) -> str:
    """Write the HF model of ``checkpoint`` (a ``step-N`` folder, or a run's ``checkpoints`` folder for
    the newest complete one) to ``out_dir``; returns ``out_dir``."""
    from dynabatch.data.tokenize import load_tokenizer, tokenizer_info
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import build_stage, layout_for

    info = latest_checkpoint(checkpoint) if not os.path.exists(os.path.join(checkpoint, "manifest.json")) else verify(checkpoint)
    if info is None:
        raise CheckpointError(f"no complete checkpoint in {checkpoint}")
    cfg = TrainConfig(**info.manifest["config"])
    vocab = tokenizer_info(load_tokenizer(cfg.tokenizer)).vocab_size
    model = build_model(cfg.model, vocab_size=vocab, dropout=cfg.dropout, seed=cfg.seed)
    layout = layout_for(model, cfg.stages)
    params = dict(model.named_parameters())
    covered: set[str] = set()
    with torch.no_grad():
        for stage_index in range(cfg.stages):  # replica 0 holds ranks 0..S-1
            stage = build_stage(model, layout, stage_index)
            weights = load_shard(info, stage_index)["stage"]
            for local, hf_name in stage.parameter_map.items():
                params[hf_name].copy_(weights[local])
                covered.add(hf_name)
    missing = sorted(set(params) - covered)
    if missing:
        raise CheckpointError(f"checkpoint {info.path} does not cover parameters {missing[:5]}")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    load_tokenizer(cfg.tokenizer).save_pretrained(out_dir)
    return out_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint folder (step-NNNNNN) or a run's checkpoints/ folder (newest)")
    p.add_argument("out", help="output directory for save_pretrained")


def run(args: argparse.Namespace) -> int:
    out = export_checkpoint(args.checkpoint, args.out)
    print(f"wrote Hugging Face model and tokenizer to {out}")
    return 0
