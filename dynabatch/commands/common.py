"""Arguments shared by ``dynabatch plan`` and ``dynabatch simulate``: workload, model, cluster."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, replace

from dynabatch.data.batching import LengthLimits, check_length_limit_value
from dynabatch.training.config.flags import add_fields, add_sections
from dynabatch.training.config import check_cost_profile
from dynabatch.training.config.resolve import Found, args_view, decide, describe_choices, lower, lower_args, resolve_args
from dynabatch.training.config.sections import arg
from dynabatch.commands.scheduled import memory_limit_bytes
from dynabatch.commands.output_files import WRITTEN_BY, check_output_file, profile_file_problem, write_json  # noqa: F401 (re-exported)
from dynabatch.cost.model_specs import PRESETS
from dynabatch.cost.model_states import describe_zero
from dynabatch.data.baselines import BaselineOptions, option_users
from dynabatch.core.methods import COMPARED_METHODS, DYNAMIC_SLICED, METHODS, check_method_family, is_planner, methods_for
from dynabatch.training.cost_model import profiled_layer_model
from dynabatch.training.workload import MODEL_FAMILIES, method_micro_batches
from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.hardware import hardware_spec
from dynabatch.model_presets import PRESETS as RUN_PRESETS, load_config
from dynabatch.models.families import analytic_spec, check_config_limit
from dynabatch.cost.stages import StageCostModel
from dynabatch.cost.layer_split import balanced_layout, placement_layout, rebalanced_layout
from dynabatch.data.builtin import default_mixture_path

DEFAULT_PRESETS = {"t5": "t5-large", "gpt": "gpt-1.3b", "gpt2": "gpt-1.3b", "llama": "llama3-8b"}
"""Analytic preset of each ``--model`` when ``--preset`` is not given."""


def json_arg():
    """``--json [PATH]`` of every command with results: to PATH, or to stdout instead of the table."""
    return arg(None, "write the results as JSON to PATH, or to stdout instead of the table when no PATH is given",
               nargs="?", const="-", metavar="PATH")




@dataclass(frozen=True)
class WorkloadArgs:
    """The flags of ``plan`` and ``simulate`` beyond the TrainConfig fields they share with ``train``."""

    _argument_group_name = "workload"

    lengths: str | None = arg(None, ".npz (input_len, target_len[, task]) or .jsonl lengths file, or a mixture spec "
                                    "(.yaml/.json/.toml); default: the built-in mixture")
    preset: str | None = arg(None, "older spelling of an analytic --model preset (with --model a family)")
    hardware: str = arg("a100-40gb", "hardware preset (a100-40gb, a100-80gb, h100-80gb, h200, cpu)")
    num_batches: int = arg(8, "global batches to plan")
    flash_attention: bool = arg(False, "price attention as fused kernels (flash / varlen / flex, what --attention "
                                       "segments runs on CUDA): no Tq x Tk score tensors kept, the backward "
                                       "recomputes them; default: eager attention, scores kept (long samples need "
                                       "this to fit)")
    methods: str | None = arg(None, f"comma list of {', '.join(COMPARED_METHODS)} (default: all that the model can run; "
                                    "dynamic_sliced and packing_free_split are decoder-only)")
    json: str | None = json_arg()


SHARED_FIELDS = ("model", "tokenizer", "stages", "replicas", "zero", "max_input_len", "max_target_len", "global_batch_tokens", "memory_gib",
                 "recompute", "pack_rows", "layer_split", "split_blocks", "moving_boundaries", "cost_profile",
                 *option_users())
"""The TrainConfig fields ``plan`` and ``simulate`` take (the same flags as ``train``'s, at paper scale)."""
PAPER_SCALE = {"model": "t5", "stages": 4, "max_input_len": 1024, "max_target_len": 256, "global_batch_tokens": 65_536,
               "memory_gib": None}
"""``plan``/``simulate`` defaults: the analytic models of the papers' scale (``train`` trains small models here)."""


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    add_fields(p, SHARED_FIELDS, defaults=PAPER_SCALE, helps={
        "model": f"analytic model preset ({', '.join(sorted(PRESETS))}), a family ({', '.join(MODEL_FAMILIES)}) "
                 "for its default preset (t5-large / gpt-1.3b / llama3-8b), or a model train runs (a model preset "
                 "such as t5-d256, or a local checkpoint folder), priced from its config",
        "memory_gib": "device memory per stage in GiB, model states included (default: the hardware preset's)",
        "replicas": "data-parallel replicas of each stage, which --zero shards the model states across (the plans "
                    "and the simulated pipeline are one replica's, over the whole global batch)",
        "cost_profile": "profile JSON from `dynabatch profile` to price --model (the model preset or folder it "
                        "measured) with its measured costs instead of --hardware's analytic ones (--hardware then "
                        "gives only the default --memory-gib); default: the analytic model",
    })
    add_sections(p, [WorkloadArgs])


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


def compared_methods(text: str | None, family: str, model: str = "", cost_profile: str | None = None) -> list[str]:
    """``--methods`` of ``plan`` and ``simulate``: names of :data:`COMPARED_METHODS`; by default every one a model of
    ``family`` can run, and a decoder-only method named for an encoder-decoder model is one clear error. With a
    ``cost_profile`` :data:`DYNAMIC_SLICED` is left out by default and refused when named: its token slices are
    priced with the analytic model (as ``bench`` leaves it out and ``train`` refuses ``--slice-long``)."""
    valid = tuple(m for m in methods_for(family) if not (cost_profile and m == DYNAMIC_SLICED))
    methods = parse_methods(text, valid if text is None else COMPARED_METHODS)
    for m in methods:
        check_method_family(m, family, model)
        if cost_profile and m == DYNAMIC_SLICED:
            raise ValueError(f"{DYNAMIC_SLICED} prices its token slices with the analytic cost model, and "
                             f"--cost-profile {cost_profile} times whole samples: drop {DYNAMIC_SLICED} from "
                             "--methods, or drop --cost-profile")
    return methods


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """``ValueError`` naming the first ``--flag`` among ``names`` (attribute names) whose value is set and < 1."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_length_flags(args: argparse.Namespace) -> None:
    """``--max-input-len`` and ``--max-target-len`` (when set) under the one rule of every command
    (:func:`dynabatch.data.batching.check_length_limit_value`), before anything loads or launches."""
    for name in ("max_input_len", "max_target_len"):
        value = getattr(args, name, None)
        if value is not None:
            check_length_limit_value(f"--{name.replace('_', '-')}", value)


@dataclass(frozen=True)
class Workload:
    """What the shared arguments resolve to."""

    path: str
    family: str
    limits: LengthLimits
    cost_model: object
    """A StageCostModel over the analytic model, or ``--cost-profile``'s tables (planner and simulator view)."""
    options: BaselineOptions
    split_blocks: bool = True
    """``--split-blocks`` resolved to ``on``: layer splits may cut inside blocks (decoder-only, T5 encoder)."""
    resolved: dict = field(default_factory=dict)
    """``{field: (value, reason)}`` of the flags the resolver decided (:func:`~dynabatch.training.config.resolve.resolve_args`),
    what the command reports under ``resolved``."""


def analytic_model(args: argparse.Namespace) -> AnalyticCostModel:
    """The analytic cost model ``plan`` and ``simulate`` price ``--model`` with on ``--hardware``: an analytic preset
    (a family stands for its default one, :data:`DEFAULT_PRESETS`), or the shape of a model ``train`` runs, a model
    preset (``t5-d256``, ``llama-tiny``, ...) or a local Hugging Face checkpoint folder, read from its config
    (:func:`~dynabatch.models.families.analytic_spec`; no weights load). One ``ValueError`` line otherwise."""
    flash = bool(getattr(args, "flash_attention", False))
    if args.preset is not None and args.model not in DEFAULT_PRESETS:  # else one of the two was dropped unsaid
        raise ValueError(f"--preset {args.preset} names the analytic preset of a family given as --model "
                         f"({', '.join(DEFAULT_PRESETS)}), and --model is {args.model}; pass one model: "
                         f"--model {args.preset} or --model {args.model}")
    name = args.preset or DEFAULT_PRESETS.get(args.model, args.model)
    if name in PRESETS:
        return AnalyticCostModel.from_names(name, args.hardware, flash_attention=flash)
    if args.preset is None and (name in RUN_PRESETS or os.path.isdir(name)):
        return AnalyticCostModel(analytic_spec(run_config(args)), hardware_spec(args.hardware), flash_attention=flash)
    raise ValueError(f"--model {name!r} is neither an analytic preset ({', '.join(sorted(PRESETS))}), a family "
                     f"({', '.join(MODEL_FAMILIES)}), a model preset ({', '.join(RUN_PRESETS)}) nor a model folder "
                     "(config.json); plan and simulate price it analytically")


def run_config(args: argparse.Namespace):
    """The Hugging Face config of ``--model`` given as a model ``train`` runs (a model preset or a local folder),
    checked at its length limit as ``train`` checks it at start (:func:`~dynabatch.models.families.check_config_limit`:
    positions, Mistral's sliding window): one ``ValueError`` line for a model the run could not train."""
    config = load_config(args.model)
    check_config_limit(config, args.max_input_len)
    return config


def layer_model(args: argparse.Namespace):
    """The layer model ``plan`` and ``simulate`` price with: the analytic model (:func:`analytic_model`), or with
    ``--cost-profile`` the profile's measured tables, read as ``train`` reads them
    (:func:`~dynabatch.training.cost_model.profiled_layer_model`: the profile's model config must be ``--model``'s
    and its grid must reach the length limits). One ``ValueError`` line otherwise."""
    if not args.cost_profile:
        return analytic_model(args)
    if (problem := profile_file_problem(args.cost_profile)) is not None:
        raise ValueError(problem)
    if args.flash_attention:
        raise ValueError("--flash-attention chooses how the analytic model prices attention, and a cost profile "
                         "holds measured kernels: drop --flash-attention or --cost-profile")
    if args.preset is not None or not (args.model in RUN_PRESETS or os.path.isdir(args.model)):
        raise ValueError(f"--cost-profile prices the model it measured, given as --model (a model preset such as "
                         f"{next(iter(RUN_PRESETS))}, or a model folder); --model {args.preset or args.model} is an "
                         "analytic preset: pass the profiled model, or drop --cost-profile")
    return profiled_layer_model(args, run_config(args))


def resolve(args: argparse.Namespace) -> Workload:
    """The workload of ``plan``/``simulate``'s flags, their ``auto`` values decided by the resolver's rules (with
    nothing found: these commands price analytic presets, not this machine) and then in the planners' spelling."""

    check_positive(args, "num_batches", "stages", "replicas", "global_batch_tokens", *option_users())
    check_length_flags(args)
    check_cost_profile(args_view(args))  # as given: train's refusals (token slices, block halves, recomputation)
    decided = resolve_args(args, Found())
    lower_args(args)  # the search names (per_step, ...) are the planners' auto
    if getattr(args, "memory_gib", None) is not None and not 0 < args.memory_gib < float("inf"):
        raise ValueError(f"--memory-gib must be a finite number > 0, got {args.memory_gib}")
    model = layer_model(args)
    family = model.tables.family if args.cost_profile else model.spec.family
    if args.preset and args.model in MODEL_FAMILIES and MODEL_FAMILIES[args.model] != family:
        raise ValueError(f"--preset {args.preset} is a {family} model but --model {args.model} is a "
                         f"{MODEL_FAMILIES[args.model]} family; pass --model {args.preset}")
    limits = LengthLimits(family, max_input_len=args.max_input_len, max_target_len=args.max_target_len,
                          max_seq_len=args.max_input_len)
    e_ref = min(args.max_input_len, 512)
    split_blocks = decide(args_view(args), "split_blocks") == "on"  # the flag as resolved (the rule: without it)
    layout = balanced_layout(model, args.stages, ref_shape=(4, e_ref, min(args.max_target_len, 128)),
                             split_blocks=split_blocks)
    memory_gib = getattr(args, "memory_gib", None)
    memory = hardware_spec(args.hardware).memory_bytes if memory_gib is None else memory_gib * 2**30
    cost = StageCostModel(model, layout, memory, recompute=getattr(args, "recompute", "none"),
                          zero=getattr(args, "zero", 0), replicas=getattr(args, "replicas", 1),
                          moving_boundaries=bool(getattr(args, "moving_boundaries", False)))
    if (line := describe_zero(cost.zero, cost.replicas)) is not None:  # as train warns
        print(f"warning: {line}", file=sys.stderr)
    options = BaselineOptions.of(args)
    return Workload(args.lengths or default_mixture_path(), family, limits, cost, options, split_blocks, decided)


def cost_model_json(args: argparse.Namespace) -> str:
    """``--json``'s ``cost_model``: what the times are priced with, ``--cost-profile``'s file or the analytic model
    on ``--hardware``."""
    return f"cost profile {args.cost_profile}" if args.cost_profile else f"analytic, {args.hardware}"


def describe_cost_model(summary: dict) -> str | None:
    """The line ``plan`` and ``simulate`` print when a cost profile prices the run (:func:`cost_model_json`), else
    ``None`` (the analytic model, the default)."""
    if not summary["cost_model"].startswith("cost profile"):
        return None
    return (f"priced with {summary['cost_model']} (measured costs; --hardware {summary['config']['hardware']} "
            "gives only the default memory)")


def num_cell(value: float | None, width: int, digits: int) -> str:
    """``value`` right-aligned in ``width`` with ``digits`` decimals; ``n/a`` for ``None`` (a price off the cost
    profile's grid, :func:`describe_off_grid`)."""
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


OFF_GRID_NOTE = "has micro-batches beyond the cost profile's grid"
"""``--tune-baselines``' note of a knob value that :func:`describe_off_grid` would name (not counted as fitting)."""


def describe_off_grid(methods) -> str | None:
    """The line under ``plan``'s, ``simulate``'s and ``bench``'s tables naming the methods whose micro-batches lie
    beyond the cost profile's grid (priced :data:`~dynabatch.cost.planner_model.UNPRICED`: their predicted fields
    are ``None``, ``n/a`` in the table, and ``priced_off_grid`` is true), and what to do; ``None`` when there are
    none."""
    if not methods:
        return None
    return (f"n/a: {', '.join(methods)} ran micro-batches beyond the cost profile's grid, which it cannot price; "
            "profile with larger --batch-sizes / longer --lengths (dynabatch profile), or leave "
            f"{'it' if len(methods) == 1 else 'them'} out of --methods")


def workload_summary(args: argparse.Namespace, w: Workload, batches) -> dict:
    """The entries of ``plan``'s and ``simulate``'s ``--json`` about the run itself (workload, model, layout, memory,
    global batches, model states, resolved choices, cost model, flags); :func:`print_workload` prints them."""
    return {
        "workload": w.path,
        "model": args.model,
        "layout": w.cost_model.layout.describe(),
        "stages": w.cost_model.num_stages,
        "memory_limit_gib": memory_limit_bytes(w.cost_model) / 2**30,
        "row_limits": w.limits.describe(),
        "global_batches": len(batches),
        "samples": sum(len(b) for b in batches),
        "truncated": sum(b.num_truncated for b in batches),
        "model_states": model_states(w.cost_model),
        "resolved": resolved_json(w),
        "cost_model": cost_model_json(args),
        "config": flags_json(args),
    }


def print_workload(summary: dict) -> None:
    """The lines above ``plan``'s and ``simulate``'s tables (:func:`workload_summary`'s entries)."""
    print(f"{summary['global_batches']} global batches, {summary['samples']} samples ({summary['truncated']} truncated), "
          f"{summary['stages']} stages, reference split: {summary['layout']}; memory limit "
          f"{summary['memory_limit_gib']:.1f} GiB/device; baseline rows up to the longest kept sample "
          f"({summary['row_limits']})")
    print(describe_model_states(summary["model_states"]))
    if (line := describe_cost_model(summary)) is not None:
        print(line)
    if summary["resolved"]:
        print(describe_choices({k: tuple(v) for k, v in summary["resolved"].items()}))


def resolved_json(w: Workload) -> dict:
    """``--json``'s ``resolved``: ``{field: [value, reason]}``."""
    return {name: [value, why] for name, (value, why) in w.resolved.items()}


def model_states(cost_model) -> dict:
    """What ``plan`` and ``simulate`` report of the model states: the ``--zero`` setting, the replicas it shards over,
    each stage's states per device and the activation memory left on the tightest one, GiB."""
    return {"zero": cost_model.zero, "replicas": cost_model.replicas,
            "model_state_gib_per_device": [b / 2**30 for b in cost_model.model_state_bytes],
            "activation_budget_gib": cost_model.memory_budget_bytes / 2**30}


def flags_json(args: argparse.Namespace) -> dict:
    """Every flag of a ``plan`` or ``simulate`` run as parsed (``--json``'s path aside), for its JSON's ``config``, as
    ``bench`` records its own: the hardware preset, the batch size, the length limits and the baseline knobs decide
    every number, and the results alone did not say which were given. An ``auto`` the command decided is recorded
    decided (``--pack-rows off``), so the flags give the same run again."""
    return {k: v for k, v in vars(args).items() if k not in ("json", "argv")}


def compared_baselines(baselines_compared: str) -> str:
    """The words of a ratio line of ``plan`` and ``simulate`` for the baselines the ratio is over (``fitting`` or
    ``none fits``): when no whole-sample baseline fits the memory the ratio is over the best of those that do not,
    which a reader must not take for a feasible setting."""
    return ("whole-sample baselines that fit" if baselines_compared == "fitting" else
            "no whole-sample baseline fits the memory: the best of those that do not")


def dynamic_compared(planners, chosen: str | None) -> str | None:
    """``--json``'s ``dynamic_methods_compared`` of ``plan`` and ``simulate``: ``fitting`` when ``chosen``, the
    faster of the dynamic methods in ``--methods`` (``planners``) that fit the memory, was found; ``none fits`` when
    none of them fits (no dynamic method is chosen and no speedup reported: a plan that does not fit cannot run);
    ``None`` without a dynamic method."""
    if not planners:
        return None
    return "fitting" if chosen is not None else "none fits"


def dynamic_left_out(method: str, methods, error: Exception) -> str | None:
    """The warning ``plan`` and ``simulate`` print when ``dynamic`` cannot plan a batch (a sample that does not fit
    the memory even alone) while ``dynamic_sliced``, which cuts such samples into token slices, is compared too: the
    run goes on without ``dynamic`` (it does not fit, so it is never the one chosen). ``None`` otherwise: the error
    stands."""
    if method != "dynamic" or DYNAMIC_SLICED not in methods:
        return None
    return f"dynamic does not fit the memory and is left out ({DYNAMIC_SLICED} cuts such samples into token slices): {error}"


def describe_dynamic_compared(compared: str | None, planners) -> str | None:
    """The line ``plan`` and ``simulate`` print when no dynamic method of ``planners`` fits (:func:`dynamic_compared`),
    else ``None``."""
    if compared != "none fits":
        return None
    return (f"no dynamic method ({', '.join(planners)}) fits the memory: none is chosen and no speedup over the "
            "baselines is reported; give it more memory (--memory-gib), more stages or shorter length limits")


def describe_model_states(states: dict) -> str:
    """One line of :func:`model_states`."""
    per_stage = "/".join(f"{g:.1f}" for g in states["model_state_gib_per_device"])
    replicas = f"{states['replicas']} replica" + ("s" if states["replicas"] != 1 else "")
    return (f"model states per device (--zero {states['zero']}, {replicas}): {per_stage} GiB by "
            f"stage; {states['activation_budget_gib']:.1f} GiB left for activations")


def split_from_data(w: Workload, batches, method: str = "dynamic") -> Workload:
    """``w`` with its layer split balanced over the micro-batches ``method`` cuts ``batches`` into (planned
    with ``w``'s reference split). A baseline's micro-batches do not depend on the split: one round. The dynamic
    planner's do (it keeps the DP's plan or a baseline's, whichever is predicted faster under the split), so its
    split is balanced again over the plan it makes under the new split, up to
    :data:`~dynabatch.cost.layer_split.SPLIT_ROUNDS` splits, and the
    split whose plans are predicted fastest (``sum(t) + (S - 1) max(t)`` per batch) is kept: balanced over the
    DP's plan, a split can make a baseline's plan the faster one, which the next split then serves better. A
    workload the method cannot plan whole (a sample that does not fit memory) keeps the reference split: its error
    comes where the method runs, with that command's advice."""
    cm = w.cost_model
    planned: dict = {}  # layout -> the method's plans under it (None: cannot plan them)

    def plans(layout):
        if layout not in planned:
            planned[layout] = _plans(replace(w, cost_model=replace(cm, layout=layout)), batches, method)
        return planned[layout]

    def predicted(layout):  # sum(t) + (S - 1) max(t) per batch, summed
        done = plans(layout)
        return None if done is None else sum(float(t.sum() + (cm.num_stages - 1) * t.max())
                                             for t in (p.predicted_times_s for p in done))

    layout = rebalanced_layout(
        cm.layout, lambda lay: None if plans(lay) is None else [(p.shapes, p.pairs) for p in plans(lay)],
        lambda micro: balanced_layout(cm.model, cm.num_stages, micro_batches=micro, split_blocks=w.split_blocks),
        predicted if is_planner(method) else None)
    return w if layout is None else replace(w, cost_model=replace(cm, layout=layout))


def _plans(w: Workload, batches, method: str):
    """``method``'s plan of each batch with ``w``'s cost model (:class:`~dynabatch.training.workload.MethodPlan`
    s); ``None`` when it cannot plan them (the reference shape then decides the split)."""
    cm = w.cost_model
    method = "dynamic" if is_planner(method) else method  # dynamic_sliced: the split of dynamic's whole samples
    try:
        return [method_micro_batches(method, b, w.limits, cm, cm.num_stages, w.options) for b in batches]
    except ValueError:
        return None


def placement_cost_model(w: Workload, batches, method: str, placement):
    """The per-chunk StageCostModel of ``placement`` (:class:`~dynabatch.schedule.placement.Placement`), its
    chunks balanced over ``method``'s micro-batches of ``batches`` (cyclic: the encoder and the decoder each
    cut into one chunk per device; interleaved: the layers cut into devices x V chunks), without
    recomputation."""

    cm = w.cost_model
    plans = _plans(w, batches, method)
    layout = placement_layout(cm.model, placement, None if plans is None else [(p.shapes, p.pairs) for p in plans],
                              split_blocks=w.split_blocks)
    return replace(cm, layout=layout, recompute="none")


def method_recompute(method: str, w) -> str:
    """The recomputation ``method`` runs with under the workload's ``--recompute`` (resolved and lowered: ``auto``
    is the search): the resolver's rule for that method (a baseline's ``auto``: none, its knob fits memory)."""
    view = args_view(recompute=w.cost_model.recompute, method="dynamic" if is_planner(method) else method)
    return lower("recompute", decide(view, "recompute"))
