"""``--resume-from-checkpoint``: save, find and load the checkpoint a run continues from, and what may change.

:func:`save_checkpoint` writes a reshardable checkpoint (:mod:`dynabatch.training.reshard` keys every
rank's tensors by the global model's names; :func:`~dynabatch.engine.checkpoint.save_collective` is
the atomic, checksummed, finite-only protocol), with the run's model config and tokenizer in its ``model/``
folder (:mod:`dynabatch.training.model_files`: an export needs no other folder). :func:`find_resume_checkpoint` resolves the flag
(``latest``: the newest complete checkpoint in ``OUTPUT/checkpoints``; else a step-NNNNNN folder or a
checkpoints/ folder) and :func:`resume` loads it into a run of any stage and replica count: each rank
reads the weights and AdamW states of the parameters its stage holds, rank 0 the data position (the
next samples are the interrupted run's), the LR scheduler state and the calibration fit. The fit is
kept only when its calibration key (device, threads, model, layout, cost profile, attention) is this
run's; with another layout it starts afresh (warm from ``--calibration-file`` when given), since its
coefficients are per stage. RNG states are restored only when the world shape is unchanged (training
draws none from them: see :mod:`dynabatch.training.reshard`).

:func:`compare_configs` checks the new :class:`~dynabatch.training.config.TrainConfig` against the one stored
in the checkpoint's manifest. Fields in :data:`~dynabatch.training.config.FIXED_ON_RESUME` decide the model or
the data stream; changing one is a ``ValueError`` that names every such field with its old and new
value. Every other change (``stages`` and ``replicas`` included) is allowed and returned as a note for
the log. After the optimizer and scheduler states are restored, :func:`apply_hyperparameters` makes the
new ``learning_rate`` and ``weight_decay`` take effect (a restored optimizer state would otherwise
silently keep the old ones) and recomputes the current learning rate under the new schedule
(``max_steps``, ``warmup_steps``, ``lr_scheduler_type``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from dynabatch.training.config import FIXED_ON_RESUME, TrainConfig, canonical
from dynabatch.training.config.flags import CONFIG_FILE, NOT_RUN_SETTINGS
from dynabatch.training.config.paths import run_paths
from dynabatch.cost.online import OnlineFit
from dynabatch.engine.checkpoint import (MANIFEST, CheckpointInfo, latest_checkpoint, list_checkpoints, new_run_id,
                                          resolve_checkpoint, save_collective)
from dynabatch.model_presets import sequence_kind
from dynabatch.training.model_files import ModelFiles
from dynabatch.training.reshard import dcp_writer, load_stage_state, stage_state

logger = logging.getLogger(__name__)

_NOT_COMPARED = NOT_RUN_SETTINGS


def setting_changes(old: dict[str, Any], new: TrainConfig) -> list[tuple[str, str]]:
    """``(name, "name: old -> new")`` for every run setting whose value in ``old`` is not ``new``'s. ``old`` is the
    fields a checkpoint's manifest or an earlier run's ``config.yaml`` holds: a checkpoint of an older version
    stores older names (``lr``, ``steps``) and paths as typed (relative ones are taken from this folder); the same
    files and columns spelled otherwise are the same setting."""
    current = run_paths(new.to_dict())
    old = run_paths(canonical(old))
    return [(name, f"{name}: {old[name]!r} -> {value!r}") for name, value in current.items()
            if name not in _NOT_COMPARED and name in old and old[name] != value]


def fixed_on_resume(model: str) -> tuple[str, ...]:
    """The settings a resume of a ``model`` run may not change: :data:`FIXED_ON_RESUME`, less ``max_target_len``
    for a decoder-only model, whose samples ``max_input_len`` limits alone (the target limit is T5's)."""
    if sequence_kind(model) == "causal":
        return tuple(name for name in FIXED_ON_RESUME if name != "max_target_len")
    return FIXED_ON_RESUME


def compare_configs(old: dict[str, Any], new: TrainConfig, where: str) -> list[str]:
    """Raise ``ValueError`` if a fixed field (:func:`fixed_on_resume`) differs; return ``"name: old -> new"`` for the
    others."""
    changes = setting_changes(old, new)
    fixed_names = fixed_on_resume(new.model)
    fixed = [change for name, change in changes if name in fixed_names]
    if fixed:
        raise ValueError(
            f"--resume-from-checkpoint: checkpoint {where} was written with other settings that cannot change ({'; '.join(fixed)}); "
            "use the checkpoint's values, or start a new run in another --output-dir"
        )
    return [change for name, change in changes if name not in fixed_names]


def resume_settings_line(info: CheckpointInfo, cfg: TrainConfig, earlier: dict[str, Any] | None) -> str | None:
    """The one line a resume from ``info`` logs about its settings (``None``: nothing to say): those that differ
    from the checkpoint's, which apply from its step. ``earlier`` is the fields of the ``config.yaml`` an earlier
    start wrote into the output folder (``None``: there is none, e.g. a checkpoint of another folder); the line adds
    what that file differs in: "the same" as the checkpoint, or its own list when a start after the checkpoint's
    wrote it with other settings."""
    notes = compare_configs(info.manifest.get("config", {}), cfg, info.path)
    said = (f"changed settings apply from step {info.step}: {'; '.join(notes)}" if notes
            else "no setting differs from the checkpoint's")
    if earlier is None:
        return f"--resume-from-checkpoint {info.path}: {said}" if notes else None
    written = [change for _, change in setting_changes(earlier, cfg)]
    if written == notes and not notes:
        tail = f"nor from {CONFIG_FILE} of the earlier run"
    elif written == notes:
        tail = f"{CONFIG_FILE} of the earlier run differs in the same"
    else:
        tail = f"{CONFIG_FILE} of the earlier run differs in " + ("; ".join(written) or "nothing")
    return f"--resume-from-checkpoint {info.path}: {said} ({tail})"


def apply_hyperparameters(optimizer, scheduler, cfg: TrainConfig, lr_lambda: Callable[[int], float]) -> None:
    """Make ``cfg.learning_rate`` / ``cfg.weight_decay`` and the LR schedule of ``cfg`` current after a restore."""
    scheduler.base_lrs = [cfg.learning_rate for _ in optimizer.param_groups]
    factor = lr_lambda(scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.learning_rate
        group["weight_decay"] = cfg.weight_decay
        group["lr"] = cfg.learning_rate * factor
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def checkpoint_root(cfg: TrainConfig) -> str:
    """Where a run's checkpoints go: ``OUTPUT/checkpoints``."""
    return os.path.join(cfg.output_dir, "checkpoints")


def save_checkpoint(run, step: int, batcher_state: dict | None) -> str:
    """Collective: every rank checks its state is finite and writes its part, rank 0 the manifest (after
    every rank's write) and prunes this run's old checkpoints (:func:`~dynabatch.engine.checkpoint.save_collective`:
    ``NonFiniteError`` or ``CheckpointWriteError`` on every rank). A fresh run gets its id
    (``run.run_id``) at its first save; a resumed run keeps its checkpoint's. Returns the step folder."""
    if not run.run_id:
        run.run_id = new_run_id()  # only rank 0's id is written
    extra = None
    if run.ctx.is_planner:
        extra = {"data": batcher_state, "config": run.cfg.to_dict(), "scheduler": run.scheduler.state_dict(),
                 "world": {"stages": run.cfg.stages, "replicas": run.cfg.replicas},
                 "calibration": {"key": run.calibration_key, "fit": run.calibration.state_dict()}}
        if run.executor.loss_scaler is not None:
            extra["loss_scaler"] = run.executor.loss_scaler.state_dict()

    def gather(obj) -> list:
        out: list = [None] * run.ctx.world_size
        dist.all_gather_object(out, obj, group=run.ctx.delivery_group)
        return out

    write = dcp_writer(run.ctx.delivery_group)
    if run.model_files is not None:  # rank 0: what export needs besides the weights
        write = _and_model_files(write, run.model_files)
    return save_collective(checkpoint_root(run.cfg), step, run.ctx.rank,
                           stage_state(run.stage, run.optimizer, run.ctx.rank, run.executor.zero), gather=gather,
                           write=write, manifest_extra=extra, run_id=run.run_id, keep=run.cfg.save_total_limit)


def _and_model_files(write: Callable[[str, dict], None], files: ModelFiles) -> Callable[[str, dict], None]:
    """``write``, then the run's :class:`~dynabatch.training.model_files.ModelFiles` into the same step folder
    (before the manifest, so a checkpoint that counts holds them)."""

    def both(folder: str, state: dict) -> None:
        write(folder, state)
        files.write(folder)

    return both


def find_resume_checkpoint(cfg: TrainConfig, ctx) -> CheckpointInfo | None:
    """The checkpoint ``cfg.resume_from_checkpoint`` names (``latest`` with none in the output folder:
    ``None``, start at step 0 with a warning; ``latest`` where every finished save is broken since, or a PATH that is
    no checkpoint: ``ValueError``), after
    checking that no setting that cannot change did (:func:`resume_settings_line` is the line rank 0 logs about
    those that may). Runs before any data is loaded."""
    flag = "--resume-from-checkpoint"
    if cfg.resume_from_checkpoint == "latest":
        info = latest_checkpoint(checkpoint_root(cfg))
        saved = [os.path.basename(p) for p in list_checkpoints(checkpoint_root(cfg))
                 if os.path.isfile(os.path.join(p, MANIFEST))]
        if info is None and saved:  # saves that finished, all broken since: starting over would write over them
            raise ValueError(f"{flag}: every checkpoint in {checkpoint_root(cfg)} is corrupt ({', '.join(saved[-3:])}: "
                             "see the warnings above), so there is nothing to resume and a run from step 0 would "
                             "write over them; restore one, pass a checkpoint elsewhere as --resume-from-checkpoint "
                             "PATH, or start afresh: --overwrite-output-dir instead of --resume-from-checkpoint (it deletes them)")
        if info is None:
            if ctx.is_planner:
                logger.warning(f"{flag}: no complete checkpoint in {checkpoint_root(cfg)}; starting from step 0")
            return None
    else:
        try:
            info = resolve_checkpoint(cfg.resume_from_checkpoint)
        except ValueError as e:
            raise ValueError(f"{flag} {cfg.resume_from_checkpoint}: {e}") from None
    if info.step > cfg.max_steps:
        raise ValueError(f"{flag}: checkpoint {info.path} is at step {info.step}, past --max-steps "
                         f"{cfg.max_steps}; raise --max-steps to train further")
    compare_configs(info.manifest.get("config", {}), cfg, info.path)  # the changes that may are logged once, later
    return info


def resume(run, info: CheckpointInfo | None, lr_lambda: Callable[[int], float]) -> int:
    """Load checkpoint ``info`` (from :func:`find_resume_checkpoint`, any layout) into ``run``; returns the
    step to continue from."""
    if info is None:
        return 0
    cfg, manifest = run.cfg, info.manifest
    same_world = manifest.get("world") == {"stages": cfg.stages, "replicas": cfg.replicas}
    load_stage_state(info.path, run.stage, run.optimizer, run.ctx.rank if same_world else None, run.executor.zero)
    run.scheduler.load_state_dict(manifest["scheduler"])
    apply_hyperparameters(run.optimizer, run.scheduler, cfg, lr_lambda)
    if run.executor.loss_scaler is not None and manifest.get("loss_scaler"):  # fp16: go on with the saved scale
        run.executor.loss_scaler.load_state_dict(manifest["loss_scaler"])
    run.run_id = info.run_id
    if run.ctx.is_planner:
        try:
            run.batcher.load_state_dict(manifest["data"])
        except ValueError as e:
            raise ValueError(f"--resume-from-checkpoint {info.path}: {e}") from None
        run.planner.step = info.step
        _restore_calibration(run, manifest.get("calibration") or {}, info.path)
        if not same_world and cfg.dropout > 0:
            logger.info(f"--resume-from-checkpoint {info.path}: another layout draws other dropout masks (seeded per "
                        "step, micro-batch and rank) than the interrupted run would have")
    return info.step


def _restore_calibration(run, saved: dict, where: str) -> None:
    """Rank 0: the checkpoint's calibration fit when its key is this run's; else the fresh one stays, and with
    ``--calibrate quick`` it gets the start-up calibration a fresh run gets (``startup_step``), recorded as the
    step the first resumed steps are planned as of, which the planner waits for."""
    calibration, restored = run.calibration, False
    if calibration.enabled and saved.get("fit"):
        if json.loads(json.dumps(run.calibration_key)) == saved.get("key"):
            calibration.fit = OnlineFit.from_state_dict(saved["fit"])
            restored = True
        else:
            logger.info(f"--resume-from-checkpoint {where}: its calibration fit was measured on another layout or "
                        "device; the fit starts afresh")
    calibration.recorded_through = run.planner.step - 1
    if calibration.enabled and not restored and run.cfg.calibration_mode == "quick":
        as_of = calibration.as_of(run.planner.step)
        calibration.startup_step = as_of + 1  # quick_calibration records it as step as_of
        calibration.recorded_through = as_of - 1
