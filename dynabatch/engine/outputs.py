"""The run's output folder: never start over another run's files, never lose them.

A training run writes a known set of entries into ``--output-dir`` (:data:`RUN_ENTRIES`). Before
anything is loaded, rank 0 inspects the folder (:func:`output_dir_problem`):

* a path that is a file, or a folder it cannot create or write into, is an error naming it;
* a fresh run (no ``--resume-from-checkpoint``) into a folder that holds anything at all is refused, naming what it
  found and pointing at ``--resume-from-checkpoint`` (continue that run) and ``--overwrite-output-dir``; nothing in
  the folder is touched;
* with ``--overwrite-output-dir`` the entries the earlier run wrote are deleted first (its checkpoints, metrics,
  summary, configuration, calibration, timelines, tracker logs and compare runs); anything else in the folder is left
  alone, and so is a file or folder of the user's inside the run's ``checkpoints/`` (only its checkpoints go). What counts as the earlier run's is what its run file says (:data:`RUN_FILE`): a run starting in a folder
  records there what the folder held before it, and the folders it writes (:data:`RUN_DIRS`: ``checkpoints/``, and
  ``runs/``, ``wandb/``, ``compare-<method>/`` when its settings write them), so an entry named like a run's that was
  there first, or a folder the run did not write (a ``runs/`` added after a run without TensorBoard), is never
  deleted. A folder holding such entries with no run file (the user's own, or a run older than the run file) is
  refused with one line naming them, and nothing is touched;
* ``--resume-from-checkpoint`` continues the run that wrote the folder (its run file, or a run older than the run file
  whose ``checkpoints/`` hold a checkpoint); a folder no run wrote is treated as a fresh run's: refused when it holds
  anything, so a resume never writes over files that are not a run's;
* a run that stopped before its first step (bad input found while loading) leaves only what it writes at start
  (:data:`NOTHING_TRAINED`): the next fresh run there replaces it, so correcting the command and running it again
  works without ``--overwrite-output-dir``.

Rank 0 decides and broadcasts the outcome, so every rank raises the same one-line ``ValueError``
(:func:`prepare_output_dir`). On ``--resume-from-checkpoint``, :func:`truncate_metrics` drops the records of steps the
earlier run logged after its last checkpoint, so ``metrics.jsonl`` holds every step exactly once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from dynabatch.engine.checkpoint import MANIFEST, RUN_ID_FILE, list_checkpoints, newest_saved

RUN_FILE = "dynabatch-run.json"
"""Written when a run starts in a folder: the entries the folder held before it (``present_before``), so that
``--overwrite-output-dir`` deletes only what the run wrote itself."""
RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "summary.json", "config.yaml", "calibration.json", "timeline.json",
               "timeline.png", "timeline_measured.png", "timeline_simulated.png", "runs", "wandb", RUN_FILE)
"""What a training run writes into its output folder (plus ``compare-<method>/`` folders)."""


RUN_DIRS = ("checkpoints", "runs", "wandb")
"""The folders a run writes (plus ``compare-<method>/``): its run file names those it writes (``claimed``), and
``--overwrite-output-dir`` deletes no other folder, whatever its name."""


def _is_run_entry(name: str) -> bool:
    return name in RUN_ENTRIES or name.startswith("compare-")


def _is_run_dir(name: str) -> bool:
    return name in RUN_DIRS or name.startswith("compare-")


TRACKER_DIRS = {"tensorboard": "runs", "wandb": "wandb"}
"""The folder each experiment tracker writes into the output folder."""


def run_dirs(trackers=(), compare_method: str | None = None) -> list[str]:
    """The folders a run writes into its output folder (:data:`RUN_DIRS`): ``checkpoints``, each of its
    ``trackers``' (``tensorboard``, ``wandb``), and a compare run's."""
    names = ["checkpoints"] + [TRACKER_DIRS[t] for t in trackers if t in TRACKER_DIRS]
    return names + ([f"compare-{compare_method}"] if compare_method else [])


def _run_file(path: str) -> dict | None:
    """The folder's :data:`RUN_FILE` (a dict with ``present_before``), or ``None`` without a readable one."""
    try:
        with open(os.path.join(path, RUN_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("present_before"), list) else None


def _present_before(path: str) -> list[str] | None:
    """The entries the folder held when the run that wrote its :data:`RUN_FILE` started; ``None`` without a
    readable run file."""
    record = _run_file(path)
    return None if record is None else [str(x) for x in record["present_before"]]


def _write_run_file(path: str, record: dict) -> None:
    tmp = os.path.join(path, RUN_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, os.path.join(path, RUN_FILE))


def _record_start(path: str, found: list[str], claims=()) -> None:
    """Write :data:`RUN_FILE`: a run starts in ``path``, which holds ``found`` (none of it the run's), and will
    write the folders ``claims`` (those not there already)."""
    _write_run_file(path, {"written_by": "dynabatch train", "present_before": sorted(found),
                           "claimed": sorted(set(claims) - set(found))})


def _claim_more(path: str, record: dict, claims) -> None:
    """A resumed run writes ``claims`` too: add those not in the folder yet to its run file's ``claimed``."""
    if "claimed" not in record:  # a run file older than claims: its folders are judged as before
        return
    present = set(os.listdir(path))
    more = set(claims) - present - set(record["claimed"])
    if more:
        _write_run_file(path, {**record, "claimed": sorted(set(record["claimed"]) | more)})


def _has_checkpoint(path: str) -> bool:
    """``path/checkpoints`` holds a ``step-NNNNNN`` folder: a run wrote the folder (one older than the run file)."""
    try:
        return any(n.startswith("step-") for n in os.listdir(os.path.join(path, "checkpoints")))
    except OSError:
        return False


NOTHING_TRAINED = frozenset({RUN_FILE, "config.yaml", "calibration.json"})
"""What a run writes before its first step: a folder holding no more of an earlier run than these is a run that
stopped before it trained (bad input found while loading), and a rerun may start there."""


def _start_of_a_run_that_trained_nothing(path: str, found: list[str]) -> list[str]:
    """The entries of ``found`` that an earlier run wrote, when it wrote nothing beyond :data:`NOTHING_TRAINED`
    (by its run file); else none."""
    before = _present_before(path)
    if before is None:
        return []
    own = [n for n in found if n not in before]
    return own if set(own) <= NOTHING_TRAINED else []


def listed(names: list[str]) -> str:
    """The first five of ``names`` and how many more, for a one-line message."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def make_writable_dir(path: str) -> None:
    """Create ``path`` (and its parents) and check that a file can be written there; ``OSError`` otherwise."""
    os.makedirs(path, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
    os.close(fd)
    os.remove(probe)


def _delete(path: str, names) -> list[str]:
    """Delete the entries ``names`` of ``path``; returns those kept: a run's ``checkpoints/`` that holds entries of
    the user's beside the run's checkpoints (:func:`_delete_checkpoints`)."""
    kept = []
    for name in names:
        target = os.path.join(path, name)
        if name == "checkpoints" and os.path.isdir(target) and not os.path.islink(target):
            if not _delete_checkpoints(target):
                kept.append(name)
        elif os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        else:
            os.remove(target)
    return kept


def _delete_checkpoints(folder: str) -> bool:
    """Delete the checkpoints in a run's ``checkpoints/`` (step folders with a manifest or a run id: what saves
    write) and then the folder, unless it holds anything else (a file or folder of the user's: kept, and so the
    folder); returns whether the folder is gone."""
    for step in list_checkpoints(folder):
        if os.path.isdir(step) and any(os.path.exists(os.path.join(step, n)) for n in (MANIFEST, RUN_ID_FILE)):
            shutil.rmtree(step)
    for name in os.listdir(folder):
        if name.startswith(".tmp-"):  # an atomic write cut short
            os.remove(os.path.join(folder, name))
    try:
        os.rmdir(folder)
    except OSError:
        return False
    return True


def _clear_earlier_run(path: str, found: list[str]) -> tuple[str | None, list[str]]:
    """``--overwrite-output-dir``: delete the entries of ``found`` the earlier run wrote (by its run file), or say
    why none can be deleted (entries named like a run's and no run file to tell whose they are). Returns that line
    (or ``None``) and the run's folders kept for the user's files in them (still the run's: ``checkpoints/``)."""
    record = _run_file(path)
    named = [n for n in found if _is_run_entry(n)]
    if record is None:
        if not named:
            return None, []
        return (f"--overwrite-output-dir: {path!r} holds {listed(named)} but no {RUN_FILE} saying a dynabatch run "
                "wrote them, so nothing was deleted; move them away, or pass another --output-dir"), []
    before = set(record["present_before"])  # there before that run started: not its own
    claimed = record.get("claimed")  # the folders it wrote (None: a run file older than claims)
    return None, _delete(path, [n for n in named
                                if n not in before and (claimed is None or not _is_run_dir(n) or n in claimed)])


def output_dir_problem(path: str, *, resume: bool, overwrite: bool, claims=()) -> str | None:
    """Why a run may not use ``path`` (one line), or ``None``; with ``overwrite`` deletes the earlier
    run's entries. Creates the folder if it does not exist; a fresh run records what the folder holds in
    :data:`RUN_FILE`, and the folders it will write (``claims``, :func:`run_dirs`)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"--output-dir {path!r} is a file, not a folder; pass a folder path"
    try:
        make_writable_dir(path)
    except OSError as e:
        return f"--output-dir {path!r} is not writable ({e.strerror or e}); pass a folder you can write to"
    found = sorted(os.listdir(path))
    if resume:  # continue the run that wrote the folder; a folder no run wrote is a fresh run's
        record = _run_file(path)
        if record is not None:
            _claim_more(path, record, claims)
            return None
        if _has_checkpoint(path):
            return None
        if found == ["checkpoints"]:  # an empty (or step-less) checkpoints/ and nothing else: no run to continue
            return (f"--resume-from-checkpoint: --output-dir {path!r} holds an empty checkpoints/ folder and no "
                    f"{RUN_FILE}, so there is no checkpoint to resume; remove the empty folder and start without "
                    "--resume-from-checkpoint, or pass the run's own --output-dir")
        if found:
            return (f"--resume-from-checkpoint: --output-dir {path!r} holds {listed(found)} but no {RUN_FILE} or "
                    "checkpoints/ saying a dynabatch run wrote it, so nothing there is resumed or written over; pass "
                    "the run's own --output-dir, or another (empty) folder")
    if unfinished := _start_of_a_run_that_trained_nothing(path, found):  # a run stopped by bad input: start again
        _delete(path, unfinished)
        found = sorted(os.listdir(path))
    if found and not overwrite:
        return (f"--output-dir {path!r} is not empty (it holds {listed(found)}); pass --resume-from-checkpoint to continue the run that "
                "wrote it, --overwrite-output-dir to replace that run's files, or another --output-dir")
    kept = []
    if found:
        problem, kept = _clear_earlier_run(path, found)
        if problem is not None:
            return problem
    _record_start(path, sorted(n for n in os.listdir(path) if n not in kept), claims)
    return None


def prepare_output_dir(output_dir: str, ctx, resume: str | bool | None = None, overwrite: bool = False,
                       claims=()) -> None:
    """Collective: rank 0 checks (and with ``overwrite`` clears) ``output_dir`` and every rank raises the same
    ``ValueError`` if the run may not start there (``resume``: the checkpoint the run resumes from, if any;
    ``claims``: the folders the run writes, :func:`run_dirs`)."""
    import torch.distributed as dist

    problem = [None]
    if ctx.is_planner:
        problem[0] = output_dir_problem(output_dir, resume=resume, overwrite=overwrite, claims=claims)
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


def steps_logged(path: str) -> int:
    """How many steps the run logging to the metrics file ``path`` finished: one past the newest step record
    (evaluation rows and a torn last line are skipped); 0 without the file."""
    done = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "loss" in record and isinstance(record.get("step"), int):
                    done = max(done, record["step"] + 1)
    except OSError:
        return 0
    return done


def interruption_line(output_dir: str, step: int | None) -> str:
    """The line a run stopped by Ctrl-C ends with: the step it was on (``None``: not known) and the newest
    checkpoint to resume from, or that none was saved. A save the interrupt cut short has no manifest and is
    never named. It lives here, beside the engine's checkpoint listing, because the launcher of ``dynabatch train
    --stages N`` says it after its ranks are gone: reading it from the training modules imported transformers and
    the model families first, 5-17 s of silence after Ctrl-C on 2 busy cores."""
    where = "interrupted" if step is None else f"interrupted at step {step}"
    newest = newest_saved(os.path.join(output_dir, "checkpoints"))
    if newest is None:
        return f"{where}; no checkpoint was saved"
    return f"{where}; the newest checkpoint is {newest}: resume with --resume-from-checkpoint"
