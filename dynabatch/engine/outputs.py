"""The run's output folder: never start over another run's files, never lose them.

A training run writes a known set of entries into ``--output-dir`` (:data:`RUN_ENTRIES`). Before
anything is loaded, rank 0 inspects the folder (:func:`output_dir_problem`):

* a path that is a file, or a folder it cannot create or write into, is an error naming it;
* a fresh run (no ``--resume-from-checkpoint``) into a folder that holds anything at all is refused, naming what it
  found and pointing at ``--resume-from-checkpoint`` (continue that run) and ``--overwrite-output-dir``; nothing in
  the folder is touched;
* with ``--overwrite-output-dir`` the entries a dynabatch run writes are deleted first (the
  checkpoints, metrics, summary, timelines, tracker logs and compare runs of the earlier run); anything else in the
  folder is left alone.

Rank 0 decides and broadcasts the outcome, so every rank raises the same one-line ``ValueError``
(:func:`prepare_output_dir`). On ``--resume-from-checkpoint``, :func:`truncate_metrics` drops the records of steps the
earlier run logged after its last checkpoint, so ``metrics.jsonl`` holds every step exactly once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "timeline.json", "timeline.png",
               "timeline_measured.png", "timeline_simulated.png", "runs", "wandb")
"""What a training run writes into its output folder (plus ``compare-<method>/`` folders)."""


def _is_run_entry(name: str) -> bool:
    return name in RUN_ENTRIES or name.startswith("compare-")


def output_dir_problem(path: str, *, resume: bool, overwrite: bool) -> str | None:
    """Why a run may not use ``path`` (one line), or ``None``; with ``overwrite`` deletes the earlier
    run's entries. Creates the folder if it does not exist."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--output-dir {path!r} is a file, not a folder; pass a folder path"
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"--output-dir {path!r} is not writable ({e.strerror or e}); pass a folder you can write to"
    found = sorted(os.listdir(path))
    if not found or resume:
        return None
    if not overwrite:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        return (f"--output-dir {path!r} is not empty (it holds {shown}); pass --resume-from-checkpoint to continue the run that "
                "wrote it, --overwrite-output-dir to replace that run's files, or another --output-dir")
    for name in found:
        if _is_run_entry(name):
            target = os.path.join(path, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            else:
                os.remove(target)
    return None


def prepare_output_dir(output_dir: str, ctx, resume: str | bool | None = None, overwrite: bool = False) -> None:
    """Collective: rank 0 checks (and with ``overwrite`` clears) ``output_dir`` and every rank raises the same
    ``ValueError`` if the run may not start there (``resume``: the checkpoint the run resumes from, if any)."""
    import torch.distributed as dist

    problem = [None]
    if ctx.is_planner:
        problem[0] = output_dir_problem(output_dir, resume=resume, overwrite=overwrite)
    if ctx.world_size > 1:
        dist.broadcast_object_list(problem, src=0, group=ctx.delivery_group)
    if problem[0] is not None:
        raise ValueError(problem[0])


def truncate_metrics(path: str, start: int) -> None:
    """Keep only the records of steps before ``start`` in the JSONL file at ``path`` (rewritten atomically)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                if json.loads(line).get("step", start) < start:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except ValueError:  # a torn last line from a crash
                continue
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
