"""Reshardable checkpoint contents: each rank's stage state under the global model's names, through DCP.

A pipeline stage (:func:`~dynabatch.models.split.build_stage`) holds layers of one global model, and
``stage.parameter_map`` names each of its parameters by the original model's (canonical) name, e.g.
GPT-2's tied ``lm_head`` on the last stage is ``transformer.wte.weight`` like the first stage's input
embedding. :func:`stage_state` keys one rank's state by those names:

* ``model/NAME``: the weight;
* ``optim/STATE/NAME``: its optimizer state (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``);
* ``rng/RANK/DEVICE``: the rank's RNG state (``cpu``, ``cuda``).

:func:`dcp_writer` saves it with ``torch.distributed.checkpoint`` through its safetensors storage
(``HuggingFaceStorageWriter``, one file per rank that has something to write): DCP's save planner
deduplicates names several ranks hold (tied copies on the first and last stage, every replica's copy of
a stage), so each tensor is written once. Copies of one name hold equal values (their gradients are
summed or all-reduced before identical AdamW steps), so any copy serves. Reading
(``HuggingFaceStorageReader``) builds DCP's metadata from the safetensors headers, never from a pickle,
and each rank loads exactly the names its own stage holds from whichever files hold them
(:func:`load_stage_state`); any layout loads any other's checkpoint, and the tied copies of a resumed
layout get the one saved weight and its moments. :func:`model_weights` reads every weight (export).

RNG states belong to ranks and are restored only when the world shape is unchanged. Training draws no
random number from the global RNG states: dropout is seeded per (step, micro-batch, rank) from
``--seed`` (the executor's ``dropout_seed``), so with dropout 0 (the default) a resumed run with another
layout continues exactly as an uninterrupted one, and with dropout > 0 it draws the masks an
uninterrupted run of the new layout would draw (not the old layout's).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader, HuggingFaceStorageWriter

from dynabatch.engine.checkpoint import CheckpointError, rng_state, set_rng_state

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"


def _global_names(stage: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) of every stage parameter, each name once. Several parameters may share a name
    only as tied copies on one rank's chunks (:class:`~dynabatch.models.split.DeviceChunks`), which hold equal
    values: the first stands for them (:func:`_copies` lists the others)."""
    out: dict[str, torch.nn.Parameter] = {}
    for local, p in stage.named_parameters():
        name = stage.parameter_map[local]
        if name in out and not local.startswith("chunks."):
            raise ValueError(f"stage parameters share the global name {name!r}")
        out.setdefault(name, p)
    return list(out.items())


def _copies(stage: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """``(first, other)`` for every further tied copy of a name on ``stage`` (see :func:`_global_names`)."""
    first = dict(_global_names(stage))
    return [(first[stage.parameter_map[local]], p) for local, p in stage.named_parameters()
            if first[stage.parameter_map[local]] is not p]


def stage_state(stage: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, zero=None) -> dict[str, torch.Tensor]:
    """This rank's checkpoint tensors (CPU copies where the stage is on an accelerator), by global name. With ``zero``
    (a :class:`~dynabatch.engine.zero.ZeroShards`: ``optimizer`` steps flat shards) the moments are first gathered
    into per-parameter tensors, a collective over the stage's replicas."""
    out: dict[str, torch.Tensor] = {}
    states = zero.full_state(optimizer) if zero is not None else optimizer.state
    for name, p in _global_names(stage):
        out[MODEL + name] = p.detach().cpu()
        for key, value in states.get(p, {}).items():
            out[f"{OPTIM}{key}/{name}"] = torch.as_tensor(value).detach().cpu()
    for device, state in rng_state().items():
        out[f"{RNG}{rank}/{device}"] = state
    return out


def dcp_writer(group: dist.ProcessGroup | None) -> Callable[[str, dict[str, Any]], None]:
    """``write(folder, state)`` for :func:`~dynabatch.engine.checkpoint.save_collective`: DCP's collective
    save over ``group`` (``None``: this process alone). An ``OSError`` of this rank is raised as such; one
    of another rank only there (this rank's part is written); any other failure on every rank."""
    rank = dist.get_rank(group) if group is not None else 0

    def write(folder: str, state: dict[str, Any]) -> None:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
                dcp.save(state, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True),
                         process_group=group, no_dist=group is None)
        except CheckpointException as e:
            failures = e.failures
            if any(isinstance(failure[0], KeyboardInterrupt) for failure in failures.values()):
                raise KeyboardInterrupt from e  # Ctrl-C during a save: the run's one interrupted line, not DCP's report
            if not all(isinstance(failure[0], OSError) for failure in failures.values()):
                raise
            if rank in failures:
                raise failures[rank][0] from e

    return write


def _metadata(folder: str) -> dict[str, Any]:
    """Name -> DCP tensor metadata (size, dtype) of every tensor in checkpoint ``folder``."""
    return HuggingFaceStorageReader(folder).read_metadata().state_dict_metadata


def _load(folder: str, targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` (name -> tensor of the saved size) from ``folder``; this process alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(folder), no_dist=True)


def _missing(folder: str, names: list[str]) -> CheckpointError:
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return CheckpointError(f"checkpoint {folder} holds no weights for parameters {shown} of this model; it was "
                           "written for another model: pass a checkpoint of this model")


def load_stage_state(folder: str, stage: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int | None,
                     zero=None) -> None:
    """Load the weights and optimizer states of ``stage``'s parameters from checkpoint ``folder`` (any
    layout, any ``--zero``), in place; with ``rank`` also that rank's RNG state (same world shape only). With ``zero``
    (a :class:`~dynabatch.engine.zero.ZeroShards`) this rank keeps its slice of the per-parameter states."""
    meta = _metadata(folder)
    params = _global_names(stage)
    missing = [name for name, _ in params if MODEL + name not in meta]
    if missing:
        raise _missing(folder, missing)
    wrong = [f"{name} {tuple(meta[MODEL + name].size)} (this model {tuple(p.shape)})"
             for name, p in params if tuple(meta[MODEL + name].size) != tuple(p.shape)]
    if wrong:
        raise CheckpointError(f"checkpoint {folder} holds parameters of other shapes: {'; '.join(wrong[:3])}; "
                              "pass a checkpoint of this model")
    targets: dict[str, torch.Tensor] = {MODEL + name: p.detach() for name, p in params}
    device_of = {name: p.device for name, p in params}
    states: dict[str, dict[str, torch.Tensor]] = {}
    for key, m in meta.items():
        state, _, name = key[len(OPTIM):].partition("/")
        if key.startswith(OPTIM) and name in device_of:  # moments next to their parameter, step counts on the CPU
            device = device_of[name] if len(m.size) else "cpu"
            states.setdefault(name, {})[state] = targets[key] = torch.empty(m.size, dtype=m.properties.dtype,
                                                                             device=device)
    rng = {key.split("/")[2]: key for key in meta if rank is not None and key.startswith(f"{RNG}{rank}/")}
    for key in rng.values():
        targets[key] = torch.empty(meta[key].size, dtype=meta[key].properties.dtype)
    _load(folder, targets)
    by_param = {p: states[name] for name, p in params if name in states}
    for first, other in _copies(stage):  # tied copies on this rank's other chunks: the same weight and moments
        with torch.no_grad():
            other.copy_(first)
        if first in by_param:
            by_param[other] = {k: v.clone() for k, v in by_param[first].items()}
    if zero is not None:
        zero.load_full_state(optimizer, by_param)
    else:
        optimizer.state.update(by_param)
    if rng:
        set_rng_state({device: targets[key] for device, key in rng.items()})


def model_weights(folder: str) -> dict[str, torch.Tensor]:
    """Every weight of checkpoint ``folder`` by its global (Hugging Face) name, on the CPU."""
    meta = _metadata(folder)
    targets = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in meta.items() if key.startswith(MODEL)}
    _load(folder, targets)
    return {key[len(MODEL):]: t for key, t in targets.items()}
