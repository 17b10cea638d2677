"""Typed configuration of a training run (``dynabatch train``).

A :class:`TrainConfig` holds every section of :mod:`dynabatch.training.config.sections` (model, data, batching,
pipeline, optim, checkpoint, logging, evaluation) as one flat, frozen dataclass: ``cfg.learning_rate``, and
``cfg.section(OptimArgs)`` for one section alone. It comes from defaults, then an optional YAML/JSON/TOML file
(``--config``, flat or nested by section), then command-line flags (:mod:`dynabatch.training.config.flags`). Older
field names (``lr``, ``steps``, ``checkpoint_every``, ...) are accepted everywhere a config is read.
Cross-field checks run in ``__post_init__`` and raise ``ValueError`` with the actual values. The
defaults train a small T5 on the built-in mixture on this CPU machine.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from dynabatch.training.config.sections import (  # noqa: F401 (the registries are imported from here)
    ATTENTION_KERNELS,
    ATTENTION_PATHS,
    BAD_ROWS,
    CALIBRATIONS,
    DTYPES,
    LOG_LEVELS,
    LR_SCHEDULES,
    METHODS,
    OVERLONG,
    PACK_ROWS,
    PLAN_COST_CHOICES,
    PLAN_COSTS,
    PLAN_COSTS_AUTO,
    POLICIES,
    RECOMPUTE_POLICIES,
    SECTIONS,
    TRACKERS,
    BatchingArgs,
    CheckpointArgs,
    DataArgs,
    EvalArgs,
    LoggingArgs,
    ModelArgs,
    OptimArgs,
    PipelineArgs,
)
from dynabatch.core.devices import check_device_name
from dynabatch.data.baselines import attention_for
from dynabatch.data.batching import check_length_limit_value
from dynabatch.data.inputs import COLUMNS_WITHOUT_DATA, parse_columns
from dynabatch.training.config.placement_choice import check_placement


@dataclass(frozen=True)
class TrainConfig(ModelArgs, DataArgs, BatchingArgs, PipelineArgs, OptimArgs, CheckpointArgs, LoggingArgs, EvalArgs):
    """Everything a training run needs: every field of every section."""

    @classmethod
    def of(cls, **values: Any) -> "TrainConfig":
        """A config from flat values under current or older names (``lr=3e-4``, ``steps=10``, ``resume=True``)."""
        values = canonical(values)
        unknown = sorted(set(values) - set(field_types()))
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}; valid: {sorted(field_types())}")
        return cls(**values)

    def section(self, kind: type):
        """The section ``kind`` (e.g. :class:`OptimArgs`) of this config."""
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    def sections(self) -> dict[str, dict[str, Any]]:
        """The config nested by section (``{"optim": {"learning_rate": ...}, ...}``), as ``--config`` files hold it."""
        return {s._argument_group_name: dataclasses.asdict(self.section(s)) for s in SECTIONS}

    @property
    def calibration_mode(self) -> str:
        """``calibrate`` as the resolver decides it (:mod:`dynabatch.training.config.resolve`: ``auto`` is ``quick`` without a
        cost profile, ``online`` with one)."""
        return decide(self, "calibrate")

    @property
    def cuts_inside_blocks(self) -> bool:
        """``split_blocks`` as the resolver decides it: ``auto`` cuts inside blocks unless a cost profile prices the
        layers (it times whole blocks only)."""
        return decide(self, "split_blocks") == "on"

    @property
    def attention_path(self) -> str:
        """The attention path this run uses (``packing``, the dense-mask baseline, always ``dense``)."""
        return attention_for(self.method, self.attention)

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __post_init__(self) -> None:
        object.__setattr__(self, "report_to", _trackers_text(self.report_to))
        _check_types(self)
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in _NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_input_len", "max_target_len"):  # the rule of every command (dynabatch.data.batching)
            check_length_limit_value(f"--{name.replace('_', '-')}", getattr(self, name))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.eval_samples is not None and self.eval_samples < 1:
            raise ValueError(f"eval_samples must be >= 1 (or unset: every row), got {self.eval_samples}")
        if not 0.0 <= self.eval_holdout < 1.0:
            raise ValueError(f"eval_holdout must be in [0, 1), got {self.eval_holdout}")
        trackers = [t.strip() for t in self.report_to.split(",") if t.strip()]
        for t in trackers:
            if t not in (*TRACKERS, "all", "none"):
                raise ValueError(f"report_to: unknown tracker {t!r}; valid: {', '.join(TRACKERS)}, all, none")
        if self.placement not in ("linear", "auto"):  # auto keeps to the placements the other flags allow
            check_placement(self.placement, self.stages)  # a malformed placement is a ValueError naming the forms
        if self.eval_mixture and self.eval_holdout:
            raise ValueError("give eval_mixture or eval_holdout, not both")
        if self.mixture and self.data:
            raise ValueError(f"give mixture or data, not both (got {self.mixture!r} and {self.data!r})")
        if self.columns:  # malformed --columns text is one line before anything loads
            parse_columns(self.columns)
            if self.mixture:
                raise ValueError(COLUMNS_WITHOUT_DATA)
        if self.device != "auto":
            check_device_name(self.device)
        for name in ("timeout_s", "startup_timeout_s"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be at least 1 second, got {getattr(self, name)}")
        if self.global_batch_tokens < self.max_input_len:  # the trainer checks the model's whole sample
            raise ValueError(
                f"global_batch_tokens={self.global_batch_tokens} cannot hold one maximal sample "
                f"(max_input_len {self.max_input_len}: a T5 input, or a decoder-only model's whole sequence); raise it"
            )
        if self.pack_rows in ("auto", "flat") and self.method == "dynamic" and self.attention == "dense":
            raise ValueError(f"--pack-rows {self.pack_rows} puts several samples in a padding-free row; it needs "
                             "--attention segments (got dense): drop --pack-rows or use --attention segments")
        if self.slice_long and self.method != "dynamic":
            raise ValueError(f"slice_long plans token slices with the dynamic planner; got method {self.method!r}")
        check_cost_profile(self)
        if self.calibration_file and self.calibrate == "off":  # else never read, not even checked to exist
            raise ValueError(f"calibration_file {self.calibration_file!r} warm-starts the online calibration, which "
                             "calibrate off turns off: drop --calibration-file, or --calibrate off")
        if self.full_determinism and self.plan_costs in ("scaled", "calibrated"):
            raise ValueError(f"full_determinism plans with costs that do not depend on measured times; plan_costs "
                             f"{self.plan_costs!r} follows the online fit: pass --plan-costs base (or auto) with "
                             "--full-determinism, or drop --full-determinism")
        if self.moving_boundaries and self.zero:
            raise ValueError(f"moving_boundaries holds the units beside each cut on both stages, which --zero "
                             f"{self.zero} does not shard yet: use --zero 0 or drop --moving-boundaries")
        if self.moving_boundaries and self.placement not in ("linear", "auto"):
            raise ValueError(f"moving_boundaries moves the cuts of a linear layout; placement {self.placement!r} has "
                             "several chunks per device: use --placement linear or drop --moving-boundaries")
        if self.zero not in (0, 1, 2):
            raise ValueError(f"zero {self.zero}: use --zero 0 (no sharding), 1 (optimizer states) or 2 (gradients too)")
        for name in ("learning_rate", "memory_gib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name, flag, does in (("eval_steps", "--eval-steps", "evaluates on"), ("eval_samples", "--eval-samples", "caps")):
            value = getattr(self, name)
            if value and not (self.eval_mixture or self.eval_holdout):  # else ignored without a word
                raise ValueError(f"{name} {value} {does} evaluation data, and none is given: pass "
                                 f"--eval-mixture SPEC or --eval-holdout FRACTION, or drop {flag}")
        if not 0 <= self.max_grad_norm < float("inf"):
            raise ValueError(f"max_grad_norm must be >= 0 and finite (0: no clipping), got {self.max_grad_norm}")


def check_cost_profile(cfg) -> None:
    """The settings a ``cost_profile`` cannot price, each refused with one ``ValueError`` line: token slices
    (priced with the analytic model), block halves (a profile times whole blocks) and an explicit activation
    recomputation (a profile does not price it). ``cfg``: a :class:`TrainConfig`, or a command's parsed flags with
    these fields as given (``plan`` and ``simulate``, before their ``auto`` values are decided)."""
    if not cfg.cost_profile:
        return
    if cfg.slice_long:
        raise ValueError("slice_long prices slices with the analytic cost model; drop cost_profile or slice_long")
    if cfg.split_blocks == "on":
        raise ValueError("split_blocks on cuts inside blocks, which a profile does not price (it times whole "
                         "blocks); drop cost_profile or use split_blocks auto")
    if cfg.recompute not in ("auto", "none"):  # a resolved file gives per_micro_batch
        raise ValueError(f"recompute {cfg.recompute} needs a cost model that prices recomputation, and a cost "
                         "profile does not: pass --recompute none (or auto) with --cost-profile, or drop "
                         "--cost-profile")


_AT_LEAST_ONE = ("stages", "replicas", "max_steps", "global_batch_tokens", "threads", "plan_ahead",
                 "samples_per_micro_batch", "token_budget_tokens", "packing_rows",
                 "packing_free_rows", "packing_free_split_tokens", "max_micro_batch_samples", "save_total_limit", "max_bad_steps",
                 "generation_max_new_tokens")
_NON_NEGATIVE = ("seed", "warmup_steps", "save_steps", "logging_steps", "task_loss_every", "weight_decay",
                 "eval_steps", "generate_every")

FIXED_ON_RESUME = ("model", "tokenizer", "mixture", "data", "columns", "global_batch_tokens",
                   "max_input_len", "max_target_len", "overlong", "bad_rows", "seed", "dropout", "eval_holdout")
"""Fields a resume may not change: they decide the model or the data stream (an error names the old and
new values). Every other field may change and the change is logged (``stages`` and ``replicas`` too:
checkpoints are reshardable, :mod:`dynabatch.training.reshard`);
``learning_rate`` and ``weight_decay`` then replace the values restored with the optimizer state."""


@cache
def field_types() -> dict[str, Any]:
    """Every TrainConfig field's resolved annotation (``typing.get_type_hints``)."""
    return typing.get_type_hints(TrainConfig)


@cache
def old_names() -> dict[str, str]:
    """Older field names (a field's ``aliases`` metadata: ``--lr``) -> the field they name now."""
    out = {}
    for f in dataclasses.fields(TrainConfig):
        for flag in f.metadata.get("aliases", ()):
            out[flag.lstrip("-").replace("-", "_")] = f.name
    return out


def canonical(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` under current field names: older names renamed, ``resume: true/false`` (the older on/off
    switch) as ``resume_from_checkpoint: latest/None``. Unknown names stay (the constructor names them)."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        new = old_names().get(name, name)
        if new == "resume_from_checkpoint" and isinstance(value, bool):
            value = "latest" if value else None
        if new in out:
            older = name if new != name else next(k for k in values if old_names().get(k) == new)
            raise ValueError(f"{older} is an older name of {new}; give one of them")
        out[new] = value
    return out


def _allowed(hint: Any) -> tuple[tuple[type, ...], tuple | None, bool]:
    """(Python types, Literal choices or None, None allowed) of one field annotation."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    optional = type(None) in args
    args = tuple(a for a in args if a is not type(None))
    choices = next((typing.get_args(a) for a in args if typing.get_origin(a) is Literal), None)
    types_ = (str,) if choices is not None else tuple(a for a in args if isinstance(a, type))
    return types_, choices, optional


def _trackers_text(report_to: Any) -> Any:
    """``report_to`` as comma-separated text: a list of tracker names (as Hugging Face's ``TrainingArguments``
    takes it, e.g. ``report_to: [tensorboard]`` in a config file) is joined, an empty list is ``none``; names are
    taken in lower case (``TensorBoard`` is ``tensorboard``); anything else is left for the type check."""
    if isinstance(report_to, str):
        return ",".join(t.strip().lower() for t in report_to.split(","))
    if not isinstance(report_to, (list, tuple)):
        return report_to
    bad = [t for t in report_to if not isinstance(t, str) or "," in t]
    if bad:
        raise ValueError(f"report_to: a list holds tracker names ({', '.join(TRACKERS)}, all, none), got {bad[0]!r}")
    return ",".join(t.strip().lower() for t in report_to) or "none"


def _check_types(cfg: TrainConfig) -> None:
    """Every field holds a value of its declared type (ints are accepted for floats), one of its ``Literal``
    choices where it has them; floats are finite."""
    for name, hint in field_types().items():
        value = getattr(cfg, name)
        allowed, choices, optional = _allowed(hint)
        if value is None and optional:
            continue
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok and float in allowed and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(cfg, name, float(value))
            value, ok = float(value), True
        if not ok:
            want = " or ".join(t.__name__ for t in allowed)
            raise ValueError(f"{name} must be {want}, got {value!r} ({type(value).__name__})")
        if choices is not None and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")


from dynabatch.training.config.flags import add_config_arguments, config_from_args, load_config_file  # noqa: E402,F401
from dynabatch.training.config.resolve import Found, Resolved, decide, lower, resolve  # noqa: E402,F401
