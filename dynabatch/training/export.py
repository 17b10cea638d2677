"""Export a training checkpoint to a plain Hugging Face ``save_pretrained`` directory (``dynabatch export``,
:mod:`dynabatch.commands.export`).

A checkpoint holds every weight once under its global (HF) name, whatever the stage count
(:mod:`dynabatch.training.reshard`). The export rebuilds the model from the run's config (stored in the
manifest), reads the weights (safetensors, through ``torch.distributed.checkpoint``), checks that every
model parameter is covered and finite, copies them in (a tied head takes its embedding's) and calls
``save_pretrained``. The result loads with
``T5ForConditionalGeneration.from_pretrained(out)`` / ``GPT2LMHeadModel.from_pretrained(out)``. The tokenizer
is saved so that ``AutoTokenizer.from_pretrained(out)(text)`` gives the ids training fed the model
(:func:`~dynabatch.data.tokenize.inference_tokenizer`: an encoder-decoder's inputs end with EOS, a decoder-only
prompt has no special token); :data:`EXPORT_MARKER` records how to encode (docs/inference.md).

Weights with a NaN or inf are refused (nothing is written), and so is an output folder that is not
empty unless it holds an earlier export (its :data:`EXPORT_MARKER`) or ``--force`` is given.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from dynabatch.training.config import TrainConfig
from dynabatch.data.tokenize import inference_tokenizer
from dynabatch.engine.checkpoint import CheckpointError, first_non_finite, resolve_checkpoint
from dynabatch.core.sequence import is_seq2seq
from dynabatch.data.tokenize import encodes_like_training, load_tokenizer, tokenizer_info
from dynabatch.models.families import check_model
from dynabatch.models.presets import build_run_model
from dynabatch.training.reshard import model_weights

logger = logging.getLogger(__name__)

EXPORT_MARKER = "dynabatch_export.json"
"""Written into every export folder: which checkpoint it came from (and that a re-export may overwrite it)."""


def check_out_dir(out_dir: str, force: bool = False) -> None:
    """``ValueError`` if ``out_dir`` is a file, or a non-empty folder that holds no earlier export
    (unless ``force``)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"output folder {out_dir!r} is a file, not a folder; pass a folder path")
    if force or not os.path.isdir(out_dir) or os.path.exists(os.path.join(out_dir, EXPORT_MARKER)):
        return
    found = sorted(os.listdir(out_dir))
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise ValueError(f"output folder {out_dir!r} is not empty and holds no earlier export (it holds "
                         f"{shown}); pass a new or empty folder, or --force to write into it")


def export_checkpoint(checkpoint: str, out_dir: str, force: bool = False) -> str:
    """Write the HF model of ``checkpoint`` (a ``step-N`` folder, or a run's ``checkpoints`` folder for
    the newest complete one) to ``out_dir``; returns ``out_dir``. ``CheckpointError`` (nothing written)
    if a weight is not finite; ``ValueError`` for an output folder :func:`check_out_dir` refuses."""
    check_out_dir(out_dir, force)
    info = resolve_checkpoint(checkpoint)
    cfg = TrainConfig.of(**info.manifest["config"])
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.model)
    family = check_model(cfg.model, None).sequence_kind
    model = build_run_model(cfg.model, cfg.tokenizer, tokenizer_info(tokenizer), family, dropout=cfg.dropout,
                            seed=cfg.seed)
    params = dict(model.named_parameters())
    weights = model_weights(info.path)
    missing = sorted(set(params) - set(weights))
    if missing:
        raise CheckpointError(f"checkpoint {info.path} does not cover parameters {missing[:5]}")
    bad = first_non_finite({name: weights[name] for name in params})
    if bad is not None:
        raise CheckpointError(f"checkpoint {info.path} holds non-finite weights (NaN or inf), first in parameter "
                              f"{bad!r}; nothing was exported: export an earlier step-NNNNNN folder")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    inference_tokenizer(tokenizer, family).save_pretrained(out_dir)
    encoding = _check_encoding(out_dir, family)
    with open(os.path.join(out_dir, EXPORT_MARKER), "w", encoding="utf-8") as f:
        json.dump({"checkpoint": os.path.abspath(info.path), "step": info.step, "run_id": info.run_id,
                   "sequence_kind": family, "encoding": encoding}, f, indent=1)
    return out_dir


def _check_encoding(out_dir: str, family: str) -> str:
    """How to encode a model input with the exported tokenizer as training did: reloads it the way a user
    does (``AutoTokenizer.from_pretrained``) and compares with training's encoding; a warning says what to do
    where the two differ (a slow tokenizer, whose special tokens cannot be set in its files)."""
    from transformers import AutoTokenizer


    saved = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)  # ByT5 saves no vocabulary file
    if encodes_like_training(saved, family):
        return "tokenizer(text)" + (" (EOS appended, as in training)" if is_seq2seq(family) else "")
    eos = tokenizer_info(saved).eos_id
    how = (f"tokenizer(text, add_special_tokens=False).input_ids + [{eos}]" if is_seq2seq(family)
           else "tokenizer(text, add_special_tokens=False).input_ids")
    logger.warning(f"{out_dir}: tokenizer(text) of this tokenizer differs from how training encoded inputs; "
                   f"encode them as {how}")
    return how
