"""What a training run settles before it trains: its configuration resolved with what this machine finds
(:func:`resolve_run`), the same on every rank (:func:`check_same_settings`), recorded in ``OUTPUT/config.yaml``
(:func:`record_resolved`), and what it reads: which tokenizer (:func:`log_tokenizer`) and, for a model folder, the
dropout it trains with (:func:`log_dropout`)."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

from dynabatch.core.allocator import host_memory_gib
from dynabatch.cost.model_states import describe_zero
from dynabatch.cost.tables import CostTables
from dynabatch.data.tokenize import describe_tokenizer, load_tokenizer, tokenizer_info
from dynabatch.engine.checkpoint import CheckpointInfo
from dynabatch.engine.dist import DistContext
from dynabatch.model_presets import describe_dropout, describe_unset_pad, sequence_kind
from dynabatch.models.families import check_model
from dynabatch.training.config import Found, Resolved, TrainConfig, resolve
from dynabatch.training.config.flags import CONFIG_FILE, load_config_file, write_config_file
from dynabatch.training.config.paths import run_paths
from dynabatch.training.cost_model import check_profile_covers
from dynabatch.training.resume import resume_settings_line

logger = logging.getLogger(__name__)


def resolve_run(cfg: TrainConfig) -> Resolved:
    """``cfg`` resolved for this machine and model (:func:`dynabatch.training.config.resolve.resolve`): whether CUDA is
    available, the model's sequence kind (checked before anything loads), the world size and the host's memory. The tokenizer is
    resolved before a resume compares it with a checkpoint's; the checkpoints, ``summary.json`` and an export
    name it. Local paths become absolute first (:func:`~dynabatch.training.config.paths.run_paths`), so
    ``config.yaml`` and the checkpoints record files that a run from any folder finds. A ``--cost-profile`` whose
    grid stops below the length limits is refused here, before anything loads (:func:`check_profile_covers`)."""
    if cfg.cost_profile:
        check_profile_covers(CostTables.load(cfg.cost_profile), cfg)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in run_paths(cfg.to_dict()).items() if v != getattr(cfg, k)})
    kind = check_model(cfg.model, cfg.max_input_len, cfg.slice_long).sequence_kind
    return resolve(cfg, Found(cuda_available=torch.cuda.is_available(), sequence_kind=kind,
                              world_size=cfg.world_size, host_memory_gib=host_memory_gib()))


def record_resolved(resolved: Resolved, resumed: CheckpointInfo | None) -> None:
    """Rank 0: log the resolved choices once as a short table and write ``OUTPUT/config.yaml`` (every field,
    resolved: ``dynabatch train --config`` it to run the same again). A resume from checkpoint ``resumed`` first
    logs one line about the settings that differ from the checkpoint's and from the earlier run's file
    (:func:`~dynabatch.training.resume.resume_settings_line`)."""
    cfg = resolved.config
    path = os.path.join(cfg.output_dir, CONFIG_FILE)
    if resolved.reasons:
        logger.info("resolved configuration (option, value, why):\n" + resolved.table())
    if resumed is not None:
        line = resume_settings_line(resumed, cfg, load_config_file(path) if os.path.exists(path) else None)
        if line is not None:
            logger.info(line)
    write_config_file(path, cfg)


def check_same_settings(ctx: DistContext, given: TrainConfig) -> None:
    """Collective: every rank was started with the same settings (on several nodes, each node's command is its
    own, and a flag typed differently on one would train its stages otherwise, or hang at the first step that
    counts differently). A ``ValueError`` naming the first setting that differs, the same on every rank. The device
    may differ (``train(cfg)`` from Python may give each rank its own ``cuda:N``)."""
    if ctx.world_size == 1:
        return
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, {k: v for k, v in given.to_dict().items() if k != "device"},
                           group=ctx.delivery_group)
    first = gathered[0]
    for rank, theirs in enumerate(gathered):
        k = next((k for k in first if theirs.get(k) != first[k]), None)
        if k is not None:
            raise ValueError(f"rank {rank} was started with other settings than rank 0 ({k}: {first[k]!r} on "
                             f"rank 0, {theirs.get(k)!r} on rank {rank}); start every rank (every node) with the "
                             "same command")


def log_tokenizer(cfg: TrainConfig, ctx: DistContext) -> None:
    """Rank 0 logs which tokenizer the run uses and why (``cfg``: the configuration as given)."""
    if ctx.is_planner:
        info = tokenizer_info(load_tokenizer(cfg.tokenizer, cfg.model))
        logger.info(describe_tokenizer(cfg.tokenizer, cfg.model, info, family=sequence_kind(cfg.model)))


def log_unset_pad(cfg: TrainConfig, ctx: DistContext) -> None:
    """Rank 0 logs when the model folder's config has no ``pad_token_id`` and the run sets the tokenizer's
    (:func:`~dynabatch.model_presets.describe_unset_pad`)."""
    if ctx.is_planner and os.path.isdir(cfg.model):
        pad = tokenizer_info(load_tokenizer(cfg.tokenizer, cfg.model)).pad_id
        if (line := describe_unset_pad(cfg.model, pad)) is not None:
            logger.info(line)


def log_dropout(cfg: TrainConfig, ctx: DistContext) -> None:
    """Rank 0 logs when ``--dropout`` replaces another rate that the model folder's config gives
    (:func:`~dynabatch.model_presets.describe_dropout`)."""
    if ctx.is_planner and (line := describe_dropout(cfg.model, cfg.dropout)) is not None:
        logger.info(line)


def describe_target_len(cfg: TrainConfig) -> str | None:
    """The line a decoder-only run logs when ``--max-target-len`` is not its default: the limit is T5's decoder
    limit, and a decoder-only sample, inputs and targets together, is limited by ``--max-input-len`` alone; ``None``
    otherwise (an encoder-decoder, the default, or a model whose kind the file system does not tell)."""
    default = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == "max_target_len")
    if cfg.max_target_len == default or sequence_kind(cfg.model) != "causal":
        return None
    return (f"--max-target-len {cfg.max_target_len} has no effect on the decoder-only model {cfg.model}: its samples, "
            f"inputs and targets together, are cut at --max-input-len {cfg.max_input_len}")


def log_target_len(cfg: TrainConfig, ctx: DistContext) -> None:
    """Rank 0 warns when ``--max-target-len`` is set for a decoder-only model (:func:`describe_target_len`)."""
    if ctx.is_planner and (line := describe_target_len(cfg)) is not None:
        logger.warning(line)


def log_zero(cfg: TrainConfig, ctx: DistContext) -> None:
    """Rank 0 warns when ``--zero`` is set with one replica (:func:`describe_zero`)."""
    if ctx.is_planner and (line := describe_zero(cfg.zero, cfg.replicas)) is not None:
        logger.warning(line)
