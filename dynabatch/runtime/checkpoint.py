"""Resumable checkpoints: per-rank shards written atomically, a manifest that marks completion.

Layout of ``OUTPUT/checkpoints/step-000120/``:

* ``rank-00003.pt``: this rank's stage weights, optimizer, LR scheduler and RNG states (written
  by every rank to a temp file in the same folder, fsynced, then ``os.replace``d: a crash while
  saving leaves either the old file or none, never half of one);
* ``manifest.json``: written last, by rank 0, after every rank reported its shard's size and
  SHA-256 (collected with ``all_gather_object``). It also holds the data position (global batcher
  state) and the run's config, so a resumed run reads the same next samples.

A checkpoint counts only when its manifest exists and every shard matches its recorded size and
checksum; :func:`latest_checkpoint` returns the newest such one, so a crash during a save falls back
to the previous checkpoint. Shards load with ``torch.load(weights_only=True)``: only tensors and
plain containers, never pickled code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk."""

    path: str
    step: int
    manifest: dict[str, Any]


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(path: str, write) -> None:
    """Call ``write(file_object)`` on a temp file next to ``path``, fsync, then rename over ``path``."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_shard(root: str, step: int, rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """Write one rank's shard atomically; returns ``{"file", "bytes", "sha256"}`` for the manifest."""
    folder = step_dir(root, step)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, shard_name(rank))
    atomic_write(path, lambda f: torch.save(state, f))
    return {"file": shard_name(rank), "bytes": os.path.getsize(path), "sha256": _sha256(path)}


def write_manifest(root: str, step: int, shards: list[dict[str, Any]], extra: dict[str, Any]) -> str:
    """Write the manifest (rank 0, after all shards): the checkpoint is complete from this moment."""
    manifest = {"format_version": FORMAT_VERSION, "step": step, "shards": shards, **extra}
    path = os.path.join(step_dir(root, step), MANIFEST)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
    atomic_write(path, lambda f: f.write(data))
    return path


def verify(path: str) -> CheckpointInfo:
    """Check a checkpoint folder; raises :class:`CheckpointError` saying what is wrong."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (the save did not finish)")
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable manifest ({e})") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {manifest.get('format_version')}; this dynabatch reads {FORMAT_VERSION}"
        )
    for shard in manifest["shards"]:
        spath = os.path.join(path, shard["file"])
        if not os.path.exists(spath):
            raise CheckpointError(f"checkpoint {path}: shard {shard['file']} is missing")
        size = os.path.getsize(spath)
        if size != shard["bytes"] or _sha256(spath) != shard["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: shard {shard['file']} is corrupt or truncated "
                f"({size} bytes, manifest says {shard['bytes']}; checksum mismatch)"
            )
    return CheckpointInfo(path=path, step=int(manifest["step"]), manifest=manifest)


def list_checkpoints(root: str) -> list[str]:
    """Checkpoint folders under ``root``, oldest first (complete or not)."""
    if not os.path.isdir(root):
        return []
    steps = sorted((int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name)))
    return [os.path.join(root, name) for _, name in steps]


def latest_checkpoint(root: str, fallback: bool = True) -> CheckpointInfo | None:
    """The newest complete, verified checkpoint; with ``fallback`` a broken newest one is skipped
    (a warning names it), otherwise its :class:`CheckpointError` is raised."""
    import warnings

    for path in reversed(list_checkpoints(root)):
        try:
            return verify(path)
        except CheckpointError as e:
            if not fallback:
                raise
            warnings.warn(f"skipping broken checkpoint: {e}", stacklevel=2)
    return None


def load_shard(info: CheckpointInfo, rank: int, map_location="cpu") -> dict[str, Any]:
    """This rank's shard of a verified checkpoint (``torch.load(weights_only=True)``)."""
    path = os.path.join(info.path, shard_name(rank))
    if not os.path.exists(path):
        raise CheckpointError(
            f"checkpoint {info.path} has no shard for rank {rank}: it was written by "
            f"{len(info.manifest['shards'])} ranks; resume with the same stages x replicas"
        )
    return torch.load(path, map_location=map_location, weights_only=True)


def prune(root: str, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (incomplete older ones too)."""
    paths = list_checkpoints(root)
    complete = [p for p in paths if os.path.exists(os.path.join(p, MANIFEST))]
    keep_set = set(complete[-keep:]) if keep > 0 else set()
    newest = paths[-1] if paths else None
    for p in paths:
        if p not in keep_set and p != newest:
            shutil.rmtree(p, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    """Torch CPU (and CUDA) RNG state as tensors (loadable with ``weights_only=True``)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
