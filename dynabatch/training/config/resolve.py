"""One resolver: every ``auto`` of a :class:`~dynabatch.training.config.TrainConfig` decided in one place, with a reason.

:func:`resolve` takes the configuration and what the run finds (:class:`Found`: CUDA or not, the model's sequence
kind, the world size, the device memory) and returns a :class:`Resolved`: the configuration with no ``auto`` left and
one short reason per decided field. Each field that can say ``auto`` has one rule in :data:`RULES` (a registry:
``@rule("name")``); the rules run in registry order, each on the configuration resolved so far. Components take the
resolved values; code that may still be handed an unresolved configuration (a test, a caller of a runtime
function) asks :func:`decide` for one field, so the same rule answers there too.

Every command and API goes through these rules: ``train`` (:func:`resolve` of its TrainConfig), ``bench`` (the
TrainConfig of each method, :func:`resolve`), ``plan``, ``simulate``, ``profile`` and ``data-report``
(:func:`resolve_args` on the parsed flags: the rules of the fields the command takes, with ``train``'s defaults
for the fields it lacks), :class:`~dynabatch.integrations.dataloader.DynaBatchDataLoader` (its ``hardware``:
:func:`decide` with what the process finds).

Some ``auto`` choices are searches the run makes as it goes (the schedule policy per step, recomputation per
micro-batch, row packing per step, the attention kernel per call): ``auto`` resolves to the search's own name
(:data:`SEARCHES`), which the lower layers know as ``auto`` (:func:`lower`). ``--placement auto`` with two or more
stages is chosen at start from the run's first global batches (:mod:`dynabatch.training.run_layout`, rules in
:mod:`dynabatch.training.config.placement_choice`); the run records that choice with :meth:`Resolved.with_choice`.
The rules, with their reasons, are the table of docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from dynabatch.training.config.sections import PLAN_COSTS_AUTO, SEARCHES, SECTIONS
from dynabatch.core.allocator import KEPT_RESIDENT_FACTOR
from dynabatch.core.methods import DYNAMIC
from dynabatch.data.tokenize import resolve_tokenizer


@dataclass(frozen=True)
class Found:
    """What a run finds before it decides (``None``: not known where the resolver runs, e.g. ``plan``)."""

    cuda_available: bool | None = None
    """``torch.cuda.is_available()`` where the run starts."""
    sequence_kind: str | None = None
    """``seq2seq`` or ``causal``: the model family's (:func:`dynabatch.models.families.check_model`)."""
    world_size: int = 1
    memory_gib: float | None = None
    """The device's memory, when known (``--memory-gib`` is what the planner may use)."""
    cuda_devices: int | None = None
    """``torch.cuda.device_count()``, where a rule needs it (``profile``'s p2p sweep needs two devices)."""
    host_memory_gib: float | None = None
    """The machine's physical memory (:func:`dynabatch.core.allocator.host_memory_gib`), where a rule needs it."""

    @property
    def device_type(self) -> str | None:
        return None if self.cuda_available is None else "cuda" if self.cuda_available else "cpu"


Rule = Callable[[Any, Found], "tuple[Any, str] | None"]
RULES: dict[str, Rule] = {}
"""Field name -> its rule: ``rule(cfg, found)`` gives ``(value, reason)`` for a value to decide, ``None`` for a value
given as is. Registry order is resolution order (later rules read earlier decisions)."""


BY_METHOD = ("recompute",)
"""Fields whose ``auto`` the rules decide by the training method (a baseline recomputes nothing): a
``--compare-method`` run resolves them afresh for its own method, whatever the first run was given or resolved (a
rerun of ``OUTPUT/config.yaml`` gives them resolved)."""


def rule(name: str):
    """Register the rule of field ``name`` (once)."""
    def register(fn: Rule) -> Rule:
        if name in RULES:
            raise ValueError(f"the rule of {name} is registered twice")
        RULES[name] = fn
        return fn
    return register


def _device_type(cfg, found: Found) -> str | None:
    if cfg.device == "auto":
        return found.device_type
    return "cpu" if cfg.device == "cpu" else "cuda"


@rule("device")
def _device(cfg, found: Found):
    if cfg.device != "auto" or found.cuda_available is None:
        return None
    if found.cuda_available:
        return "cuda", "CUDA is available: each rank takes cuda:LOCAL_RANK"
    return "cpu", "no CUDA device"


@rule("hardware")
def _hardware(cfg, found: Found):
    """The analytic hardware preset of :class:`~dynabatch.integrations.dataloader.DynaBatchDataLoader` (``plan`` and
    ``simulate`` name theirs: a paper-scale preset, no ``auto``)."""
    if getattr(cfg, "hardware", None) != "auto" or found.cuda_available is None:
        return None
    if found.cuda_available:
        return "cuda", "CUDA is available: the preset of the CUDA device's name, with its memory"
    return "cpu", "no CUDA device: the cpu preset"


@rule("clock")
def _clock(cfg, found: Found):
    """``profile``'s timer (:func:`dynabatch.cost.measure.resolve_clock` checks a given one)."""
    if getattr(cfg, "clock", None) != "auto" or (kind := _device_type(cfg, found)) is None:
        return None
    if kind == "cpu" and getattr(cfg, "threads", None) in (None, 1):
        return "thread_cpu", "CPU, one thread: this thread's CPU time, which other processes cannot inflate"
    return "wall", "CUDA or several threads: the wall clock"


@rule("p2p")
def _p2p(cfg, found: Found):
    """``profile``'s point-to-point sweep (:func:`dynabatch.cost.p2p.default_backend` for callers of the API)."""
    if getattr(cfg, "p2p", None) != "auto" or (kind := _device_type(cfg, found)) is None:
        return None
    if kind == "cpu":
        return "gloo", "CPU: gloo"
    if found.cuda_devices is None:
        return None
    if found.cuda_devices >= 2:
        return "nccl", "two or more CUDA devices: nccl"
    return "none", "one CUDA device: no peer to send to"


@rule("tokenizer")
def _tokenizer(cfg, found: Found):
    if cfg.tokenizer != "auto":
        return None
    name = resolve_tokenizer("auto", cfg.model)
    return name, ("the --model folder's own tokenizer" if name == cfg.model else "no --model folder holding a tokenizer")


@rule("attention_kernel")
def _attention_kernel(cfg, found: Found):
    if cfg.attention_kernel != "auto" or (kind := _device_type(cfg, found)) is None:
        return None
    if kind == "cpu":
        return "sdpa", "CPU: sdpa, the kernel with a CPU backward"
    return SEARCHES["attention_kernel"], "CUDA: per call, FlashAttention varlen where it applies, else flex, else sdpa"


@rule("cpu_allocator")
def _cpu_allocator(cfg, found: Found):
    """``keep`` (:func:`dynabatch.core.allocator.freed_tensors_kept`) where a step's large tensors come from the C
    library: on CPU, for an encoder-decoder, whose eager attention materialises ``b h T^2`` scores (measured
    1.13-1.54x at 1,024-4,096 tokens, docs/benchmarks/cpu_allocator/), when the ranks' ``--memory-gib`` times
    :data:`~dynabatch.core.allocator.KEPT_RESIDENT_FACTOR` fit the host; a decoder-only model's SDPA keeps none."""
    if getattr(cfg, "cpu_allocator", "auto") != "auto" or (kind := _device_type(cfg, found)) is None:
        return None
    if kind == "cuda":
        return "system", "CUDA: the tensors live in device memory"
    if found.sequence_kind is None:
        return None
    if found.sequence_kind != "seq2seq":
        return "system", "CPU, decoder-only: SDPA keeps no score tensors; the C library's defaults"
    need = found.world_size * float(cfg.memory_gib) * KEPT_RESIDENT_FACTOR
    if found.host_memory_gib is not None and need > found.host_memory_gib:
        return "system", (f"CPU, encoder-decoder, but {found.world_size} ranks x --memory-gib {cfg.memory_gib:g} x "
                          f"{KEPT_RESIDENT_FACTOR:g} (a kept heap's resident set) = {need:g} GiB is over this machine's "
                          f"{found.host_memory_gib:.1f} GiB")
    return "keep", ("CPU, encoder-decoder: freed memory stays for the next step, whose attention scores would "
                    "otherwise be new pages to fault in")


def _by_cost_profile(name: str, with_profile: tuple[str, str], analytic: tuple[str, str]) -> None:
    """Register the rule of field ``name`` whose ``auto`` depends only on whether a cost profile is given:
    ``(value, reason)`` with one, ``(value, reason)`` with the analytic model."""
    rule(name)(lambda cfg, found: None if getattr(cfg, name) != "auto" else
               with_profile if cfg.cost_profile else analytic)


_by_cost_profile("split_blocks", ("off", "a cost profile times whole blocks only"),
                 ("on", "the analytic cost model prices a block's attention and MLP halves"))
_by_cost_profile("calibrate",
                 ("online", "a cost profile holds this device's measured costs: the online fit only refines them"),
                 ("quick", "the analytic model: a few seconds of start-up measurements, then the online fit"))


@rule("plan_costs")
def _plan_costs(cfg, found: Found):
    if getattr(cfg, "full_determinism", False):  # TrainConfig refuses it with plan_costs scaled or calibrated
        return "base", "--full-determinism: plans from the base model, not from measured times"
    if cfg.plan_costs != "auto" or found.sequence_kind is None:
        return None
    value = PLAN_COSTS_AUTO[found.sequence_kind]
    why = "encoder-decoder: the online fit" if value == "calibrated" else "decoder-only: the base model"
    return value, f"{why} (docs/configuration.md)"


@rule("planner")
def _planner(cfg, found: Found):
    """The process on CUDA (rank 0's loop launches kernels from Python and would wait for a planner thread's GIL), the
    thread on CPU. On CPU the niced process measured better on the main job (docs/benchmarks/main_job/), and
    ``scripts/run.sh`` asks for it; it stays opt-in there because with it a run whose peer rank is stopped (SIGSTOP) does not end within its
    timeout (tests/dist/test_faults.py), which is not yet understood."""
    if cfg.planner != "auto" or (kind := _device_type(cfg, found)) is None:
        return None
    if kind == "cuda":
        return "process", "CUDA: the training loop would wait for a planner thread's GIL"
    return "thread", "CPU: no planner process start-up"


@rule("pack_rows")
def _pack_rows(cfg, found: Found):
    """``device`` (the default) is the search on a CUDA device and ``off`` on CPU and without a device (``plan``,
    ``simulate``), both by measurement: on one H200 the search ran GPT-2 small 1.82x and T5-small 2.63x faster
    than ``off`` (docs/benchmarks/gpu_h200/); on a CPU's runtime ``off`` was as fast or faster, and simulated on the
    analytic presets the search was 0.986-1.020x of ``off`` at 3-6x the planning time (docs/algorithms/planner.md,
    "Row packing in the planner")."""
    if cfg.pack_rows not in ("device", "auto"):
        return None
    if cfg.pack_rows == "auto":
        return SEARCHES["pack_rows"], "per step, plans with and without packed rows; the best scored is kept"
    if (kind := _device_type(cfg, found)) is None:
        return "off", "no device: one sample per row"
    if kind == "cuda":
        return SEARCHES["pack_rows"], "CUDA: per step, plans with and without packed rows, the best kept"
    return "off", "CPU: one sample per row (docs/configuration.md)"


@rule("recompute")
def _recompute(cfg, found: Found):
    if cfg.recompute != "auto":
        return None
    if cfg.cost_profile:
        return "none", "a cost profile does not price recomputation"
    if cfg.method != DYNAMIC:
        return "none", f"{cfg.method} is a baseline: its knob, not recomputation, fits memory"
    return SEARCHES["recompute"], "per micro-batch and stage, the fastest mode that fits --memory-gib"


@rule("policy")
def _policy(cfg, found: Found):
    if cfg.policy != "auto":
        return None
    return SEARCHES["policy"], "per step, the shortest simulated of gpipe, 1f1b and adaptive"


@rule("placement")
def _placement(cfg, found: Found):
    if cfg.placement != "auto":
        return None
    if cfg.stages < 2:
        return "linear", "one stage"
    if cfg.moving_boundaries:
        return "linear", "--moving-boundaries moves the cuts of one chunk per device"
    return None  # chosen at start from the run's first global batches (Resolved.with_choice)


@dataclass(frozen=True)
class Resolved:
    """A configuration with its ``auto`` values decided, and why (field -> reason)."""

    config: Any
    reasons: dict[str, str] = field(default_factory=dict)

    def with_choice(self, name: str, value: Any, reason: str) -> "Resolved":
        """This resolution with ``name`` decided elsewhere (``--placement auto``'s start-up choice)."""
        return Resolved(dataclasses.replace(self.config, **{name: value}), {**self.reasons, name: reason})

    def unresolved(self) -> list[str]:
        """Fields still ``auto`` (or ``device`` for ``pack_rows``)."""
        return [f.name for f in dataclasses.fields(self.config)
                if getattr(self.config, f.name) == "auto" or (f.name == "pack_rows" and self.config.pack_rows == "device")]

    def table(self) -> str:
        """The decided fields as a short table: option, value, why."""
        rows = [(f"--{name.replace('_', '-')}", str(getattr(self.config, name)), why)
                for name, why in self.reasons.items()]
        width = [max(len(r[i]) for r in rows) for i in (0, 1)] if rows else [0, 0]
        return "\n".join(f"  {a.ljust(width[0])}  {b.ljust(width[1])}  {c}" for a, b, c in rows)


def resolve(cfg, found: Found) -> Resolved:
    """``cfg`` with every rule of :data:`RULES` applied in order, and the reason of each decision."""
    reasons = {}
    for name, fn in RULES.items():
        decided = fn(cfg, found)
        if decided is not None:
            value, why = decided
            if value != getattr(cfg, name):
                cfg = dataclasses.replace(cfg, **{name: value})
            reasons[name] = why
    return Resolved(cfg, reasons)


def decide(cfg, name: str, found: Found = Found()) -> Any:
    """The value of field ``name`` that ``cfg`` runs with: its own, or its rule's (for a configuration that did not
    go through :func:`resolve`)."""
    return decide_why(cfg, name, found)[0]


def decide_why(cfg, name: str, found: Found = Found()) -> tuple[Any, str | None]:
    """:func:`decide` and the rule's reason (``None``: the value is ``cfg``'s own)."""
    decided = RULES[name](cfg, found) if name in RULES else None
    return (getattr(cfg, name), None) if decided is None else decided


def args_view(args=None, **values: Any) -> SimpleNamespace:
    """What the rules read of a command's parsed flags ``args`` (or of nothing): ``train``'s default of every
    TrainConfig field, then every flag of ``args``, then ``values``."""
    defaults = {f.name: f.default for s in SECTIONS for f in dataclasses.fields(s)}
    return SimpleNamespace(**{**defaults, **(vars(args) if args is not None else {}), **values})


def resolve_args(args, found: Found = Found()) -> dict[str, tuple[Any, str]]:
    """A command's parsed flags through :data:`RULES`, as :func:`resolve` takes a TrainConfig: every rule runs in
    order on :func:`args_view` (the flags, ``train``'s defaults for the fields the command lacks, each decision
    seen by the later rules); the fields the command takes are set to their decided values (in place). Returns
    ``{field: (value, reason)}`` of those fields, what the command reports as its resolved choices."""
    view = args_view(args)
    decided = {}
    for name, fn in RULES.items():
        choice = fn(view, found)
        if choice is None:
            continue
        setattr(view, name, choice[0])
        if hasattr(args, name):
            setattr(args, name, choice[0])
            decided[name] = choice
    return decided


def describe_choices(decided: dict[str, tuple[Any, str]]) -> str:
    """One line of :func:`resolve_args`' choices: ``resolved: --split-blocks on (why); ...``."""
    return "resolved: " + "; ".join(f"--{name.replace('_', '-')} {value} ({why})"
                                    for name, (value, why) in decided.items())


def lower(name: str, value: Any) -> Any:
    """``value`` of field ``name`` as the lower layers name it: a search (:data:`SEARCHES`) is their ``auto``."""
    return "auto" if SEARCHES.get(name) == value else value


def lower_args(args) -> None:
    """Parsed flags of a command with the search names (``--policy per_step``, as a resolved ``config.yaml`` says)
    in the lower layers' spelling, ``auto`` (in place)."""
    for name in SEARCHES:
        if hasattr(args, name):
            setattr(args, name, lower(name, getattr(args, name)))
