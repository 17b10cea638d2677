"""Resumable checkpoints: per-rank shards written atomically, a manifest that marks completion.

Layout of ``OUTPUT/checkpoints/step-000120/`` (format 2):

* ``*.safetensors``: the tensors of every rank's stage keyed by the *global* model's names (weights,
  AdamW moments and step counts, each rank's RNG state), written collectively through
  ``torch.distributed.checkpoint`` (:mod:`dynabatch.training.reshard`): a run with another stage or
  replica count reads the parameters it owns from whichever files hold them;
* ``model/``: the run's model config and tokenizer files, for export (written by rank 0 before the manifest;
  :mod:`dynabatch.training.model_files`);
* ``manifest.json``: written last, by rank 0, after every rank's write returned, with the size and
  SHA-256 of every data file. It also holds the data position (global batcher state), the LR
  scheduler state, rank 0's calibration fit (with its layout key), the world shape and the run's
  config, so a resumed run reads the same next samples.

A checkpoint counts only when its manifest exists and every shard matches its recorded size and
checksum; :func:`latest_checkpoint` returns the newest such one, so a crash during a save falls back
to the previous checkpoint. Data files are safetensors (no pickle: a checkpoint cannot hold code); a
manifest can only name files inside its own folder, and a folder holding a data file its manifest does
not list is refused (the reader reads every ``*.safetensors`` file of the folder). Format 1 (per-rank
``rank-NNNNN.pt`` shards of older versions) is refused with one line naming the format.

:func:`save_collective` is the whole save protocol. Every rank first checks its weights and optimizer
state: if any rank holds a NaN or inf, nothing is written and every rank raises
:class:`NonFiniteError`, so a checkpoint is always finite (the manifest says ``"finite": true``). A
save that fails with an ``OSError`` (disk full, read-only, permissions) removes what it created and
raises :class:`CheckpointWriteError` on every rank; the earlier checkpoints stay.

Every checkpoint records the id of the run that wrote it (``"run_id"``, from :func:`new_run_id` at a
fresh run's first save; a resumed run keeps its checkpoint's id). The step folder holds the id from
the start of the save (``run_id`` file), so an unfinished save is known to its run too. :func:`prune`
only ever deletes the current run's folders, keeps the newest ``keep`` of its complete checkpoints and
never the newest finite one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dynabatch.core.rank_warnings import EveryRankWarning

MANIFEST = "manifest.json"
RUN_ID_FILE = "run_id"
"""Written into a step folder when its save starts: the id of the run the folder belongs to."""
FORMAT_VERSION = 2
DATA_SUFFIX = ".safetensors"
logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or corrupt."""


class CheckpointWriteError(ValueError):
    """A checkpoint could not be written (disk full, read-only folder, no permission)."""


class NonFiniteError(ValueError):
    """Weights or optimizer state hold NaN or inf: such a checkpoint is never written."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk."""

    path: str
    step: int
    manifest: dict[str, Any]

    @property
    def run_id(self) -> str | None:
        """The id of the run that wrote it (``None`` for checkpoints older than run ids)."""
        return self.manifest.get("run_id")


def new_run_id() -> str:
    """A random id for a fresh run (16 hex digits)."""
    return secrets.token_hex(8)


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _umask() -> int:
    """The process's umask: from ``/proc/self/status`` (reading it through ``os.umask`` sets it for a moment, which
    another thread's file could catch), else by setting it back at once."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, ValueError, IndexError, StopIteration):  # no /proc (or no Umask line): the portable way
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def atomic_write(path: str, write) -> None:
    """Call ``write(file_object)`` on a temp file next to ``path``, fsync, then rename over ``path``."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide this file from the checkpoint's other readers
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def data_files(folder: str) -> list[str]:
    """Names of the data files in a step folder (what the checkpoint reader reads), sorted."""
    return sorted(n for n in os.listdir(folder) if n.endswith(DATA_SUFFIX)) if os.path.isdir(folder) else []


def file_entry(folder: str, name: str) -> dict[str, Any]:
    """``{"file", "bytes", "sha256"}`` of data file ``name`` in ``folder``, for the manifest."""
    path = os.path.join(folder, name)
    return {"file": name, "bytes": os.path.getsize(path), "sha256": _sha256(path)}


def write_manifest(root: str, step: int, shards: list[dict[str, Any]], extra: dict[str, Any]) -> str:
    """Write the manifest (rank 0, after all data files, ``shards`` their :func:`file_entry`): the
    checkpoint is complete from this moment."""
    manifest = {"format_version": FORMAT_VERSION, "step": step, "shards": shards, **extra}
    path = os.path.join(step_dir(root, step), MANIFEST)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
    atomic_write(path, lambda f: f.write(data))
    return path


def _shard_path(folder: str, name: Any) -> str:
    """The path of shard ``name`` of the checkpoint in ``folder``; :class:`CheckpointError` unless the name
    is a plain file name whose file (after symbolic links) lies in ``folder`` itself."""
    plain = (isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name
             and "/" not in name and not (os.altsep and os.altsep in name) and "\0" not in name)
    path = os.path.join(folder, name) if plain else ""
    if not plain or os.path.dirname(os.path.realpath(path)) != os.path.realpath(folder):
        raise CheckpointError(
            f"checkpoint {folder}: the manifest names shard {name!r}, which is not a file inside the checkpoint "
            "folder; the manifest is corrupt or was edited: use another checkpoint"
        )
    return path


def verify(path: str) -> CheckpointInfo:
    """Check a checkpoint folder; raises :class:`CheckpointError` saying what is wrong. Reads no file
    outside ``path``."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MANIFEST} (the save did not finish)")
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("step"), int):
        raise CheckpointError(f"checkpoint {path}: malformed manifest (not an object with an integer 'step')")
    if manifest.get("format_version") != FORMAT_VERSION:
        older = " (per-rank .pt shards locked to their stages x replicas)" if manifest.get("format_version") == 1 else ""
        raise CheckpointError(
            f"checkpoint {path} has format version {manifest.get('format_version')}{older}; this dynabatch reads "
            f"format {FORMAT_VERSION} (reshardable safetensors): continue it with the dynabatch that wrote it, or "
            "start a new run"
        )
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not all(isinstance(sh, dict) and {"file", "bytes", "sha256"} <= set(sh)
                                               for sh in shards):
        raise CheckpointError(f"checkpoint {path}: malformed manifest (no valid 'shards' list)")
    for shard in shards:
        spath = _shard_path(path, shard["file"])
        if not os.path.exists(spath):
            raise CheckpointError(f"checkpoint {path}: shard {shard['file']} is missing")
        size = os.path.getsize(spath)
        if size != shard["bytes"] or _sha256(spath) != shard["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: shard {shard['file']} is corrupt or truncated "
                f"({size} bytes, manifest says {shard['bytes']}; checksum mismatch)"
            )
    unlisted = sorted(set(data_files(path)) - {shard["file"] for shard in shards})
    if unlisted:
        raise CheckpointError(f"checkpoint {path} holds data file {unlisted[0]} that its manifest does not list; "
                              "the folder was edited: use another checkpoint")
    return CheckpointInfo(path=path, step=int(manifest["step"]), manifest=manifest)


def _step_of(path: str) -> int:
    """The step of a step folder's path."""
    return int(_STEP_DIR.match(os.path.basename(os.path.normpath(path))).group(1))


def list_checkpoints(root: str) -> list[str]:
    """Checkpoint folders under ``root``, oldest first (complete or not)."""
    if not os.path.isdir(root):
        return []
    steps = sorted((int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name)))
    return [os.path.join(root, name) for _, name in steps]


def newest_saved(root: str) -> str | None:
    """The newest step folder under ``root`` whose manifest exists (its save finished), without reading its
    files: what a run interrupted now names as the checkpoint to resume from (:func:`latest_checkpoint` verifies
    checksums, too slow to wait for at Ctrl-C on a large model)."""
    saved = [p for p in list_checkpoints(root) if os.path.isfile(os.path.join(p, MANIFEST))]
    return saved[-1] if saved else None


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
            # every rank reads the same folder and finds the same: rank 0 says it once (it was one line per rank)
            warnings.warn(f"skipping broken checkpoint: {e}", EveryRankWarning, stacklevel=2)
    return None


def resolve_checkpoint(path: str) -> CheckpointInfo:
    """The checkpoint ``path`` names: a step folder (verified), or a checkpoints folder's newest complete
    one (broken newer ones skipped with a warning); :class:`CheckpointError` in one line otherwise."""
    if os.path.isdir(path) and (_STEP_DIR.match(os.path.basename(os.path.normpath(path)))
                                or os.path.exists(os.path.join(path, MANIFEST))):
        try:
            return verify(path)
        except CheckpointError as e:  # named on purpose: no fallback, but say which ones to pass instead
            raise CheckpointError(f"{e}{_others_beside(path)}") from e
    if list_checkpoints(path):
        info = latest_checkpoint(path)
        if info is None:
            raise CheckpointError(f"{path} holds no complete checkpoint: every step-NNNNNN folder in it is "
                                  "incomplete or corrupt")
        return info
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist{_saved_beside(path)}")
    empty = _empty_checkpoints_folder(path)
    if empty is not None:
        raise CheckpointError(f"no checkpoint in {empty}; start without "
                              "--resume-from-checkpoint, or pass a step-NNNNNN folder or a checkpoints/ folder that "
                              "holds one")
    inner = os.path.join(path, "checkpoints")
    if list_checkpoints(inner):  # a run's output folder
        raise CheckpointError(f"{path!r} is not a checkpoint but a run's folder: pass {inner} for its newest "
                              "checkpoint, or one of the step-NNNNNN folders in it")
    raise CheckpointError(f"{path!r} is not a checkpoint: pass a step-NNNNNN folder (with {MANIFEST}) or a run's "
                          "checkpoints/ folder")


def _empty_checkpoints_folder(path: str) -> str | None:
    """For an existing ``path`` with no step folder in it: the checkpoints folder it names when that folder is a run's
    without a checkpoint (``path`` itself is ``checkpoints/``, or a run's output folder whose ``checkpoints/`` is
    empty of step folders), else ``None``."""
    if os.path.basename(os.path.normpath(path)) == "checkpoints" and os.path.isdir(path):
        return path
    inside = os.path.join(path, "checkpoints")
    return inside if os.path.isdir(inside) and not list_checkpoints(inside) else None


def _others_beside(path: str) -> str:
    """For a broken step folder named on purpose: the other saved checkpoints beside it (with a manifest, newest
    first; not checksummed here), or nothing when there are none."""
    root = os.path.dirname(os.path.normpath(path)) or "."
    others = [os.path.basename(p) for p in reversed(list_checkpoints(root))
              if os.path.normpath(p) != os.path.normpath(path) and os.path.isfile(os.path.join(p, MANIFEST))]
    if not others:
        return ""
    return (f"; pass another checkpoint ({root} also holds {', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}), or {root} for its newest complete one")


def _saved_beside(path: str) -> str:
    """For a checkpoint path that does not exist: the complete checkpoints its folder holds (a pruned step's
    neighbours), or what to pass instead."""
    root = os.path.dirname(os.path.normpath(path)) or "."
    saved = [os.path.basename(p) for p in list_checkpoints(root) if os.path.isfile(os.path.join(p, MANIFEST))]
    if not saved:
        return f"; pass a step-NNNNNN folder (with {MANIFEST}) or a run's checkpoints/ folder"
    return (f" ({root} holds {', '.join(saved)}; a run keeps only its newest --save-total-limit checkpoints); pass "
            "one of those, or the checkpoints/ folder for its newest")


def _read_manifest(path: str) -> dict[str, Any] | None:
    """The parsed manifest of step folder ``path``, or ``None`` when it has none or it is unreadable."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def folder_run_id(path: str) -> str | None:
    """The id of the run step folder ``path`` belongs to: its manifest's, else the one its save started
    with; ``None`` when neither says (checkpoints older than run ids)."""
    manifest = _read_manifest(path)
    if manifest is not None:
        return manifest.get("run_id")
    try:
        with open(os.path.join(path, RUN_ID_FILE), encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def prune(root: str, keep: int, run_id: str, step: int | None = None) -> list[str]:
    """Delete run ``run_id``'s step folders except its newest ``keep`` complete checkpoints, its newest
    finite one and its newest folder (a save in progress); returns the deleted folders. Another run's folders,
    and folders of no known run, are never touched. ``step`` (the step just saved): the run's folders of later
    steps are deleted first. They were saved before the run resumed from an earlier checkpoint, on the steps it
    trains again: left, the newest by step would be the abandoned one, kept over the run's own and resumed or
    exported by ``latest``."""
    if not run_id:
        raise ValueError("prune needs the id of the run whose checkpoints it may delete")
    ours = [p for p in list_checkpoints(root) if folder_run_id(p) == run_id]
    deleted = []
    if step is not None:
        deleted = [p for p in ours if _step_of(p) > step]
        for p in deleted:
            shutil.rmtree(p, ignore_errors=True)
        ours = [p for p in ours if p not in deleted]
    manifests = {p: _read_manifest(p) for p in ours}
    complete = [p for p in ours if manifests[p] is not None]
    finite = [p for p in complete if manifests[p].get("finite") is True]
    protected = set(complete[-keep:]) if keep > 0 else set()
    protected.update(finite[-1:] + ours[-1:])
    for p in ours:
        if p not in protected:
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    return deleted


def first_non_finite(state: Any, prefix: str = "") -> str | None:
    """The dotted name of the first floating-point tensor in ``state`` (nested dicts, lists and tuples of
    tensors, e.g. a shard) that holds a NaN or an inf; ``None`` when all are finite."""
    if isinstance(state, torch.Tensor):
        floating = state.is_floating_point() or state.is_complex()
        return prefix if floating and not bool(torch.isfinite(state).all()) else None
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return None
    for key, value in items:
        name = first_non_finite(value, f"{prefix}.{key}" if prefix else str(key))
        if name is not None:
            return name
    return None


def _os_error(e: OSError) -> str:
    code = errno.errorcode.get(e.errno, "") if e.errno is not None else ""
    return f"{e.strerror} ({code})" if e.strerror and code else str(e)


def save_collective(root: str, step: int, rank: int, state: dict[str, Any], *, gather: Callable[[Any], list],
                    write: Callable[[str, dict[str, Any]], None], manifest_extra: dict[str, Any] | None,
                    run_id: str | None, keep: int) -> str:
    """Save checkpoint ``step`` under ``root``; collective: every rank calls it with its own ``state``
    (flat name -> tensor), and ``gather(obj)`` must return every rank's ``obj`` in rank order (e.g.
    ``all_gather_object`` on a CPU group). ``write(folder, state)`` writes this rank's part as data files
    into ``folder`` (collective itself where it is DCP's save: every rank calls it or none does) and raises
    ``OSError`` when this rank could not write. Rank 0 (whose ``run_id`` and ``manifest_extra`` count)
    first marks the folder with the run id and clears what an unfinished earlier save left in it; after
    every rank's write it checksums the data files, writes the manifest and prunes (:func:`prune`).
    Returns the step folder. Raises on every rank: :class:`NonFiniteError` (any rank's state holds a NaN
    or inf; nothing is written) or :class:`CheckpointWriteError` (an ``OSError`` on any rank; the step
    folder is removed if this save created it, else its data files; earlier checkpoints stay)."""
    if rank == 0 and not run_id:
        raise ValueError("save_collective: rank 0 needs the run id (new_run_id() for a fresh run)")
    folder = step_dir(root, step)
    created = rank == 0 and not os.path.exists(folder)  # no rank writes before the first gather returns
    bad = [(r, name) for r, name in enumerate(gather(first_non_finite(state))) if name is not None]
    if bad:
        where = ", ".join(f"rank {r} {name!r}" for r, name in bad[:4]) + (" and more" if len(bad) > 4 else "")
        raise NonFiniteError(
            f"step {step}: not writing checkpoint {folder}: non-finite values (NaN or inf) in {where}; nothing was "
            "written and the earlier checkpoints are kept. Lower --learning-rate or --max-grad-norm and "
            "--resume-from-checkpoint the newest checkpoint"
        )
    refusal = _not_ours(folder, run_id) if rank == 0 else None
    error = refusal or (_prepare_folder(folder, run_id) if rank == 0 else None)
    if gather(error)[0] is None:  # every rank writes, or (rank 0 could not prepare the folder) none does
        try:
            write(folder, state)
        except OSError as e:
            error = f"rank {rank}: {_os_error(e)}"
    errors = [e for e in gather(error) if e is not None]
    if refusal is not None:  # nothing was written, and nothing of that folder may be removed
        problem = refusal
    else:
        problem = _finish_save(root, step, errors, manifest_extra or {}, run_id, keep, created) if rank == 0 else None
    problem = gather(problem)[0]
    if problem is not None:
        raise CheckpointWriteError(problem)
    return folder


def _not_ours(folder: str, run_id: str) -> str | None:
    """Rank 0, before any write: why this run must not save into the existing step folder ``folder`` (another
    run's checkpoint, or files of no run: a save would delete their data files and claim the folder, which
    pruning would later delete whole), else ``None``. A folder of this run (an unfinished or abandoned save of
    its own), or one holding only data files and ``model/`` (an unfinished save that wrote no run id), is
    cleared and reused."""
    if not os.path.isdir(folder):
        return None
    owner = folder_run_id(folder)
    if owner == run_id:
        return None
    if owner is not None:
        what = f"a checkpoint of another run (run id {owner})"
    else:  # no run id: an unfinished save (data files, model/, no manifest) is reused, anything else is not ours
        entries = sorted(n for n in os.listdir(folder) if not n.startswith(".tmp-"))
        foreign = [n for n in entries if not n.endswith(DATA_SUFFIX) and n != "model"]
        if not foreign:
            return None
        what = f"files no save of this run wrote ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})"
    return (f"not writing checkpoint {folder}: it already holds {what}, which this run never deletes or "
            "overwrites; move that folder away and rerun the same command, or pass another --output-dir")


def _prepare_folder(folder: str, run_id: str) -> str | None:
    """Rank 0, before any write: the step folder with the run id in it, without the manifest and data files
    of an unfinished (or overwritten) earlier save there; returns the error line or ``None``."""
    try:
        os.makedirs(folder, exist_ok=True)
        atomic_write(os.path.join(folder, RUN_ID_FILE), lambda f: f.write(str(run_id).encode("utf-8")))
        for name in [MANIFEST, *data_files(folder)]:  # the manifest first: the folder stops counting at once
            if os.path.exists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
    except OSError as e:
        return f"rank 0: {_os_error(e)}"
    return None


def _finish_save(root: str, step: int, errors: list[str], extra: dict[str, Any], run_id: str | None,
                 keep: int, created: bool) -> str | None:
    """Rank 0's part after every rank's write: checksums, manifest and pruning, or cleanup; returns the
    error line or ``None``."""
    folder = step_dir(root, step)
    if not errors:
        try:
            entries = [file_entry(folder, name) for name in data_files(folder)]
            write_manifest(root, step, entries, {**extra, "run_id": run_id, "finite": True})
        except OSError as e:
            errors = [f"rank 0: {_os_error(e)}"]
    if errors:
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        else:  # an earlier folder: only the data files, all of this save's (_prepare_folder removed older ones)
            for name in data_files(folder):
                os.remove(os.path.join(folder, name))
        return (f"could not write checkpoint {folder} ({'; '.join(errors)}); nothing of it was kept and the earlier "
                "checkpoints are intact: free disk space (or fix the folder's permissions) and rerun with "
                "--resume-from-checkpoint, or pass another --output-dir")
    stale = [p for p in prune(root, keep, run_id, step) if _step_of(p) > step]
    if stale:
        logger.info(f"deleted {', '.join(os.path.basename(p) for p in stale)}: saved before this run resumed from an "
                    "earlier checkpoint, on steps it has now trained again")
    return None


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
