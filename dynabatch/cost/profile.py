"""Profile every layer kind of a model over a grid of micro-batch shapes and write a versioned JSON.

The sweep builds the real HF layers (``dynabatch.cost.layers``) and measures each kind at every grid
point of its axes (``dynabatch.cost.measure``): forward/backward median time, bytes saved for
backward, peak activation bytes. Points are visited from small to large; a point whose lower grid
neighbour ``prev(b) * max(prev(E), prev(D))`` exceeds ``max_tokens`` is not profiled (``"skipped"``),
so every query with ``b * max(E, D) <= max_tokens`` falls in a cell whose four (eight) corners were
measured. A point that runs out of memory is ``"oom"`` and so is every point that dominates it.
Downstream, a missing corner makes the cell infeasible (``+inf``), never an extrapolation.

Default grid: b in {1, 2, 4, 8, 16, 32}, E in {16, 32, ..., 1024} (x2 steps), D in {4, 16, 64, 256}
(x4: T5 targets are mostly short and the decoder grid is 3-D), ``max_tokens`` 2048 -- so shapes up
to 2048 tokens are guaranteed and the boundary cells reach 8192. Measured on a shared 2-core AMD EPYC
VM, one thread, including the p2p sweep: gpt2-mini 156 points in ~65 s, t5-mini 516 points in
~80 s, t5-tiny ~60 s (the LM head, 8192-word vocabulary, is the most expensive kind). Shorter
lengths are clamped to the first grid value downstream, longer ones need ``--lengths``.

Attention cores (``attention_cores=True``, the default): every block's attention core is profiled as its
own kind as well (:mod:`dynabatch.cost.attention_cores`), and ``model.attention_cores`` maps each block kind
to its core kinds; the tables use them to price per-segment (padding-free) attention.

JSON fields: ``time_s`` per kind is its share of the sweep; ``device.thp_mem_alloc`` records the
``THP_MEM_ALLOC_ENABLE`` variable (see ``dynabatch.commands.profile``); ``p2p.send_min_s`` is the fastest send.

JSON (``format`` = ``dynabatch.profile``, ``version`` = 1)::

    created, profile_time_s, num_threads,
    device {type, name, num_threads, thp_mem_alloc}, versions {torch, transformers, python},
    model {name, family, sequence_kind, analytic_kinds, context_kinds, attention_cores, d_model, dtype,
           dropout, config},
    settings {min_repeats, max_repeats, min_time_s, clock, max_tokens, seed},
    axes {b, E[, D]},
    layers {kind: {dims, num_params, tied_params, time_s,
                   status, fwd_s, bwd_s, stored_bytes, peak_bytes}},   # nested lists over dims
    p2p {backend, sizes_bytes, send_s, send_min_s} | null

``status`` entries are ``"ok"``, ``"skipped"`` (beyond ``max_tokens``) or ``"oom"``; the four metric
arrays hold ``null`` wherever ``status`` is not ``"ok"``.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from dynabatch.core.progress import progress as progress_bar
from dynabatch.cost.grid import ProfileGrid  # noqa: F401 (torch-free: `dynabatch profile --help` needs it)
from dynabatch.cost.attention_cores import add_attention_cores, attention_core_kinds
from dynabatch.cost.layers import KindSpec, ModelLayers, build_layers
from dynabatch.cost.measure import MeasureSettings, measure_step, prepare_params, resolve_clock, settle_cpu_allocator
from dynabatch.core.sequence import is_seq2seq
from dynabatch.cost.p2p import check_backend, default_backend, measure_p2p

FORMAT = "dynabatch.profile"
FORMAT_VERSION = 1


def _point(dims: tuple[str, ...], values: tuple[int, ...]) -> tuple[int, int, int]:
    v = dict(zip(dims, values))
    return v["b"], v.get("E", 0), v.get("D", 0)


def _nested(shape: tuple[int, ...], fill=None) -> list:
    if len(shape) == 1:
        return [fill] * shape[0]
    return [_nested(shape[1:], fill) for _ in range(shape[0])]


def _set(nested: list, index: tuple[int, ...], value) -> None:
    for i in index[:-1]:
        nested = nested[i]
    nested[index[-1]] = value


def _is_oom(exc: BaseException) -> bool:
    oom_types = (MemoryError, getattr(torch, "OutOfMemoryError", getattr(torch.cuda, "OutOfMemoryError", MemoryError)))
    if isinstance(exc, oom_types):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def profile_kind(layers: ModelLayers, kind: KindSpec, grid: ProfileGrid, device: torch.device,
                 settings: MeasureSettings, progress=None) -> dict:
    """Measure one kind on its grid; returns the JSON record of the kind."""
    axes = [grid.axis(d) for d in kind.dims]
    shape = tuple(len(a) for a in axes)
    status = _nested(shape, "skipped")
    metrics = {m: _nested(shape) for m in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes")}
    oom_points: list[tuple[int, ...]] = []
    param_ptrs = layers.param_ptrs
    for index in itertools.product(*(range(n) for n in shape)):
        if not grid.included(kind.dims, index):
            continue
        if progress is not None:
            progress.update(1)
        if any(all(i >= j for i, j in zip(index, o)) for o in oom_points):
            _set(status, index, "oom")
            continue
        values = tuple(a[i] for a, i in zip(axes, index))
        try:
            m = measure_step(layers.makers[kind.name](*_point(kind.dims, values)), param_ptrs, device, settings)
        except Exception as exc:  # noqa: BLE001 - only OOM is recorded, anything else re-raised
            if not _is_oom(exc):
                raise
            oom_points.append(index)
            _set(status, index, "oom")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        _set(status, index, "ok")
        for name in metrics:
            _set(metrics[name], index, getattr(m, name))
    return {"dims": list(kind.dims), "num_params": layers.num_params[kind.name],
            "tied_params": layers.tied_params.get(kind.name, 0), "status": status, **metrics}


def count_points(kinds: tuple[KindSpec, ...], grid: ProfileGrid) -> int:
    """Grid points the sweep will visit (for the progress bar and time estimates)."""
    total = 0
    for kind in kinds:
        shape = [range(len(grid.axis(d))) for d in kind.dims]
        total += sum(grid.included(kind.dims, idx) for idx in itertools.product(*shape))
    return total


def device_description(device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
        except OSError:
            pass
        name = f"{name} ({os.cpu_count()} logical CPUs)"
    return {"type": device.type, "name": name, "num_threads": torch.get_num_threads(),
            "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE")}


def run_profile(model: str, grid: ProfileGrid = ProfileGrid(), settings: MeasureSettings = MeasureSettings(),
                device: str = "cpu", dtype: str = "float32", num_threads: int | None = None, dropout: float = 0.0,
                kinds: tuple[str, ...] | None = None, p2p_backend: str | None = "auto", seed: int = 0,
                show_progress: bool = True, layer_builder: Callable | None = None,
                attention_cores: bool = True, on_start: Callable[[], None] | None = None) -> dict:
    """Profile ``model`` (preset name or local checkpoint) and return the JSON-ready profile dict.

    ``layer_builder`` is the model family's profiler layer builder
    (``dynabatch.models.families.layer_builder(model)``); this module knows no family. ``attention_cores``
    also profiles each block's attention core as its own kind (:mod:`dynabatch.cost.attention_cores`: the
    per-segment term of the tables). Every argument is checked before the first point is measured; ``on_start``
    is called then (``dynabatch profile`` logs its resolved choices there, so a bad argument is its only line).
    """
    if layer_builder is None:
        raise ValueError("run_profile needs the model family's layer_builder "
                         "(dynabatch.models.families.layer_builder(model))")
    dev = torch.device(device)
    backend = default_backend(dev) if p2p_backend == "auto" else p2p_backend
    if backend:
        check_backend(backend)  # now: measured after the layers, a bad backend would cost the whole profile
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"unknown dtype {dtype!r}; valid: float32, bfloat16, float16")
    if dev.type == "cpu":
        settle_cpu_allocator()
    start = time.perf_counter()
    torch.manual_seed(seed)
    layers = build_layers(model, layer_builder, dev, torch_dtype, dropout=dropout, seed=seed)
    if attention_cores:
        layers = add_attention_cores(layers)
    prepare_params(layers.model)
    selected = layers.kinds
    if kinds is not None:
        valid = {k.name for k in layers.kinds}
        unknown = sorted(set(kinds) - valid)
        if unknown:
            raise ValueError(f"unknown layer kinds {unknown}; valid for {layers.family}: {sorted(valid)}")
        selected = tuple(k for k in layers.kinds if k.name in kinds)
    if on_start is not None:
        on_start()
    records = {}
    with progress_bar(total=count_points(selected, grid), desc=f"profile {model}", unit="pt",
              disable=not show_progress) as bar:
        for kind in selected:
            bar.set_postfix_str(kind.name)
            kind_start = time.perf_counter()
            records[kind.name] = profile_kind(layers, kind, grid, dev, settings, bar)
            records[kind.name]["time_s"] = round(time.perf_counter() - kind_start, 3)
    p2p = None
    if backend:
        p2p = asdict(measure_p2p(backend))
    axes = {"b": list(grid.batch_sizes), "E": list(grid.enc_lengths)}
    if is_seq2seq(layers.sequence_kind):
        axes["D"] = list(grid.dec_lengths)
    import transformers

    return {
        "format": FORMAT, "version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "profile_time_s": time.perf_counter() - start,
        "num_threads": torch.get_num_threads(),
        "device": device_description(dev),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": sys.version.split()[0]},
        "model": {"name": model, "family": layers.family, "sequence_kind": layers.sequence_kind,
                  "analytic_kinds": layers.analytic_kinds, "context_kinds": layers.context_kinds,
                  "attention_cores": {block: cores for block, cores in attention_core_kinds(layers).items()
                                      if all(k in records for k in cores.values())},
                  "d_model": layers.model.get_input_embeddings().embedding_dim,
                  "dtype": dtype, "dropout": dropout, "config": layers.model.config.to_dict()},
        "settings": {**asdict(settings), "clock": resolve_clock(settings.clock, dev), "max_tokens": grid.max_tokens,
                     "seed": seed},
        "axes": axes,
        "layers": records,
        "p2p": p2p,
    }


def save_profile(profile: dict, path: str | os.PathLike) -> Path:
    """Write the profile as JSON (NaN-free: missing values are ``null``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1, default=str, allow_nan=False))
    return path
