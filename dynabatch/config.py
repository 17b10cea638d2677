"""Typed configuration of a training run (``dynabatch train``).

A :class:`TrainConfig` comes from defaults, then an optional YAML/JSON file (``--config``), then
command-line flags; every field is a flag (``--global-batch-tokens 8192``). Cross-field checks run in
``__post_init__`` and raise ``ValueError`` with the actual values. The defaults train a small T5 on the
built-in mixture on this CPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from dynabatch.cost.recompute import RECOMPUTE_POLICIES  # ``recompute`` choices, one list for config and cost model
from dynabatch.data.baselines import BASELINES

METHODS = ("dynamic", *BASELINES)
"""``--method``: the dynamic planner or any baseline of :data:`dynabatch.data.baselines.BASELINES`."""
POLICIES = ("gpipe", "1f1b", "adaptive", "auto")
ATTENTION_PATHS = ("segments", "dense")
"""``--attention``: segments (padding-free) or dense (4-D masks); :mod:`dynabatch.models.attention` uses this list."""
PACK_ROWS = ("auto", "off")
"""``--pack-rows``: ``auto`` (plan with and without packed rows, per-segment pricing; keep the best) or ``off``
(one sample per row, dense pricing); :mod:`dynabatch.plan.step` uses this list."""
LR_SCHEDULES = ("constant", "linear", "cosine")
PLAN_COSTS = ("base", "calibrated")
"""``--plan-costs``: plan with the base cost model (default) or with the online fit."""
CALIBRATIONS = ("auto", "quick", "online", "off")
"""``--calibrate``: auto (quick + online without --cost-profile, online with one), quick (start-up measurements, then
online), online (fit the cost model to the measured stage times as the run goes) or off (the base model as is);
:mod:`dynabatch.runtime.calibration` uses this list."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs."""

    model: str = "t5-tiny"
    """Model preset (t5-tiny, t5-mini, t5-small, gpt2-tiny, gpt2-mini, gpt2-small) or a local HF checkpoint dir."""
    tokenizer: str = "builtin"
    """builtin | gpt2 | byt5 | a local tokenizer dir."""
    mixture: str | None = None
    """Mixture spec (.yaml/.json); default: the built-in offline mixture."""
    stages: int = 1
    """Pipeline stages per replica."""
    replicas: int = 1
    """Data-parallel replicas; the world size must be stages x replicas."""
    method: str = "dynamic"
    """Batching: dynamic (the planner) or a baseline batcher."""
    policy: str = "auto"
    """Pipeline schedule: gpipe, 1f1b, adaptive or auto (best simulated per step)."""
    global_batch_tokens: int = 8192
    """Real tokens (inputs + targets) per optimizer step."""
    max_input_len: int = 512
    """T5 encoder limit; GPT sequence limit (inputs + targets)."""
    max_target_len: int = 128
    """T5 decoder limit."""
    overlong: str = "truncate"
    """Over-long samples: truncate, drop or error."""
    samples_per_micro_batch: int = 8
    """padding / length_grouped baselines."""
    token_budget_tokens: int = 2048
    """token_budget baseline: padded tokens per micro-batch."""
    packing_rows: int = 4
    """packing baseline (dense rows of the max length): rows per micro-batch."""
    packing_free_rows: int = 4
    """packing_free baseline (TRL's bfd + padding_free): rows per micro-batch."""
    memory_gib: float = 4.0
    """Device memory per rank the planner may use (activations + model states)."""
    recompute: str = "auto"
    """Activation recomputation: auto (per micro-batch and stage, the fastest of none / selective / full that fits memory: none wherever memory does not bind), none, selective (attention cores) or full (every block) for all."""
    cost_profile: str | None = None
    """profile JSON from `dynabatch profile` to plan with measured costs; default: the analytic model."""
    calibrate: str = "auto"
    """Fit the planner's stage times to what the run measures: auto (quick + online; online only with cost_profile), quick (a few seconds of start-up measurements, then online), online or off."""
    plan_costs: str = "base"
    """What the planner decides with when calibrating: base (the analytic preset or cost_profile; the fit only predicts, by the measurement in the README's "Online calibration") or calibrated (the online fit)."""
    calibration_file: str | None = None
    """Warm start from the calibration.json an earlier run on the same device, model and layout wrote."""
    max_micro_batch_samples: int = 64
    """Upper bound on samples per planned micro-batch (keeps CPU micro-batches cache-friendly)."""
    slice_long: bool = False
    """GPT, dynamic: cut samples that dominate the pipeline bubble or do not fit memory into token slices (TeraPipe)."""
    pack_rows: str = "off"
    """dynamic: auto = also plan with several short samples per row (padding-free pricing) and keep the best plan; off = one sample per row (default, by the measurement in the README's "Row packing in the planner"). Only with attention=segments."""
    attention: str = "segments"
    """Attention kernel: segments (padding-free: per-sample SDPA, nothing computed across samples or on pad) or dense (4-D block-diagonal masks, the reference)."""
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 5
    lr_schedule: str = "linear"
    """constant | linear (decay to 0 at ``steps``) | cosine."""
    max_grad_norm: float = 1.0
    dropout: float = 0.0
    steps: int = 20
    """Optimizer steps to train (in total, counting resumed ones)."""
    seed: int = 0
    output_dir: str = "runs/train"
    resume: bool = False
    """Continue from the newest complete checkpoint in ``output_dir/checkpoints``."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = 2
    plan_ahead: int = 2
    """Steps the background planner prepares ahead of training."""
    log_every: int = 1
    task_loss_every: int = 10
    """Log the mean token loss of every task (from the last stage's per-sample losses) every N steps (0: never)."""
    timeout_s: float = 120.0
    """Seconds before a silent peer counts as dead (each step's transfers and collectives)."""
    startup_timeout_s: float = 3600.0
    """Seconds the other ranks wait for rank 0 to load and tokenize the data and plan the first step."""
    max_bad_steps: int = 3
    """Stop the run after this many steps in a row with a non-finite loss or gradient norm (each is skipped)."""
    overwrite_output_dir: bool = False
    """Start a fresh run in an output folder that holds another run's checkpoints or metrics (they are deleted)."""
    bad_rows: str | None = None
    """Malformed rows: error or skip (drop and count); default: the mixture spec's ``bad_rows`` (error)."""
    threads: int = 1
    """torch intra-op threads per rank (the cost profile's setting)."""
    compare_method: str | None = None
    """Also train ``steps`` steps with this method from the same start and report the speed ratio."""
    timeline: bool = True
    """Write the last step's measured timeline next to its simulated twin (Chrome trace + PNG)."""

    @property
    def calibration_mode(self) -> str:
        """``calibrate`` with ``auto`` resolved: ``quick`` without a cost profile, ``online`` with one."""
        if self.calibrate != "auto":
            return self.calibrate
        return "online" if self.cost_profile else "quick"

    @property
    def attention_path(self) -> str:
        """The attention path this run uses (``packing``, the dense-mask baseline, always ``dense``)."""
        from dynabatch.data.baselines import attention_for

        return attention_for(self.method, self.attention)

    def __post_init__(self) -> None:
        _choice("method", self.method, METHODS)
        _choice("policy", self.policy, POLICIES)
        _choice("attention", self.attention, ATTENTION_PATHS)
        _choice("pack_rows", self.pack_rows, PACK_ROWS)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _choice("calibrate", self.calibrate, CALIBRATIONS)
        _choice("plan_costs", self.plan_costs, PLAN_COSTS)
        _choice("recompute", self.recompute, RECOMPUTE_POLICIES)
        _choice("overlong", self.overlong, ("truncate", "drop", "error"))
        if self.compare_method is not None:
            _choice("compare_method", self.compare_method, METHODS)
        _check_types(self)
        for name in _AT_LEAST_ONE:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in _NON_NEGATIVE:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.bad_rows is not None:
            _choice("bad_rows", self.bad_rows, ("error", "skip"))
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("timeout_s", "startup_timeout_s"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be at least 1 second, got {getattr(self, name)}")
        if self.global_batch_tokens < self.max_input_len + self.max_target_len:
            raise ValueError(
                f"global_batch_tokens={self.global_batch_tokens} cannot hold one maximal sample "
                f"(max_input_len {self.max_input_len} + max_target_len {self.max_target_len}); raise it"
            )
        if self.slice_long and self.method != "dynamic":
            raise ValueError(f"slice_long plans token slices with the dynamic planner; got method {self.method!r}")
        if self.slice_long and self.cost_profile:
            raise ValueError("slice_long prices slices with the analytic cost model; drop cost_profile or slice_long")
        if not self.lr > 0 or self.max_grad_norm <= 0 or self.memory_gib <= 0:
            raise ValueError(
                f"lr, max_grad_norm and memory_gib must be > 0, got {self.lr}, {self.max_grad_norm}, {self.memory_gib}"
            )

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_AT_LEAST_ONE = ("stages", "replicas", "steps", "global_batch_tokens", "threads", "plan_ahead", "max_input_len",
                 "max_target_len", "samples_per_micro_batch", "token_budget_tokens", "packing_rows",
                 "packing_free_rows", "max_micro_batch_samples", "keep_checkpoints", "max_bad_steps")
_NON_NEGATIVE = ("seed", "warmup_steps", "checkpoint_every", "log_every", "task_loss_every", "weight_decay")

FIXED_ON_RESUME = ("model", "tokenizer", "mixture", "stages", "replicas", "global_batch_tokens", "max_input_len",
                   "max_target_len", "overlong", "bad_rows", "seed", "dropout")
"""Fields a ``--resume`` may not change: they decide the model, the data stream or the world shape (an
error names the old and new values). Every other field may change and the change is logged; ``lr`` and
``weight_decay`` then replace the values restored with the optimizer state."""


def _annotation_types(annotation: str) -> tuple[type, ...] | None:
    """The Python types a field annotation (a string under ``from __future__ import annotations``) admits."""
    kinds = {"int": int, "float": float, "str": str, "bool": bool}
    parts = [p.strip() for p in annotation.split("|")]
    types_ = tuple(kinds[p] for p in parts if p in kinds)
    return types_ or None


def _number_type(annotation: str) -> type | None:
    """``float`` or ``int`` for a numeric field annotation (float wins), else ``None``."""
    types_ = _annotation_types(annotation) or ()
    return float if float in types_ else int if int in types_ else None


def _check_types(cfg: "TrainConfig") -> None:
    """Every field holds a value of its declared type (ints are accepted for floats); floats are finite."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        allowed = _annotation_types(str(f.type))
        if allowed is None or (value is None and "None" in str(f.type)):
            continue
        ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
        if not ok and float in allowed and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(cfg, f.name, float(value))
            value, ok = float(value), True
        if not ok:
            want = " or ".join(t.__name__ for t in allowed)
            raise ValueError(f"{f.name} must be {want}, got {value!r} ({type(value).__name__})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number, got {value}")


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(options)}; got {value!r}")


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per field (``--global-batch-tokens``), all defaulting to 'not given'."""
    p.add_argument("--config", default=None, help="YAML/JSON file with TrainConfig fields")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        doc = _field_doc(f.name)
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=doc)
        else:
            p.add_argument(flag, dest=f.name, default=None, type=_parser(f), help=doc, choices=_CHOICES.get(f.name))


_CHOICES = {"method": METHODS, "compare_method": METHODS}
"""Flags whose argparse choices come from a registry (their values are checked again in ``__post_init__``)."""


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = {}
    from_file = load_config_file(args.config) if args.config else {}
    values.update(from_file)
    for f in dataclasses.fields(TrainConfig):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
            from_file.pop(f.name, None)
    try:
        return TrainConfig(**values)
    except ValueError as e:  # name the file when the offending field came from it
        if any(str(e).startswith(f"{name} ") for name in from_file):
            raise ValueError(f"config file {args.config}: {e}") from None
        raise


def load_config_file(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"config file {path!r} not found")
    if os.path.isdir(path):
        raise ValueError(f"config file {path!r} is a folder; pass a YAML or JSON file of TrainConfig fields")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"config file {path}: YAML syntax error{where}: {getattr(e, 'problem', None) or e}") from None
    else:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path}: JSON syntax error at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path} must hold a mapping of TrainConfig fields, got {type(raw).__name__}")
    raw = {k: _coerce(path, k, v) for k, v in raw.items()}
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"{path}: unknown config keys {sorted(unknown)}; valid: {sorted(known)}")
    return raw


def _coerce(path: str, name: str, value: Any) -> Any:
    """YAML 1.1 reads ``lr: 3e-4`` as a string: turn numeric strings into the field's number type."""
    number = next((_number_type(str(f.type)) for f in dataclasses.fields(TrainConfig) if f.name == name), None)
    if isinstance(value, str) and number is not None:
        try:
            return number(value)
        except ValueError:
            raise ValueError(f"config file {path}: {name} must be a number, got {value!r}") from None
    return value


def _parser(f: dataclasses.Field):
    return _number_type(str(f.type)) or str


_DOCS: dict[str, str] = {}


def _field_doc(name: str) -> str:
    """The docstring under a field (parsed once from this module's source)."""
    if not _DOCS:
        import ast
        import inspect
        import sys

        tree = ast.parse(inspect.getsource(sys.modules[__name__]))
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
        body = cls.body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(getattr(b, "value", None), ast.Constant):
                _DOCS[a.target.id] = str(b.value.value).split("\n")[0]
    return _DOCS.get(name, "")
