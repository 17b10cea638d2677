"""Arguments shared by ``dynabatch plan`` and ``dynabatch simulate``: workload, model, cluster."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dynabatch.cost.recompute import RECOMPUTE_POLICIES
from dynabatch.data.batching import LengthLimits
from dynabatch.data.baselines import BASELINES, BaselineOptions, option_users
from dynabatch.workload import METHODS, MODEL_FAMILIES

DEFAULT_PRESETS = {"t5": "t5-large", "gpt": "gpt-1.3b", "gpt2": "gpt-1.3b", "llama": "llama3-8b"}
"""Analytic preset of each ``--model`` when ``--preset`` is not given."""


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default=None,
                   help=".npz (input_len, target_len[, task]) or .jsonl lengths file, or a mixture spec (.yaml/.json); "
                        "default: the built-in mixture")
    p.add_argument("--model", default="t5", choices=sorted(MODEL_FAMILIES), help="model family")
    p.add_argument("--preset", default=None,
                   help="analytic model preset (default: t5-large / gpt-1.3b / llama3-8b); see "
                        "dynabatch.cost.model_specs.PRESETS (llama3-8b, qwen2.5-7b, mistral-7b, ...)")
    p.add_argument("--hardware", default="a100-40gb", help="hardware preset (a100-40gb, a100-80gb, h100-80gb, h200, cpu)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="device memory per stage in GiB, model states included (default: the hardware preset's)")
    p.add_argument("--recompute", default="auto", choices=RECOMPUTE_POLICIES,
                   help="activation recomputation: auto (per micro-batch and stage, the fastest mode that fits memory), "
                        "none, selective (attention cores) or full (every block) everywhere")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages")
    p.add_argument("--max-input-len", type=int, default=1024, help="T5 encoder limit; GPT sequence limit")
    p.add_argument("--max-target-len", type=int, default=256, help="T5 decoder limit")
    p.add_argument("--global-batch-tokens", type=int, default=65_536, help="real tokens per global batch")
    p.add_argument("--num-batches", type=int, default=8, help="global batches to plan")
    p.add_argument("--methods", default=None, help=f"comma list of {', '.join(METHODS)} (default: all)")
    add_baseline_arguments(p)
    p.add_argument("--tokenizer", default="builtin", help="tokenizer for mixture specs")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def add_baseline_arguments(p: argparse.ArgumentParser, defaults: BaselineOptions = BaselineOptions()) -> None:
    """One flag per :class:`BaselineOptions` field (``--packing-rows``), its help from the registry."""
    for option, names in option_users().items():
        p.add_argument("--" + option.replace("_", "-"), type=int, default=getattr(defaults, option),
                       help=f"{' / '.join(names)} baseline: {BASELINES[names[0]].help}")


def parse_methods(text: str | None, valid: tuple[str, ...]) -> list[str]:
    """``--methods``: a comma list of names from ``valid`` (``None``: all of them, in registry order)."""
    if text is None:
        return list(valid)
    methods = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    for m in methods:
        if m not in valid:
            raise ValueError(f"unknown method {m!r}; valid: {', '.join(valid)}")
    if not methods:
        raise ValueError(f"--methods needs at least one of {', '.join(valid)}")
    return methods


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """``ValueError`` naming the first ``--flag`` among ``names`` (attribute names) whose value is set and < 1."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


@dataclass(frozen=True)
class Workload:
    """What the shared arguments resolve to."""

    path: str
    family: str
    limits: LengthLimits
    cost_model: object
    """A StageCostModel over the analytic model (planner and simulator view)."""
    options: BaselineOptions


def resolve(args: argparse.Namespace) -> Workload:
    from dynabatch.cost.analytic import AnalyticCostModel
    from dynabatch.cost.stages import StageCostModel, balanced_layout
    from dynabatch.data.report import default_mixture_path

    check_positive(args, "num_batches", "stages", "global_batch_tokens", *option_users())
    if getattr(args, "memory_gib", None) is not None and not 0 < args.memory_gib < float("inf"):
        raise ValueError(f"--memory-gib must be a finite number > 0, got {args.memory_gib}")
    family = MODEL_FAMILIES[args.model]
    limits = LengthLimits(family, max_input_len=args.max_input_len, max_target_len=args.max_target_len,
                          max_seq_len=args.max_input_len)
    preset = args.preset or DEFAULT_PRESETS[args.model]
    model = AnalyticCostModel.from_names(preset, args.hardware)
    if model.spec.family != family:
        raise ValueError(f"preset {preset!r} is a {model.spec.family} model but --model is {args.model}")
    e_ref = min(args.max_input_len, 512)
    layout = balanced_layout(model, args.stages, ref_shape=(4, e_ref, min(args.max_target_len, 128)))
    memory_gib = getattr(args, "memory_gib", None)
    memory = model.hardware.memory_bytes if memory_gib is None else memory_gib * 2**30
    cost = StageCostModel(model, layout, memory, recompute=getattr(args, "recompute", "none"))
    options = BaselineOptions.of(args)
    return Workload(args.lengths or default_mixture_path(), family, limits, cost, options)
