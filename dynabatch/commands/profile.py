"""``dynabatch profile``: profile per-layer time and memory on this device, or check a profile.

    dynabatch profile --model gpt2-mini                 # -> runs/profiles/gpt2-mini.cpu.json
    dynabatch profile --check runs/profiles/gpt2-mini.cpu.json --num-shapes 20

Defaults on CPU: one intra-op thread (one pipeline rank per core; timing by thread CPU time, which
other processes on the box cannot inflate), ``THP_MEM_ALLOC_ENABLE=1`` (torch backs tensors >= 2 MiB
with transparent huge pages: without it every tensor over glibc's 32 MiB mmap threshold page-faults
on each use, which made the LM head's time per token jump by ~60 % at 1024 tokens for an 8192 vocab
and cost a few % of model-level accuracy; training processes should set the same variable), the grid
of ``ProfileGrid`` and the p2p sweep over gloo. ``--check`` sets the variable as the profile recorded.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

from dynabatch.commands.common import check_positive
from dynabatch.commands.output_files import check_output_file
from dynabatch.training.config.flags import add_fields, add_sections
from dynabatch.training.config.resolve import Found, describe_choices, resolve_args
from dynabatch.training.config.sections import DTYPE_TORCH_NAMES, arg
from dynabatch.cost.grid import AXIS_RULE, ProfileGrid, check_axis
from dynabatch.model_presets import FAMILY_PRESETS
from dynabatch.cost.tables import FORMAT, CostTables
from dynabatch.data.user_files import is_user_file

logger = logging.getLogger(__name__)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated integers, got {text!r}") from None


def _axis(text: str, flag: str) -> tuple[int, ...]:
    """One grid axis flag: comma-separated integers holding :data:`~dynabatch.cost.grid.AXIS_RULE`."""
    axis = _ints(text, flag)
    check_axis(axis, flag)
    return axis


def _check_not_a_lengths_file(text: str) -> None:
    """``--seq-lengths``' older name is ``--lengths``, which in ``plan``, ``simulate``, ``bench`` and ``data-report``
    names a lengths file: a file given here is one line that says what the flag takes, rather than that a path is
    not an integer under a flag the user did not type."""
    if os.path.isfile(text) or text.endswith((".npz", ".jsonl")) or is_user_file(text):
        raise ValueError(f"--seq-lengths (also spelled --lengths) takes the grid's sequence lengths as a comma list, "
                         f"e.g. 16,64,256, got the file {text!r}: profile times layers on a grid and reads no lengths "
                         "file (plan, simulate and bench --lengths do)")


def _grid(args) -> ProfileGrid:
    """The grid of ``--batch-sizes``, ``--seq-lengths``, ``--dec-lengths`` and ``--max-tokens``; a bad value is one
    line naming its flag."""
    _check_not_a_lengths_file(args.seq_lengths)
    axes = [_axis(text, flag) for text, flag in ((args.batch_sizes, "--batch-sizes"),
                                                 (args.seq_lengths, "--seq-lengths"), (args.dec_lengths, "--dec-lengths"))]
    smallest = axes[0][0] * axes[1][0]
    if args.max_tokens < smallest:
        raise ValueError(f"--max-tokens {args.max_tokens} is below the smallest grid point ({axes[0][0]} x "
                         f"{axes[1][0]} = {smallest} tokens); raise it")
    return ProfileGrid(*axes, args.max_tokens)


def _check_settings(args) -> None:
    """``--min-repeats``, ``--max-repeats``, ``--min-time`` and ``--threads``, each error one line naming its flag
    (the profile's own checks in :class:`~dynabatch.cost.measure.MeasureSettings` name the fields)."""
    check_positive(args, "min_repeats", "threads")
    if args.max_repeats < args.min_repeats:
        raise ValueError(f"--max-repeats {args.max_repeats} is below --min-repeats {args.min_repeats}; raise it")
    if not args.min_time >= 0:
        raise ValueError(f"--min-time must be a number of seconds >= 0, got {args.min_time}")


def _count_ok(status) -> int:
    return sum(_count_ok(s) for s in status) if isinstance(status, list) else int(status == "ok")


def _grid_default(name: str) -> str:
    return ",".join(map(str, getattr(ProfileGrid(), name)))


@dataclass(frozen=True)
class ProfileArgs:
    """``profile``'s own flags (model, device, dtype, threads, dropout and seed are ``train``'s)."""

    _argument_group_name = "profile"

    out: str | None = arg(None, "output JSON (default runs/profiles/<model>.<device>.json; a --model folder: its name)")
    batch_sizes: str = arg(_grid_default("batch_sizes"), f"b axis of the grid (comma list, {AXIS_RULE})")
    seq_lengths: str = arg(_grid_default("enc_lengths"), f"sequence / encoder length axis (comma list, {AXIS_RULE})",
                           "lengths")
    dec_lengths: str = arg(_grid_default("dec_lengths"), f"T5 decoder length axis (comma list, {AXIS_RULE})")
    max_tokens: int = arg(ProfileGrid.max_tokens, "profile points whose lower neighbour has b*max(E,D) <= this")
    kinds: str | None = arg(None, "comma-separated layer kinds to profile (default: all of the model)")
    min_repeats: int = arg(3, "timed repeats per point at least")
    max_repeats: int = arg(30, "timed repeats per point at most")
    min_time: float = arg(0.03, "seconds of timing per point at least")
    clock: Literal["auto", "wall", "thread_cpu"] = arg("auto", "timer: wall clock, this thread's CPU time, or auto "
                                                               "(thread CPU time on CPU)")
    p2p: Literal["auto", "gloo", "nccl", "none"] = arg("auto", "p2p backend: auto (gloo on CPU, nccl with two CUDA "
                                                               "devices), gloo, nccl or none")
    check: str | None = arg(None, "calibration check of an existing profile instead; or, given a `dynabatch train` "
                                  "output folder, its predicted against measured step and stage times from "
                                  "metrics.jsonl", metavar="PROFILE_OR_RUN_DIR")
    num_shapes: int = arg(20, "--check: random off-grid shapes")
    model_only: bool = arg(False, "--check: skip the per-layer comparison")
    thp: bool = arg(True, "CPU: set THP_MEM_ALLOC_ENABLE=1 (huge pages for tensors >= 2 MiB) for the profile; "
                          "--no-thp does not")
    progress: bool = arg(True, "show a progress bar (--no-progress: none)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, ("model", "device", "dtype", "threads", "dropout", "seed"),
               defaults={"model": "gpt2-mini", "threads": None}, helps={
                   "threads": "torch intra-op threads (default: 1 on CPU, unchanged on CUDA); recorded in the profile"})
    add_sections(parser, [ProfileArgs])


def _set_thp(value: str | None) -> None:
    """Set THP_MEM_ALLOC_ENABLE before torch is imported (torch reads it once, at its first allocation)."""
    if value is not None and "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", value)


def _check_run(run_dir: str) -> int:
    """``--check RUN_DIR``: predicted against measured per step and stage, from the run's metrics.jsonl."""
    import json

    from dynabatch.training.metrics import format_prediction_report  # lazy: imports torch, which must load after _set_thp

    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--check {run_dir}: cannot read {path} ({e}); pass a `dynabatch train` output folder") from e
    records = [r for r in records if "prediction_error" in r]
    if not records:
        raise ValueError(f"--check {run_dir}: {path} has no predicted-vs-measured records (written by `dynabatch "
                         "train` since the online calibration); train again to get them")
    print(format_prediction_report(records))
    return 0


def _check(args) -> int:
    if args.num_shapes < 1:
        raise ValueError(f"--num-shapes must be >= 1, got {args.num_shapes}")
    if os.path.isdir(args.check):
        return _check_run(args.check)
    tables = CostTables.load(args.check)
    _set_thp((tables.meta.get("device") or {}).get("thp_mem_alloc"))
    args.device, decided = _device(args)
    _log_choices(decided)
    from dynabatch.cost.calibrate import (  # lazy: imports torch, which must load after _set_thp
        format_summary, run_check, summarize)
    from dynabatch.models.families import layer_builder  # lazy: imports torch, which must load after _set_thp

    meta = tables.meta
    print(f"profile {args.check}: {meta['model']['name']} on {meta['device']['name']}, "
          f"{meta['num_threads']} thread(s), clock {meta['settings'].get('clock')}")
    start = time.perf_counter()
    rows = run_check(tables, layer_builder(tables.meta["model"]["name"]), args.num_shapes, args.seed, layers=not args.model_only, device=args.device,
                     progress=args.progress)
    print(format_summary(summarize(rows)))
    print(f"{len(rows)} comparisons on {args.num_shapes} shapes in {time.perf_counter() - start:.1f} s "
          "(relative error |pred - meas| / meas; time = forward + backward)")
    return 0


def _device(args) -> tuple[str, dict]:
    """``--device``, ``--clock`` and ``--p2p`` as the resolver decides them (``auto``: cuda when available; thread
    CPU time on one CPU thread, else the wall clock; gloo on CPU, nccl with two CUDA devices:
    :mod:`dynabatch.training.config.resolve`), then the device of this process (``cuda``: ``cuda:0``), and the resolver's
    choices; after :func:`_set_thp`, as it imports torch."""
    import torch

    from dynabatch.engine.dist import resolve_device  # lazy: imports torch, which must load after _set_thp

    cuda = torch.cuda.is_available()
    decided = resolve_args(args, Found(cuda_available=cuda, cuda_devices=torch.cuda.device_count() if cuda else 0))
    return str(resolve_device(args.device)[1]), decided


def _log_choices(decided: dict) -> None:
    if decided:
        logger.info(describe_choices(decided))


def default_out(model: str, device: str) -> str:
    """Where a profile goes without ``--out``: ``runs/profiles/<model>.<device>.json``, ``<model>`` a preset's name or
    a local model folder's own name (``./models/my-gpt/`` -> ``my-gpt``: the whole path made a hidden
    ``._models_my-gpt_`` file, and an absolute path another name for the same folder)."""
    name = os.path.basename(os.path.abspath(model)) if os.path.isdir(model) else model.replace("/", "_")
    return f"runs/profiles/{name}.{device.replace(':', '')}.json"


def run(args) -> int:
    args.model = FAMILY_PRESETS.get(args.model, args.model)
    if args.check:
        return _check(args)
    grid = _grid(args)  # every flag checked before torch loads and anything is profiled: a bad one is the only line
    _check_settings(args)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip()) if args.kinds else None
    if args.device in ("cpu", "auto") and args.thp:
        _set_thp("1")  # before torch is imported (it only affects host memory, so also harmless on CUDA)
    args.device, decided = _device(args)
    from dynabatch.cost.measure import MeasureSettings  # lazy: imports torch, which must load after _set_thp
    from dynabatch.cost.profile import run_profile, save_profile  # lazy: imports torch, which must load after _set_thp
    from dynabatch.models.families import layer_builder  # lazy: imports torch, which must load after _set_thp

    threads = args.threads if args.threads is not None else (1 if args.device == "cpu" else None)
    settings = MeasureSettings(args.min_repeats, args.max_repeats, args.min_time, args.clock)
    out = args.out or default_out(args.model, args.device)
    check_output_file(out, "--out", ours=lambda obj: obj.get("format") == FORMAT, command="profile")  # replaces a profile only
    p2p = None if args.p2p == "none" else args.p2p
    # a bad kind or model is a ValueError before the first point: the CLI prints it as its one error line
    profile = run_profile(args.model, grid, settings, device=args.device, dtype=DTYPE_TORCH_NAMES[args.dtype],
                          num_threads=threads, dropout=args.dropout, kinds=kinds, p2p_backend=p2p, seed=args.seed,
                          show_progress=args.progress, layer_builder=layer_builder(args.model),
                          on_start=lambda: _log_choices(decided))
    path = save_profile(profile, out)
    summary = {k: _count_ok(v["status"]) for k, v in profile["layers"].items()}
    logger.info(f"wrote {path}: {sum(summary.values())} points over {len(summary)} layer kinds in "
                f"{profile['profile_time_s']:.1f} s on {profile['device']['name']} with {profile['num_threads']} thread(s)")
    if profile["p2p"]:
        p = profile["p2p"]
        sizes = zip(p["sizes_bytes"], p["send_s"])
        logger.info(f"p2p {p['backend']} one-way: " + ", ".join(f"{n} B {t * 1e6:.0f} us" for n, t in sizes))
    return 0
