"""The sections of a training run's configuration: one typed, frozen dataclass each.

Every field is one flag of every command that uses its section (:mod:`dynabatch.training.config.flags` generates them
through ``transformers.HfArgumentParser``): ``--learning-rate`` and ``--learning_rate`` both work, choices come
from the field's ``Literal`` type, the help text and aliases (today's older names, ``--lr``) from its metadata,
and ``--help`` shows every default. :class:`~dynabatch.training.config.TrainConfig` is all sections at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# The registries of names (each registered once, in dynabatch.core) give the flags' choices and help.
from dynabatch.core.allocator import CPU_ALLOCATORS
from dynabatch.core.attention import ATTENTION_KERNELS, ATTENTION_PATHS
from dynabatch.core.dtypes import DTYPE_TORCH_NAMES, DTYPES
from dynabatch.core.methods import METHODS
from dynabatch.core.packing import PACK_ROWS, PLAN_CANDIDATES
from dynabatch.core.policies import POLICY_CHOICES, RECOMPUTE_POLICIES
from dynabatch.data.baselines import BaselineOptions, option_help
from dynabatch.data.batching import DEFAULT_GLOBAL_BATCH_TOKENS

POLICIES = POLICY_CHOICES
"""``--policy``: :data:`dynabatch.core.policies.POLICY_CHOICES` (a schedule policy or ``auto``)."""
PLANNERS = ("auto", "process", "thread")
"""``--planner``: where rank 0's background planner runs (:func:`dynabatch.training.plan_ahead.plan_ahead`)."""
LR_SCHEDULES = ("constant", "linear", "cosine")
PLAN_COSTS = ("base", "scaled", "calibrated")
"""``--plan-costs`` other than ``auto``: plan with the base cost model, the base model scaled per stage and direction
to the online fit (:meth:`~dynabatch.cost.online.OnlineFit.scales`), or the online fit itself."""
PLAN_COSTS_AUTO = {"seq2seq": "calibrated", "causal": "base"}
"""What ``--plan-costs auto`` plans with, per sequence kind, as measured (docs/benchmarks/calibration/): the fit plans
encoder-decoders better than the analytic model (0.98-1.05x, mean 1.03x), decoder-only models slightly worse
(0.96-0.99x)."""
PLAN_COST_CHOICES = ("auto", *PLAN_COSTS)
CALIBRATIONS = ("auto", "quick", "online", "off")
"""``--calibrate``: auto (quick + online without --cost-profile, online with one), quick (start-up measurements, then
online), online (fit the cost model to the measured stage times as the run goes) or off (the base model as is);
:mod:`dynabatch.training.calibration` uses this list."""
LAYER_SPLITS = ("data", "reference")
"""``--layer-split``: chunks balanced over the sampled global batches' micro-batches, or over one reference shape."""
SPLIT_BLOCKS = ("auto", "on", "off")
"""``--split-blocks``: whether layer splits may cut inside decoder-only blocks (``TrainConfig.cuts_inside_blocks``)."""
SEARCHES = {"policy": "per_step", "recompute": "per_micro_batch", "pack_rows": "per_step",
            "attention_kernel": "per_call"}
"""What ``auto`` resolves to where the choice is a search the run makes as it goes (:mod:`dynabatch.training.config.resolve`):
the schedule policy per step, recomputation per micro-batch and stage, row packing per step, the attention kernel
per call. A resolved configuration (``OUTPUT/config.yaml``) names them so; the lower layers call them ``auto``."""
LOG_LEVELS = ("debug", "info", "warning", "error")
OVERLONG = ("truncate", "drop", "error")
BAD_ROWS = ("error", "skip")
TRACKERS = ("tensorboard", "wandb")
"""``--report-to``: the experiment trackers :mod:`dynabatch.training.tracking` writes to."""


LEVELS = ("basic", "advanced", "experimental")
"""Help levels of a field (its ``level`` metadata): ``basic`` fields are what a user needs to run a job, the only
ones ``--help`` lists (one line each, by section); ``--help-all`` lists every field, ``advanced`` ones in their
section's group and ``experimental`` ones (research switches: baseline knobs, placement, layer and block split,
recomputation, cost model and calibration modes, planner, attention path and kernel, row packing, timeouts) in
one ``experimental`` group (:mod:`dynabatch.training.config.flags`)."""


def arg(default: Any, help: str, *aliases: str, level: str = "basic", **argparse_kwargs: Any):
    """A config field: its default, the help line of its flag (what the option does; measurements belong in the
    docs), older flag names (``"lr"`` gives ``--lr``; they are accepted in config files and
    :meth:`TrainConfig.of` too), its help ``level`` (:data:`LEVELS`) and extra ``argparse`` settings."""
    if level not in LEVELS:
        raise ValueError(f"unknown help level {level!r}; valid: {', '.join(LEVELS)}")
    flags = [f"--{a}" for name in aliases for a in dict.fromkeys((name, name.replace("_", "-")))]
    return field(default=default, metadata={"help": help, "aliases": flags, "level": level, **argparse_kwargs})


def advanced(default: Any, help: str, *aliases: str, **argparse_kwargs: Any):
    """:func:`arg` of an ``advanced`` field: listed by ``--help-all`` in its section, not by ``--help``."""
    return arg(default, help, *aliases, level="advanced", **argparse_kwargs)


def experimental(default: Any, help: str, *aliases: str, **argparse_kwargs: Any):
    """:func:`arg` of an ``experimental`` field: a research switch, in ``--help-all``'s ``experimental`` group."""
    return arg(default, help, *aliases, level="experimental", **argparse_kwargs)


@dataclass(frozen=True)
class ModelArgs:
    _argument_group_name = "model"

    model: str = arg("t5-tiny", "model preset (t5-tiny, t5-small, gpt2-tiny, gpt2-small, llama-tiny, ...: an unknown "
                                "name lists them all) or a local Hugging Face checkpoint folder")
    tokenizer: str = arg("auto", "builtin, gpt2, byt5, a local tokenizer folder, or auto (the --model folder's own, "
                                 "else builtin)")
    attention: Literal[ATTENTION_PATHS] = experimental(
        "segments", f"attention kernel: {ATTENTION_PATHS.describe(' or ')}")
    attention_kernel: Literal[(*ATTENTION_KERNELS, SEARCHES["attention_kernel"])] = experimental(
        "auto", f"kernel of --attention segments: {ATTENTION_KERNELS.describe(' or ')}; auto resolves to sdpa on "
                "CPU, per_call on CUDA; metrics.jsonl's attention_kernels says which ran")
    dropout: float = advanced(0.0, "dropout probability of the model (also replaces a --model folder's own rate)")
    dtype: Literal[DTYPES] = arg("fp32", f"compute precision: {', '.join(DTYPES)} (bf16 and fp16: autocast over fp32 weights)")
    device: str = arg("auto", "cpu, cuda, cuda:N, or auto (cuda:LOCAL_RANK when CUDA is available, else cpu)")
    threads: int = experimental(1, "torch intra-op threads per rank (the cost profile's setting)")
    cpu_allocator: Literal[CPU_ALLOCATORS] = experimental(
        "auto", "a CPU rank's tensor memory: keep (freed memory stays in the process for the next step: no page faults, "
                "a larger resident set), system (the C library's defaults) or auto (keep for an encoder-decoder on CPU "
                "when the ranks' --memory-gib fit the machine twice over, else system)")


@dataclass(frozen=True)
class DataArgs:
    _argument_group_name = "data"

    mixture: str | None = arg(None, "mixture spec (.yaml/.json/.toml); default: the built-in offline mixture")
    data: str | None = arg(None, "one data file (json/jsonl/csv/parquet/arrow) or a dataset in the local Hugging Face "
                                 "cache instead of a mixture")
    columns: str | None = arg(None, "with --data: map columns, e.g. inputs=question,targets=answer[,task=category]")
    max_input_len: int = arg(512, "T5 encoder limit; GPT sequence limit (inputs + targets)")
    max_target_len: int = arg(128, "T5 decoder limit")
    overlong: Literal[OVERLONG] = advanced("truncate", "over-long samples: truncate, drop or error")
    bad_rows: Literal[BAD_ROWS] | None = advanced(None, "malformed rows: error or skip (drop and count); default: the "
                                                   "mixture spec's bad_rows (error)")


@dataclass(frozen=True)
class BatchingArgs:
    _argument_group_name = "batching"

    method: Literal[METHODS] = arg("dynamic", "batching: dynamic (the planner) or a baseline to compare: "
                                               f"{', '.join(m for m in METHODS if m != 'dynamic')}")
    global_batch_tokens: int = arg(DEFAULT_GLOBAL_BATCH_TOKENS, "real tokens (inputs + targets) per optimizer step",
                                   "token_budget")
    samples_per_micro_batch: int = experimental(BaselineOptions.samples_per_micro_batch, option_help("samples_per_micro_batch"))
    token_budget_tokens: int = experimental(BaselineOptions.token_budget_tokens, option_help("token_budget_tokens"))
    packing_rows: int = experimental(BaselineOptions.packing_rows, option_help("packing_rows"))
    packing_free_rows: int = experimental(BaselineOptions.packing_free_rows, option_help("packing_free_rows"))
    packing_free_split_tokens: int = experimental(BaselineOptions.packing_free_split_tokens,
                                                  option_help("packing_free_split_tokens"))
    max_micro_batch_samples: int = experimental(64, "dynamic: samples per planned micro-batch at most")
    pack_rows: Literal[(*PACK_ROWS, SEARCHES["pack_rows"])] = experimental(
        "device", "dynamic: auto = also plan with several short samples per row (padding-free pricing) and keep the "
                  "best plan; flat = every micro-batch one row of its samples back to back (no layer computes pad; on "
                  "CPU at most one row of the length limits); off = one sample per row; per_step = what auto "
                  "resolves to; device (default) = per_step on CUDA, off on CPU and in plan/simulate (docs/configuration.md, resolution rules); auto and flat only with "
                  "--attention segments")
    plan_candidates: Literal[PLAN_CANDIDATES] = experimental(
        "baselines", "dynamic: baselines = also plan each global batch as the padding-free baselines would at every "
                     "value of their tuning grids, price every plan with the same cost model and schedule simulator, "
                     "and run the one predicted fastest (never predicted slower than a baseline); off = the "
                     "partition DP's plan alone")
    slice_long: bool = experimental(False, "GPT, dynamic: cut samples that dominate the pipeline bubble or do not fit memory "
                                  "into token slices (TeraPipe)")
    compare_method: Literal[METHODS] | None = experimental(None, "also train max_steps steps with this method from the same "
                                                        "start and report the speed ratio")


@dataclass(frozen=True)
class PipelineArgs:
    _argument_group_name = "pipeline"

    stages: int = arg(1, "pipeline stages per replica")
    replicas: int = arg(1, "data-parallel replicas; the world size must be stages x replicas")
    policy: Literal[(*POLICIES, SEARCHES["policy"])] = experimental(
        "auto", f"pipeline schedule: {POLICIES.describe(' or ')}, which resolves to per_step")
    placement: str = experimental("linear", "pipeline stages on the devices: linear (one chunk per device), cyclic (T5: device d "
                                   "holds encoder chunk d and decoder chunk d), interleaved:V (V chunks per device, dealt "
                                   "round robin), or auto (the fastest of linear and cyclic / interleaved:2 on the run's "
                                   "own first global batches, simulated once at start); virtual stages are "
                                   "ordered every step by the list scheduler, interleaved 1F1B or DynaPipe's wait-free "
                                   "cyclic order, whichever simulates shorter (--policy does not apply)")
    layer_split: Literal[LAYER_SPLITS] = experimental(
        "data", "pipeline layer split: balanced over the micro-batches of the run's first global batches, each layer "
                "priced by the planner's base cost model (data), or over one reference micro-batch of 4 x min(max "
                "input, 512) / min(max target, 128) tokens (reference)")
    split_blocks: Literal[SPLIT_BLOCKS] = experimental(
        "auto", "the layer split may also cut inside a block, between its attention and MLP halves (decoder-only "
                "blocks, T5 encoder blocks), where that takes more than a hundredth off the slowest stage's time: auto (wherever the cost "
                "model prices halves: the analytic model, not --cost-profile), on (an error with --cost-profile) or "
                "off (whole blocks)")
    moving_boundaries: bool = experimental(
        False, "every micro-batch chooses on which side of each stage cut the unit beside it runs (a block or block "
               "half, held by both stages, its gradients summed like tied weights), so the planner evens the stages' "
               "work out within each step (linear placement; decoder-only blocks and T5 encoder blocks)")
    memory_gib: float = arg(4.0, "device memory per rank the planner may use (activations + model states), GiB")
    zero: int = advanced(0, "shard model states across the data-parallel replicas of each stage (DeepSpeed's ZeRO "
                       "stages): 0 (every replica keeps full weights, gradients and AdamW states), 1 (AdamW "
                       "states sharded: gradients reduce-scattered and weights all-gathered at the step boundary; "
                       "any micro-batch counts) or 2 (gradients sharded too, reduced after each micro-batch's backward: "
                       "every replica of a stage runs the same number of micro-batches, a baseline's cut to match, "
                       "and on virtual stages replica 0's chunk order); the planner "
                       "prices each rank's share", choices=[0, 1, 2])
    recompute: Literal[(*RECOMPUTE_POLICIES, SEARCHES["recompute"])] = experimental(
        "auto", f"activation recomputation: {RECOMPUTE_POLICIES.describe(' or ')} (none wherever memory does not "
                "bind), which resolves to per_micro_batch (none for a baseline or with --cost-profile)")
    cost_profile: str | None = experimental(None, "profile JSON from `dynabatch profile` to plan with measured costs; "
                                         "default: the analytic model")
    calibrate: Literal[CALIBRATIONS] = experimental(
        "auto", "fit the planner's stage times to what the run measures: auto (quick + online; online only with "
                "--cost-profile), quick (a few seconds of start-up measurements, then online), online or off")
    plan_costs: Literal[PLAN_COST_CHOICES] = experimental(
        "auto", "what the planner decides with when calibrating: base (the analytic preset or --cost-profile; the fit "
                "only predicts), scaled (the base model scaled per stage and direction to the fit: its ranking of "
                "shapes, the measured stage times), calibrated (the online fit) or auto (calibrated for "
                "encoder-decoders, base for decoder-only models; docs/configuration.md says why)")
    calibration_file: str | None = experimental(None, "warm start from the calibration.json an earlier run on the same device, "
                                             "model and layout wrote (not with --calibrate off)")
    plan_ahead: int = experimental(2, "steps the background planner prepares ahead of training")
    planner: Literal[PLANNERS] = experimental(
        "auto", "where rank 0 plans ahead: process (a child process: never holds the training loop's GIL), thread "
                "(a thread of rank 0: no start-up cost) or auto (process on CUDA, thread on CPU; the run logs its "
                "choice)")
    timeout_s: float = experimental(120.0, "seconds before a silent peer counts as dead (each step's transfers and collectives)")
    startup_timeout_s: float = experimental(3600.0, "seconds the other ranks wait for rank 0 to load and tokenize the data and "
                                           "plan the first step")


@dataclass(frozen=True)
class OptimArgs:
    _argument_group_name = "optim"

    learning_rate: float = arg(1e-3, "peak learning rate of AdamW", "lr")
    weight_decay: float = advanced(0.01, "AdamW weight decay")
    warmup_steps: int = arg(5, "linear warm-up steps")
    lr_scheduler_type: Literal[LR_SCHEDULES] = arg(
        "linear", "learning rate after warm-up: constant, linear (decay to 0 at max_steps) or cosine",
        "lr_schedule")
    max_grad_norm: float = advanced(1.0, "clip the global gradient norm to this (0: no clipping; the norm is still "
                                         "logged and checked for divergence)")
    max_steps: int = arg(20, "optimizer steps to train (in total, counting resumed ones)", "steps")
    seed: int = arg(0, "seed of the model initialisation, the data order and dropout")
    full_determinism: bool = arg(False, "the same seed, data and configuration give the same micro-batches and "
                                        "bitwise-equal losses, resumed or not: plans from the base cost model (the "
                                        "online fit only predicts) and torch's deterministic algorithms")
    max_bad_steps: int = advanced(3, "stop the run after this many steps in a row with a non-finite loss or gradient norm "
                                "(each is skipped)")


@dataclass(frozen=True)
class CheckpointArgs:
    _argument_group_name = "checkpoint"

    output_dir: str = arg("runs/train", "run folder: metrics.jsonl, checkpoints/, summary.json, timeline")
    resume_from_checkpoint: str | None = arg(
        None, "continue from a checkpoint: no value (or 'latest') = the newest complete one in "
              "output_dir/checkpoints, or a checkpoint folder (step-NNNNNN) or a checkpoints/ folder",
        "resume", nargs="?", const="latest", metavar="PATH")
    save_steps: int = arg(0, "save a checkpoint every N steps (0: only at the end)", "checkpoint_every")
    save_total_limit: int = advanced(2, "checkpoints of this run kept (older ones are deleted)", "keep_checkpoints")
    overwrite_output_dir: bool = advanced(False, "start a fresh run in an output folder that holds another run's "
                                            "checkpoints or metrics (they are deleted)")


@dataclass(frozen=True)
class LoggingArgs:
    _argument_group_name = "logging"

    logging_steps: int = arg(1, "print a line of step metrics every N steps (0: never; metrics.jsonl has every step)",
                             "log_every")
    task_loss_every: int = advanced(10, "log the mean token loss of every task (from the last stage's per-sample losses) "
                                   "every N steps (0: never)")
    report_to: str = arg("none", "experiment trackers, comma-separated (a config file may give a list): "
                                 "tensorboard, wandb (offline unless WANDB_MODE says otherwise), all or none")
    log_level: Literal[LOG_LEVELS] = advanced("info", "log level of rank 0 (other ranks log warnings and errors)")
    timeline: bool = advanced(True, "write the last step's measured timeline next to its simulated twin "
                               "(Chrome trace + PNG)")


@dataclass(frozen=True)
class EvalArgs:
    _argument_group_name = "evaluation"

    eval_mixture: str | None = arg(None, "mixture spec (.yaml/.json/.toml) of the evaluation data")
    eval_holdout: float = arg(0.0, "instead of --eval-mixture: this fraction of every task's rows is held out of "
                                   "training for evaluation")
    eval_steps: int = arg(0, "evaluate every N steps and at the end (0: only at the end when eval data is given)",
                          "eval_every")
    eval_samples: int | None = advanced(None, "evaluation rows per task at most (default: every row of the evaluation "
                                         "set, each once per evaluation; a cap takes the same rows every time)")
    generate_every: int = advanced(1, "generation metrics (exact match, ROUGE-L) every K evaluations (0: only at the end)")
    generation_max_new_tokens: int = advanced(32, "tokens generate() may add per sample for the generation metrics")


SECTIONS = (ModelArgs, DataArgs, BatchingArgs, PipelineArgs, OptimArgs, CheckpointArgs, LoggingArgs, EvalArgs)
"""Every section, in ``--help`` order; :class:`~dynabatch.training.config.TrainConfig` inherits them all."""
