"""``dynabatch train``: the training loop on every rank.

Every rank builds the same seeded model, keeps only its own pipeline stage (``models.split``) and an
:class:`~dynabatch.engine.executor.Executor` with AdamW and a warm-up + decay LR schedule. Rank 0 loads and
tokenizes the mixture first and plans: a background planner (a thread,
:class:`~dynabatch.training.plan_ahead.PlanAhead`, or a child process, ``--planner``,
:mod:`~dynabatch.training.planner_process`) prepares the next steps' micro-batches (as rows of sample ids),
costs, schedules and validated plans while the current step trains. The other ranks then load the same data
(from the tokenizing cache), so each step :func:`~dynabatch.engine.step.train_step` delivers every rank its plan
and its replica's layout (:mod:`dynabatch.training.step_data`), and each rank collates its own micro-batches;
with datasets given in memory (rank 0's), rank 0 delivers the host tensors instead. Rank 0 logs one JSON record per step
(loss, real tokens/s, padding efficiency, micro-batch shapes, plan time and wait, predicted vs
measured step time, peak memory) and shows a progress bar. Checkpoints are per-rank shards plus a
manifest with the data position (``engine.checkpoint``), keyed by the global model's names so any
stage and replica count resumes them (``training.resume``); ``--resume-from-checkpoint`` continues from
one, so later losses match an uninterrupted run and no sample is skipped or repeated.
At the end the last step's measured timeline is written next to its simulated twin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dynabatch.training.config import Resolved, TrainConfig, lower
from dynabatch.training.config.resolve import BY_METHOD
from dynabatch.core.allocator import freed_tensors_kept
from dynabatch.core.words import counted
from dynabatch.core.policies import AUTO
from dynabatch.core.progress import progress
from dynabatch.cost.model_specs import layer_kinds
from dynabatch.cost.p2p import loopback_store
from dynabatch.data.batching import GlobalBatcher, LengthLimits, check_token_budget, replica_budget_problem
from dynabatch.data.inputs import data_notes, load_data
from dynabatch.data.tokenize import load_tokenizer, tokenizer_info
from dynabatch.models.attention_kernels import (KERNEL_CALLS, attention_kernel, calls_since, kernel_problem,
                                                use_attention_kernel)
from dynabatch.models.families import analytic_spec, check_model
from dynabatch.models.presets import build_run_model
from dynabatch.models.split import DeviceChunks, build_device_stages, check_num_stages, layout_for, pipeline_spec_for
from dynabatch.training.calibration import (RunCalibration, calibration_key, gather_measurements, load_calibration,
                                           new_fit, quick_calibration, save_calibration, stage_peaks, stage_times)
from dynabatch.training.cost_model import planner_cost_model
from dynabatch.engine.determinism import full_determinism
from dynabatch.engine.dist import DistContext, init_distributed, shutdown
from dynabatch.training.evaluate import (Evaluator, evaluation_enabled, flat_metrics, format_eval, gather_task_losses,
                                        hold_out)
from dynabatch.engine.errors import InterruptLatch, Interrupted
from dynabatch.engine.executor import Executor
from dynabatch.engine.faults import fail_fast, maybe_crash, maybe_slow_start
from dynabatch.engine.log import log_result, quiet_third_party, setup_logging
from dynabatch.training.model_files import ModelFiles
from dynabatch.training.metrics import (MetricsWriter, efficiency_record, format_summary, peak_rss_bytes,
                                       planning_overlap, summarize)
from dynabatch.engine.outputs import interruption_line, prepare_output_dir, run_dirs, truncate_metrics
from dynabatch.training.run_start import (check_same_settings, log_dropout, log_target_len, log_tokenizer,
                                          log_unset_pad, log_zero, record_resolved, resolve_run)
from dynabatch.training.plan_ahead import plan_ahead
from dynabatch.training.planner import StepPlanner
from dynabatch.engine.precision import autocast_dtype
from dynabatch.training.resume import find_resume_checkpoint, resume, save_checkpoint
from dynabatch.training.run_layout import RunLayout, sampled_run_layout, share_run_layout
from dynabatch.training.step_data import StepData, announce_data, data_ready
from dynabatch.engine.step import train_step
from dynabatch.training.tracking import Trackers, check_trackers, open_trackers, step_scalars
from dynabatch.engine.zero import ZeroShards
from dynabatch.schedule.placement import Placement
from dynabatch.training.timeline_files import write_timeline

logger = logging.getLogger(__name__)


@dataclass
class _Run:
    """The per-method state of a run on this rank."""

    cfg: TrainConfig
    ctx: DistContext
    stage: torch.nn.Module
    spec: Any
    layout: Any
    executor: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batcher: Any = None
    planner: Any = None
    run_id: str | None = None
    """Written into every checkpoint's manifest; a resumed run keeps its checkpoint's (pruning touches only it)."""
    calibration: Any = None
    """Rank 0: the :class:`~dynabatch.training.calibration.RunCalibration` the planner plans with."""
    calibration_key: Any = None
    held_out: Any = None
    """Rank 0 with ``--eval-holdout``: the rows held out of training (:func:`~dynabatch.training.evaluate.hold_out`)."""
    placement: Any = None
    """The :class:`~dynabatch.schedule.placement.Placement` of ``--placement`` (``None``: linear)."""
    step_data: Any = None
    """Every rank, when the ranks collate their own micro-batches: the :class:`~dynabatch.training.step_data.StepData`
    layouts are made of (rank 0) and collated from (every rank); ``None``: rank 0 delivers tensors."""
    model_files: ModelFiles | None = None
    """Rank 0: the model config and tokenizer every checkpoint keeps for export (:mod:`dynabatch.training.model_files`)."""


def _lr_lambda(cfg: TrainConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return 1.0 - progress if cfg.lr_scheduler_type == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return f


def connect(cfg: TrainConfig) -> DistContext:
    """Join torchrun's world, or make a world of one when launched directly."""
    if "RANK" in os.environ:
        return init_distributed(cfg.stages, cfg.replicas, timeout_s=cfg.timeout_s, device=cfg.device)
    if cfg.world_size != 1:
        raise ValueError(
            f"{cfg.stages} stages x {cfg.replicas} replicas need {cfg.world_size} processes: launch with "
            f"`torchrun --nproc-per-node {cfg.world_size} -m dynabatch train ...`"
        )

    store = loopback_store(1, cfg.timeout_s)  # listens on 127.0.0.1 only, for the whole run
    return init_distributed(1, 1, rank=0, world_size=1, store=store, timeout_s=cfg.timeout_s, device=cfg.device)


def build_run(cfg: TrainConfig, ctx: DistContext, datasets: Any = None) -> _Run:
    """Model stage, optimizer and executor on every rank of the resolved configuration ``cfg`` (:func:`resolve_run`); data (``datasets`` in memory, else as ``cfg`` says:
    :func:`load_training_data`) and planner on rank 0. The layer split and placement
    are rank 0's start-up choice (:mod:`dynabatch.training.run_layout`); the run's ``cfg`` has its placement
    resolved (``auto`` becomes the chosen one)."""
    family = check_model(cfg.model, cfg.max_input_len, cfg.slice_long).sequence_kind  # before any loading
    torch.set_num_threads(cfg.threads)
    tokenizer = load_tokenizer(cfg.tokenizer, cfg.model)
    info = tokenizer_info(tokenizer)
    model = build_run_model(cfg.model, cfg.tokenizer, info, family, dropout=cfg.dropout, seed=cfg.seed)
    given = None if cfg.placement == AUTO else Placement.parse(cfg.placement, cfg.stages)
    check_num_stages(model, cfg.stages, given)  # before the data is loaded and tokenized
    kernel = lower("attention_kernel", cfg.attention_kernel)  # resolved (train_method's configuration)
    if cfg.attention_path == "segments" and (problem := kernel_problem(kernel, ctx.device, cfg.dtype)):
        raise ValueError(problem)
    use_attention_kernel(kernel)
    loaded = None
    if ctx.is_planner:
        loaded = _load_data(cfg, tokenizer, family, datasets)
        maybe_slow_start()  # fault injection for the start-up tests (DYNABATCH_SLOW_START_S)
    # every rank collates its own micro-batches when it can read the data as rank 0 does (training.step_data)
    collates = announce_data(ctx, datasets is None, cfg.startup_timeout_s)
    if collates and not ctx.is_planner:
        loaded = _load_data(cfg, tokenizer, family, None)  # rank 0 has tokenized it: from the cache
    chosen = _run_layout(cfg, ctx, model, loaded, lambda: data_ready(ctx, cfg.startup_timeout_s) if collates else None)
    cfg = dataclasses.replace(cfg, placement=chosen.placement.describe())
    layout, placement = chosen.layout, chosen.placement
    spec = pipeline_spec_for(model, layout, "float32")
    chunks = [c.to(ctx.device) for c in build_device_stages(model, layout, ctx.stage_index, cfg.stages, cfg.attention_path,
                                                            moving_boundaries=cfg.moving_boundaries)]
    stage = chunks[0] if len(chunks) == 1 else DeviceChunks(chunks)
    zero = None
    if cfg.zero >= 1 and ctx.num_replicas > 1:  # AdamW over this replica's flat shards (engine.zero)

        zero = ZeroShards([p for c in chunks for p in c.parameters() if p.requires_grad], ctx.dp_group,
                          ctx.num_replicas, ctx.replica_index, shard_gradients=cfg.zero >= 2)
    optimizer = torch.optim.AdamW(zero.shard_params if zero is not None else stage.parameters(), lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    executor = Executor(chunks, ctx, optimizer, scheduler=scheduler, max_grad_norm=cfg.max_grad_norm or None, dropout_seed=cfg.seed,
                        measure_memory=True, autocast_dtype=autocast_dtype(cfg.dtype), zero=zero)
    run = _Run(cfg, ctx, stage, spec, layout, executor, optimizer, scheduler,
               placement=placement if placement.chunks_per_device > 1 else None)
    if collates:
        run.step_data = StepData(loaded.batcher, cfg, loaded.data.tokens)
    if ctx.is_planner:
        logger.info(f"pipeline: {chosen.describe()}" + "".join(
            f"; predicted {k} {v:.3f} s" for k, v in chosen.predicted_step_s.items()))
        run.held_out, run.batcher = loaded.held_out, loaded.batcher
        run.model_files = ModelFiles.of(model, tokenizer)
        cost_model = planner_cost_model(cfg, model.config, layout)
        run.calibration, run.calibration_key = run_calibration(cfg, cost_model, model.config.to_dict(), layout)
        run.planner = StepPlanner(run.batcher, cfg, cost_model, loaded.data.tokens, calibration=run.calibration,
                                  spec=spec)
        if run.calibration.enabled:
            logger.info(f"cost model: calibration {cfg.calibration_mode}; plans with the {run.planner.plan_costs} costs")
    return run


class _Loaded(NamedTuple):
    """Rank 0's training data, the rows held out of it (``--eval-holdout``) and its batcher."""

    data: Any
    held_out: Any
    batcher: Any


def load_training_data(cfg: TrainConfig, tokenizer, family: str, datasets: Any = None):
    """The training data (:class:`~dynabatch.data.pipeline.MixtureData`) of ``cfg`` (``mixture``, or ``data`` +
    ``columns``), or ``datasets`` given in memory (``train(cfg, datasets=...)``)."""
    return load_data(tokenizer, family, mixture=cfg.mixture, data=cfg.data, columns=cfg.columns, datasets=datasets,
                     bad_rows=cfg.bad_rows, seed=cfg.seed)


def _load_data(cfg: TrainConfig, tokenizer, family: str, datasets: Any) -> _Loaded:
    """The training data (``datasets`` in memory, else as ``cfg`` says) and its batcher: rank 0's, and every
    rank's when the ranks collate their own micro-batches (the same rows, held out alike). A budget that holds
    less than one maximal sample of the model's kind (T5: input and target limits; decoder-only: the sequence
    limit, ``max_input_len`` alone), or less than one per replica, is refused first: a batch of long samples would leave a replica
    without one (a global batch holds at least ``global_batch_tokens // max_tokens`` samples)."""
    limits = LengthLimits(family, max_input_len=cfg.max_input_len, max_target_len=cfg.max_target_len,
                          max_seq_len=cfg.max_input_len)
    check_token_budget(cfg.global_batch_tokens, limits, "--global-batch-tokens")
    if (problem := replica_budget_problem(cfg.global_batch_tokens, cfg.replicas, limits)) is not None:
        raise ValueError(problem)
    data = load_training_data(cfg, tokenizer, family, datasets)
    for note in data_notes(data):  # numbers cast to text, malformed rows skipped
        logger.info(f"data: {note}")
    held_out = None
    if cfg.eval_holdout:  # these rows are evaluated, never trained on
        data, held_out = hold_out(data, cfg.eval_holdout, data.spec.seed)
    return _Loaded(data, held_out, GlobalBatcher(data, limits, token_budget=cfg.global_batch_tokens, overlong=cfg.overlong))


def _run_layout(cfg: TrainConfig, ctx: DistContext, model, loaded: _Loaded | None, peers_ready=lambda: None):
    """Every rank: the run's :class:`~dynabatch.training.run_layout.RunLayout`. The reference split of an
    explicit placement needs no data, so every rank cuts it alone; otherwise rank 0 (``loaded``) chooses from
    its first global batches and the others receive the choice. ``peers_ready`` (collective) runs before the
    choice is shared: the other ranks may still be loading the data while rank 0 chooses."""
    if cfg.layer_split == "reference" and cfg.placement != "auto":
        peers_ready()
        placement = Placement.parse(cfg.placement, cfg.stages)
        return RunLayout(placement, layout_for(model, placement.num_stages, placement, cfg.cuts_inside_blocks))
    chosen = sampled_run_layout(cfg, model, loaded.data, loaded.batcher) if ctx.is_planner else None
    peers_ready()
    return share_run_layout(ctx, chosen, layer_kinds(analytic_spec(model.config)), cfg.startup_timeout_s)


def run_calibration(cfg: TrainConfig, cost_model, model_config: dict, layout):
    """Rank 0's :class:`~dynabatch.training.calibration.RunCalibration` (fit ``None`` with ``--calibrate off``;
    warm-started from ``--calibration-file``) and the key a calibration file of this run carries. A fresh
    run with the start-up calibration waits for it before planning step 0 (``recorded_through = -2``)."""
    key = calibration_key(cfg, model_config, layout)
    mode = cfg.calibration_mode
    if mode == "off":
        return RunCalibration(cost_model, None, cfg.plan_ahead), key
    warm = load_calibration(cfg.calibration_file, key) if cfg.calibration_file else None
    fit = new_fit(cost_model, cfg, warm)
    return RunCalibration(cost_model, fit, cfg.plan_ahead, recorded_through=-2 if mode == "quick" else -1), key


def _startup_calibration_step(cfg: TrainConfig, ctx: DistContext, run, info, start: int) -> int | None:
    """The step ``--calibrate quick``'s start-up calibration runs as, or ``None``: a fresh run's first step; on a
    resume only where rank 0 could not restore the checkpoint's fit (another layout or device, or none saved),
    which rank 0 tells the other ranks (collective)."""
    if cfg.calibration_mode != "quick" or start >= cfg.max_steps:
        return None
    if info is None:
        return start
    shared = [run.calibration.startup_step if ctx.is_planner else None]
    if ctx.world_size > 1:
        dist.broadcast_object_list(shared, src=0, group=ctx.delivery_group)
    return shared[0]


def train_method(resolved: Resolved, ctx: DistContext, *, checkpoints: bool = True, datasets: Any = None) -> dict | None:
    """Train ``max_steps`` steps of the resolved configuration (on ``datasets`` in memory when given); rank 0 prints
    the resolved choices, writes ``OUTPUT/config.yaml`` and returns the summary."""
    cfg = resolved.config
    if checkpoints:
        prepare_output_dir(cfg.output_dir, ctx, resume=cfg.resume_from_checkpoint,
                           overwrite=cfg.overwrite_output_dir,
                           claims=run_dirs(check_trackers(cfg.report_to), cfg.compare_method))
    info = find_resume_checkpoint(cfg, ctx) if cfg.resume_from_checkpoint else None
    run = build_run(cfg, ctx, datasets)
    if cfg.placement != run.cfg.placement:  # --placement auto, chosen from the run's first global batches
        resolved = resolved.with_choice("placement", run.cfg.placement, "the shortest predicted step on the run's "
                                        "first global batches")
    cfg = run.cfg
    if ctx.is_planner:
        record_resolved(resolved, info)
    start = resume(run, info, _lr_lambda(cfg))
    memory = cfg.memory_gib * 2**30
    metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
    if ctx.is_planner:
        truncate_metrics(metrics_path, start)  # steps the earlier run logged after its last checkpoint
    writer = MetricsWriter(metrics_path) if ctx.is_planner else None
    evaluator = None
    if evaluation_enabled(cfg):  # rank 0 loads the evaluation set (training.evaluate)
        evaluator = Evaluator.create(cfg, ctx, metrics_path, run.held_out)
    bad_steps = 0
    ahead = plan_ahead(run.planner, cfg.max_steps - start, cfg.plan_ahead, cfg.planner) if ctx.is_planner else None
    startup = _startup_calibration_step(cfg, ctx, run, info, start)  # collective on a resume
    if startup is not None:
        try:
            quick_calibration(run.executor, ctx, run.planner, run.spec, startup,  # collective
                              startup_timeout_s=cfg.startup_timeout_s)
        except BaseException:
            if ahead is not None:
                run.calibration.close()
                ahead.close()
            raise
    tracker = Trackers()  # rank 0: TensorBoard / W&B as --report-to says (training.tracking)
    bar = progress(total=cfg.max_steps, initial=start, desc=f"train {cfg.method}", unit="steps", disable=not ctx.is_planner,
                   leave=False)  # a bar on a terminal, plain periodic lines in a file
    planned = result = None
    unfinished = start  # the step a Ctrl-C interrupts: the first one not finished (its checkpoint, if due, saved)
    latch = InterruptLatch()
    try:
        latch.__enter__()
        if ctx.is_planner:
            tracker = open_trackers(cfg.report_to, cfg.output_dir, cfg.to_dict(), start)
        for step in range(start, cfg.max_steps):
            latch.check()  # a Ctrl-C Python dropped inside a destructor (during a save, say) stops here
            maybe_crash(step, ctx.rank)
            wait = 0.0
            if ctx.is_planner:
                planned, wait = ahead.get(timeout_s=max(600.0, cfg.timeout_s))
                assert planned.step == step, (planned.step, step)
            kernels_before = Counter(KERNEL_CALLS)
            lr = run.scheduler.get_last_lr()[0]  # the rate this step's update uses (train_step moves the schedule on)
            t0 = time.perf_counter()
            thin = run.step_data is not None  # plans and layouts travel; each rank collates its own micro-batches
            result = train_step(
                run.executor, ctx, step,
                planned.replica_micro_batches if ctx.is_planner and not thin else None,
                replica_layouts=run.step_data.layouts(planned) if ctx.is_planner and thin else None,
                global_loss_tokens=run.step_data.loss_tokens(planned) if ctx.is_planner and thin else None,
                collate=run.step_data.micro_batches if thin else None,
                spec=run.spec, policy=lower("policy", cfg.policy),
                costs=planned.costs if ctx.is_planner else None, memory_limit_bytes=memory,
                schedules=planned.schedules if ctx.is_planner else None,
                slice_links=planned.slice_links if ctx.is_planner else None,
                receive_timeout_s=cfg.startup_timeout_s if step == start else None,  # rank 0 may still be loading
                model_state_bytes=planned.model_state_bytes if ctx.is_planner else 0.0, placement=run.placement,
                plans=planned.plans if ctx.is_planner else None,  # lowered and validated by the planner
            )
            elapsed = time.perf_counter() - t0
            gathered = gather_measurements(ctx, result)  # collective
            if ctx.is_planner:
                saved_peaks = stage_peaks(ctx, gathered)
                run.calibration.record(ctx, planned, gathered, elapsed)
            bad_steps = bad_steps + 1 if result.skipped and not result.overflowed else 0
            if result.overflowed and ctx.is_planner:
                logger.info(f"step {step}: fp16 gradients overflowed at loss scale {result.loss_scale:g}; the step was "
                            "skipped and the scale halved")
            elif result.skipped and ctx.is_planner:
                logger.warning(f"step {step}: {_non_finite(result)}; the optimizer step was skipped "
                               f"({bad_steps} in a row; the run stops at --max-bad-steps {cfg.max_bad_steps})")
            task_loss = None
            if cfg.task_loss_every and ((step + 1) % cfg.task_loss_every == 0 or step + 1 == cfg.max_steps):
                task_loss = gather_task_losses(ctx, result, planned)  # collective
            if ctx.is_planner:
                record = _record(step, result, planned, elapsed, wait, lr)
                record["attention"] = run.stage.attention
                record["attention_kernels"] = calls_since(kernels_before)  # this rank's calls per kernel
                record["dtype"] = cfg.dtype
                if result.loss_scale is not None:
                    record["loss_scale"] = result.loss_scale
                record["memory_measured_bytes"] = saved_peaks
                record["model_state_bytes"] = [g["model_state"] for g in gathered]  # per global rank, measured
                record["model_state_bytes_predicted"] = list(planned.model_state_bytes)  # per stage, priced
                record["gradient_peak_bytes"] = [g["grad_peak"] for g in gathered]  # per global rank, measured
                record["gradient_peak_bytes_predicted"] = [g["grad_peak_predicted"] for g in gathered]
                if cfg.zero >= 2:
                    record["gradient_collectives"] = [g["grad_collectives"] for g in gathered]  # per global rank
                record["memory_predicted_bytes"] = list(planned.predicted_saved_bytes)
                record.update(prediction_record(ctx, gathered, planned, elapsed, writer.records, run.calibration))
                record.update(efficiency_record(ctx, gathered, planned, elapsed, planned.plan_model,
                                                run.planner.family))
                if task_loss is not None:
                    record["task_loss"] = task_loss
                    logger.info(f"step {step} loss per task: " + ", ".join(f"{t} {v:.3f}" for t, v in task_loss.items()))
                writer.write(record)
                tracker.log(step_scalars(record), step)
                # the postfix first: a plain line (not a terminal) is written by update, with this step's figures
                bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
                bar.update(1)
                if cfg.logging_steps and (step + 1) % cfg.logging_steps == 0:
                    logger.info(step_line(record))
            if bad_steps >= cfg.max_bad_steps:
                if ctx.world_size > 1:  # every rank decides alike; wait so rank 0 has written this step's record
                    dist.barrier(group=ctx.delivery_group)
                raise TrainingDivergedError(
                    f"training diverged: {counted(bad_steps, 'step')} in a row up to step {step} had a non-finite loss or "
                    f"gradient norm (step {step}: {_non_finite(result)}) and were skipped (--max-bad-steps "
                    f"{cfg.max_bad_steps}); no checkpoint holds non-finite weights. Lower --learning-rate (now {cfg.learning_rate:g}) or "
                    "--max-grad-norm, or check the data; --resume-from-checkpoint continues from the newest checkpoint"
                )
            if evaluator is not None and evaluator.due(step):
                row = evaluator.evaluate(run, step)  # collective; rank 0 appends the row to metrics.jsonl
                if row is not None:
                    logger.info(format_eval(row))
                    tracker.log(flat_metrics(row), step)
            last = step + 1 == cfg.max_steps
            if checkpoints and ((cfg.save_steps and (step + 1) % cfg.save_steps == 0) or last):
                save_checkpoint(run, step + 1, planned.batcher_state_after if ctx.is_planner else None)
            unfinished = step + 1  # a Ctrl-C before the loop moves on interrupts the next step, not this one
        if cfg.timeline and result is not None:
            write_timeline(run, result, planned)
        if ctx.is_planner and run.calibration.enabled and result is not None:
            save_calibration(os.path.join(cfg.output_dir, "calibration.json"), run.calibration_key, run.calibration.fit,
                             cfg.max_steps - 1)
    except KeyboardInterrupt as e:  # Ctrl-C: _train names the step and the newest checkpoint in one line
        if isinstance(e, Interrupted):
            raise
        raise Interrupted(step=unfinished) from None
    finally:
        latch.__exit__()
        bar.close()
        tracker.close()
        if ahead is not None:
            run.calibration.close()
            ahead.close()
    if not ctx.is_planner:
        return None
    summary = summarize(writer.records, cfg.method)
    if evaluator is not None and evaluator.rows:
        summary["eval"] = evaluator.rows[-1]["eval"]
    return summary


class TrainingDivergedError(ValueError):
    """``max_bad_steps`` steps in a row had a non-finite loss or gradient norm (the settings diverge)."""


def _non_finite(result) -> str:
    return f"loss {result.loss} and gradient norm {result.grad_norm}"


_SHOWN = ("step", "loss", "tokens_per_s", "padding_efficiency", "num_micro_batches", "step_time_s", "predicted_step_s",
          "plan_wait_s")


def step_line(record: dict[str, Any]) -> str:
    """The line ``--logging-steps`` prints: a few of the step's metrics as JSON, rounded to what a reader compares
    (4 significant digits, whole tokens per second); ``metrics.jsonl`` keeps the full values."""
    def short(v):
        if not isinstance(v, float) or not math.isfinite(v):
            return v
        return round(v) if abs(v) >= 1000 else float(f"{v:.4g}")

    return json.dumps({k: short(record[k]) for k in _SHOWN})


def _record(step, result, planned, elapsed: float, wait: float, lr: float) -> dict[str, Any]:
    return {
        "step": step,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": lr,
        "real_tokens": planned.real_tokens,
        "computed_tokens": planned.computed_tokens,
        "padding_efficiency": planned.real_tokens / planned.computed_tokens,
        "loss_tokens": result.num_loss_tokens,
        "num_samples": len(planned.batch),
        "num_micro_batches": planned.num_micro_batches,
        "sliced_samples": planned.num_sliced_samples,
        "candidate": planned.candidate,
        "recompute": planned.recompute_counts,
        "boundary_moves": planned.moved_micro_batches,
        "micro_batch_shapes": [list(map(list, s)) for s in planned.shapes],
        "tokens_per_s": planned.real_tokens / elapsed,
        "step_time_s": elapsed,
        "predicted_step_s": planned.predicted_step_s,
        "bubble_fraction_predicted": planned.bubble_fraction,
        "schedule_policy": [s.policy for s in planned.schedules],  # per replica: linear policy, or the placed order
        "plan_time_s": planned.plan_time_s,
        "plan_wait_s": wait,
        "plan_overlap": planning_overlap([{"plan_time_s": planned.plan_time_s, "plan_wait_s": wait}]),
        "skipped": result.skipped,
        "truncated": planned.batch.num_truncated,
        "dropped": planned.batch.num_dropped,
        "samples_digest": _digest(planned.batch),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def prediction_record(ctx, gathered, planned, elapsed: float, records: list, calibration) -> dict[str, Any]:
    """Predicted against measured for one step's record: per stage (replica 0, forward + backward seconds),
    the step's relative error and its running median over the last 10 steps (``records``: the earlier ones)."""
    import numpy as np

    err = abs(planned.predicted_step_s - elapsed) / elapsed if elapsed > 0 else 0.0
    recent = [r["prediction_error"] for r in records[-9:] if "prediction_error" in r] + [err]
    c = (planned.predicted_costs or planned.costs)[0]
    predicted = (np.asarray(c.fwd_s) + np.asarray(c.bwd_s)).sum(axis=1)
    out = {"predicted_makespan_s": planned.predicted_makespan_s,
           "stage_time_measured_s": stage_times(ctx, gathered), "stage_time_predicted_s": [float(x) for x in predicted],
           "prediction_error": err, "prediction_error_median": float(np.median(recent)),
           "calibration": "off" if not calibration.enabled else f"online as of step {calibration.as_of(planned.step)}"}
    return out


def _digest(batch) -> str:
    """Short hash of the (source, row) ids of a global batch: equal digests = the same samples."""
    import hashlib

    ids = ",".join(f"{s.source_index}:{s.row_index}" for s in batch.samples)
    return hashlib.sha1(ids.encode()).hexdigest()[:16]


def train(cfg: TrainConfig, datasets: Any = None) -> dict | None:
    """Run ``cfg`` (and ``cfg.compare_method`` from the same start); rank 0 logs and returns the summary.
    ``datasets``: train on a ``datasets.Dataset`` / ``IterableDataset`` (or a mapping of task names to them)
    instead of ``cfg.mixture`` / ``cfg.data`` (rank 0's are used; ``cfg.columns`` maps their columns).
    With several ranks, an error ends this process at once with one line of its own
    (:func:`~dynabatch.engine.faults.fail_fast`); in a world of one it is raised for the CLI to print.
    ``cfg.full_determinism``: torch's deterministic settings for the run (:mod:`dynabatch.engine.determinism`)."""
    resolved = resolve_run(cfg)  # every auto decided here, before any rank connects
    with (run_process_settings(resolved.config),
          full_determinism(resolved.config.full_determinism, resolved.config.seed)):
        return _train(cfg, resolved, datasets)


@contextlib.contextmanager
def run_process_settings(cfg: TrainConfig):
    """The process-wide settings of a run (``train``, ``bench``) of the resolved ``cfg``: freed memory kept as its
    ``cpu_allocator`` says (:func:`~dynabatch.core.allocator.freed_tensors_kept`); the attention kernel and torch's
    thread count the run sets are given back after it, so a process that goes on (a notebook, a test) gets its own."""
    kernel, threads = attention_kernel(), torch.get_num_threads()
    try:
        with freed_tensors_kept(cfg.cpu_allocator == "keep"):
            yield
    finally:
        use_attention_kernel(kernel)
        torch.set_num_threads(threads)


def _train(given: TrainConfig, resolved: Resolved, datasets: Any) -> dict | None:
    """:func:`train` of the configuration as ``given`` and as ``resolved``."""
    cfg = resolved.config
    ctx = connect(cfg)
    setup_logging(cfg.log_level, ctx.rank)
    quiet_third_party(ctx.rank)
    try:
        # With peers, a failure prints this rank's line and exits at once, groups left up (engine.faults).
        with fail_fast(ctx):
            check_same_settings(ctx, given)
            if ctx.is_planner:
                check_trackers(cfg.report_to)  # a missing tracker package: one line before anything is loaded or logged
            log_tokenizer(given, ctx)
            log_dropout(given, ctx)
            log_unset_pad(given, ctx)
            log_zero(given, ctx)
            log_target_len(given, ctx)
            try:
                summaries = [train_method(resolved, ctx, datasets=datasets)]  # creates and checks the output folder first
                if cfg.compare_method:  # resolved afresh: its method's rules (a baseline recomputes nothing)
                    other = resolve_run(dataclasses.replace(
                        given, method=cfg.compare_method, compare_method=None, slice_long=False,
                        resume_from_checkpoint=None, overwrite_output_dir=False, timeline=False,
                        output_dir=os.path.join(cfg.output_dir, f"compare-{cfg.compare_method}"),
                        **{name: AUTO for name in BY_METHOD}))
                    os.makedirs(other.config.output_dir, exist_ok=True)
                    try:  # after this run's steps: its line says so, or it reads as this run's failure
                        summaries.append(train_method(other, ctx, checkpoints=False, datasets=datasets))
                    except ValueError as err:
                        raise ValueError(f"--compare-method {cfg.compare_method}: {err} (this run's steps are in "
                                         f"{os.path.join(cfg.output_dir, 'metrics.jsonl')})") from err
            except KeyboardInterrupt as e:  # one line: the step, and the newest complete checkpoint to resume from
                raise Interrupted(interruption_line(cfg.output_dir, getattr(e, "step", None))) from None
            if not ctx.is_planner:
                return None
            summary = {"runs": summaries, "config": cfg.to_dict()}
            log_result(logger, "== summary ==")  # the run's result: printed at every --log-level
            for s in summaries:
                log_result(logger, format_summary(s))
            if len(summaries) == 2 and summaries[1]["tokens_per_s"] > 0:
                ratio = summaries[0]["tokens_per_s"] / summaries[1]["tokens_per_s"]
                summary["speedup_vs_compare"] = ratio
                log_result(logger, f"speed-up of {cfg.method} over {cfg.compare_method} (real tokens/s, same "
                                   f"batches): {ratio:.2f}x")
            if cfg.timeline:
                logger.info(f"timeline: {os.path.join(cfg.output_dir, 'timeline.png')} (Chrome trace: timeline.json)")
            path = os.path.join(cfg.output_dir, "summary.json")
            if cfg.resume_from_checkpoint and not summaries[0].get("steps") and os.path.exists(path):
                logger.info(f"nothing left to train (the checkpoint is at --max-steps {cfg.max_steps}); the earlier "
                            f"run's {path} is kept")
                return summary
            with open(path, "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1)
            return summary
    finally:
        shutdown()
