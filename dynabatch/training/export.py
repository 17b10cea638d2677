"""Export a training checkpoint to a plain Hugging Face ``save_pretrained`` directory (``dynabatch export``,
:mod:`dynabatch.commands.export`).

A checkpoint holds every weight once under its global (HF) name, whatever the stage count
(:mod:`dynabatch.training.reshard`), and its run's model config and tokenizer (``model/``,
:mod:`dynabatch.training.model_files`), so the ``--model`` folder may have moved since. The export first checks
that it can create and write the output folder, then rebuilds the model from that config (a checkpoint written
before checkpoints kept it: from the ``--model`` and ``--tokenizer`` its manifest records, which must still
exist), reads the weights (safetensors, through ``torch.distributed.checkpoint``), checks that every
model parameter is covered and finite, copies them in (a tied head takes its embedding's) and calls
``save_pretrained``. The result loads with
``T5ForConditionalGeneration.from_pretrained(out)`` / ``GPT2LMHeadModel.from_pretrained(out)``. The tokenizer
is saved so that ``AutoTokenizer.from_pretrained(out)(text)`` gives the ids training fed the model
(:func:`~dynabatch.data.tokenize.inference_tokenizer`: an encoder-decoder's inputs end with EOS, a decoder-only
prompt has no special token but the BOS the tokenizer's own call puts first, if any); :data:`EXPORT_MARKER`
records how to encode (docs/inference.md).

Weights with a NaN or inf are refused (nothing is written), and so is an output folder that is not
empty unless it holds an earlier export (its :data:`EXPORT_MARKER`) or ``--force`` is given, that cannot be
created or written, or that lies inside the checkpoints being exported, ``--force`` or not (said before anything
is loaded).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from dynabatch.training.config import TrainConfig
from dynabatch.data.tokenize import inference_tokenizer
from dynabatch.engine.checkpoint import (MANIFEST, CheckpointError, CheckpointInfo, first_non_finite,
                                        resolve_checkpoint)
from dynabatch.engine.outputs import listed, make_writable_dir
from dynabatch.core.sequence import is_seq2seq
from dynabatch.data.tokenize import PROBE_TEXT, encodes_like_training, input_start, load_tokenizer, tokenizer_info
from dynabatch.model_presets import model_class
from dynabatch.models.families import check_model, family_for_config
from dynabatch.models.presets import build_run_model
from dynabatch.training.model_files import read_model_files
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
        raise ValueError(f"output folder {out_dir!r} is not empty and holds no earlier export (it holds "
                         f"{listed(found)}); pass a new or empty folder, or --force to write into it")


def check_not_in_checkpoints(checkpoint: str, out_dir: str) -> None:
    """``ValueError`` if ``out_dir`` is the checkpoints being exported or lies inside them (a ``step-N`` folder, or
    the ``checkpoints/`` folder that holds it): the files an export writes there are files no manifest lists, and
    such a checkpoint is refused from then on, by ``--resume-from-checkpoint`` and by ``export`` alike. ``--force``
    does not lift it."""
    checkpoint = os.path.realpath(checkpoint)
    root = os.path.dirname(checkpoint) if os.path.isfile(os.path.join(checkpoint, MANIFEST)) else checkpoint
    relative = os.path.relpath(os.path.realpath(out_dir), root)
    if relative == os.curdir or not relative.startswith(os.pardir):
        raise ValueError(f"output folder {out_dir!r} is inside the checkpoints being exported ({root}); files "
                         "written there would make those checkpoints unreadable: pass a folder outside it")


def make_out_dir(out_dir: str) -> list[str]:
    """Create ``out_dir`` (with its missing parents) and check that a file can be written there, before anything is
    loaded; returns the folders this created, deepest first. ``ValueError`` (one line: which folder, why, what to
    do) when it cannot be created or written, with whatever it created removed again."""
    created = _missing_folders(out_dir)
    try:
        make_writable_dir(out_dir)
    except OSError as e:
        remove_empty(created)
        raise ValueError(f"output folder {out_dir!r} cannot be {'created' if created else 'written to'} "
                         f"({e.strerror or e}); pass a folder you can write to") from None
    return created


def _missing_folders(path: str) -> list[str]:
    """``path`` and its parents that do not exist yet, deepest first."""
    missing, path = [], os.path.abspath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_empty(folders: list[str]) -> None:
    """Remove ``folders`` (deepest first) that are still empty: an export that failed leaves no folder it created."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:  # not empty (something else wrote there), or already gone: leave it
            return


def export_checkpoint(checkpoint: str, out_dir: str, force: bool = False) -> str:
    """Write the HF model of ``checkpoint`` (a ``step-N`` folder, or a run's ``checkpoints`` folder for
    the newest complete one) to ``out_dir``; returns ``out_dir``. ``out_dir`` is checked first
    (:func:`check_not_in_checkpoints`, :func:`check_out_dir`, :func:`make_out_dir`: one ``ValueError`` line before
    anything is loaded). ``CheckpointError`` (nothing written) if a weight is not finite; a folder the export created
    is removed again when it fails."""
    check_not_in_checkpoints(checkpoint, out_dir)
    check_out_dir(out_dir, force)
    created = make_out_dir(out_dir)
    before = _stamps(out_dir)
    try:
        info = resolve_checkpoint(checkpoint)
        model, tokenizer, family = _model_and_tokenizer(info)
        _load_weights(model, info.path)
        marker = os.path.join(out_dir, EXPORT_MARKER)
        if os.path.exists(marker):  # from here the folder no longer holds that export: never leave its record behind
            os.remove(marker)
        model.save_pretrained(out_dir)
        inference_tokenizer(tokenizer, family).save_pretrained(out_dir)
        start = input_start(tokenizer, family)
    except BaseException:
        remove_empty(created)
        raise
    try:
        encoding = _check_encoding(out_dir, family, start, tokenizer)
    except Exception as e:  # files this export did not write (an earlier export's, or yours) can break the load
        after = _stamps(out_dir)
        left = sorted(n for n, stamp in before.items() if after.get(n) == stamp and n != EXPORT_MARKER)
        beside = f"; {out_dir} also holds files this export did not write ({listed(left)})" if left else ""
        raise ValueError(f"the tokenizer written to {out_dir!r} does not load with AutoTokenizer.from_pretrained "
                         f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]}){beside}: export into a new or empty folder") from e
    with open(os.path.join(out_dir, EXPORT_MARKER), "w", encoding="utf-8") as f:
        json.dump({"checkpoint": os.path.abspath(info.path), "step": info.step, "run_id": info.run_id,
                   "sequence_kind": family, "encoding": encoding}, f, indent=1)
    return out_dir


def _stamps(folder: str) -> dict[str, tuple[int, int]]:
    """``{name: (size, mtime_ns)}`` of the plain files in ``folder``: which of them a write left as they were."""
    stamps = {}
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            stamps[entry.name] = (st.st_size, st.st_mtime_ns)
    return stamps


def _model_and_tokenizer(info: CheckpointInfo):
    """``(model, tokenizer, sequence kind)`` of checkpoint ``info``, the model with fresh weights: from the model
    config and tokenizer the checkpoint keeps (:mod:`dynabatch.training.model_files`), else (a checkpoint written
    before checkpoints kept them) from the ``--model`` / ``--tokenizer`` its manifest records."""
    files = read_model_files(info.path)
    if files is not None:
        model = model_class(files.config).from_config(files.config)
        if files.generation_config is not None:
            model.generation_config = files.generation_config
        return model, files.tokenizer, family_for_config(files.config).sequence_kind
    cfg = TrainConfig.of(**info.manifest["config"])
    _check_recorded_paths(info.path, cfg)
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.model)
    family = check_model(cfg.model, None).sequence_kind
    model = build_run_model(cfg.model, cfg.tokenizer, tokenizer_info(tokenizer), family, dropout=cfg.dropout,
                            seed=cfg.seed)
    return model, tokenizer, family


def _check_recorded_paths(checkpoint: str, cfg: TrainConfig) -> None:
    """A checkpoint without ``model/``: one ``ValueError`` line when the ``--model`` or ``--tokenizer`` folder its run
    read is gone (moved or deleted since), naming it and what to do."""
    for flag, name in (("--model", cfg.model), ("--tokenizer", cfg.tokenizer)):
        if (os.sep in name or name.startswith((".", "~"))) and not os.path.isdir(name):
            raise ValueError(f"checkpoint {checkpoint} keeps no model config and tokenizer (an older dynabatch wrote "
                             f"it), and the {flag} folder its run read, {name!r}, is gone; put that folder (or a copy "
                             "of it) back at that path and export again")


def _load_weights(model, checkpoint: str) -> None:
    """Copy checkpoint ``checkpoint``'s weights into ``model`` (a tied head takes its embedding's);
    ``CheckpointError`` if one is missing or not finite, before any is copied."""
    params = dict(model.named_parameters())
    weights = model_weights(checkpoint)
    missing = sorted(set(params) - set(weights))
    if missing:
        raise CheckpointError(f"checkpoint {checkpoint} does not cover parameters {missing[:5]}")
    bad = first_non_finite({name: weights[name] for name in params})
    if bad is not None:
        raise CheckpointError(f"checkpoint {checkpoint} holds non-finite weights (NaN or inf), first in parameter "
                              f"{bad!r}; nothing was exported: export an earlier step-NNNNNN folder")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])


def _check_encoding(out_dir: str, family: str, start: list[int], trained) -> str:
    """How to encode a model input with the exported tokenizer as training did (``start``: the ids training put
    before the text, :func:`~dynabatch.data.tokenize.input_start`; ``trained``: the tokenizer training encoded
    with): reloads it the way a user does (``AutoTokenizer.from_pretrained``) and compares with training's encoding;
    a warning says what to do where the two differ: a slow tokenizer, whose special tokens cannot be set in its
    files, or ``AutoTokenizer`` loading another class than training's (a Qwen2 folder's config makes it load an empty
    ``Qwen2Tokenizer`` beside a saved ``ByT5Tokenizer``), which encodes the text itself differently."""
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)  # ByT5 saves no vocabulary file
    load = ""
    if _plain_ids(saved) != _plain_ids(trained):
        cls = type(trained).__name__
        logger.warning(f"{out_dir}: AutoTokenizer.from_pretrained loads a {type(saved).__name__} that encodes text "
                       f"unlike the {cls} training used; load the tokenizer with {cls}.from_pretrained")
        saved, load = type(trained).from_pretrained(out_dir, local_files_only=True), f"{cls}.from_pretrained, then "
    if encodes_like_training(saved, family, start):
        return load + "tokenizer(text)" + (" (EOS appended, as in training)" if is_seq2seq(family) else "")
    eos = tokenizer_info(saved).eos_id
    before = f"{start} + " if start else ""
    how = (f"tokenizer(text, add_special_tokens=False).input_ids + [{eos}]" if is_seq2seq(family)
           else f"{before}tokenizer(text, add_special_tokens=False).input_ids")
    logger.warning(f"{out_dir}: tokenizer(text) of this tokenizer differs from how training encoded inputs; "
                   f"encode them as {how}")
    return load + how


def _plain_ids(tokenizer) -> list[int]:
    """The ids ``tokenizer`` gives :data:`~dynabatch.data.tokenize.PROBE_TEXT` without special tokens."""
    return tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
