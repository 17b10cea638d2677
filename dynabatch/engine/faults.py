"""How a rank of a multi-process run fails, and the fault injection the fault tests use.

A failing rank must say what went wrong in one line of its own, be the rank the launcher names, and
end the job promptly even when a peer is stopped or dead. :func:`fail_fast` wraps a run's body; on an
exception in a world of several ranks it, in this order:

1. kills the peers of this job on this machine that are stopped (``SIGSTOP``: state ``T`` in
   ``/proc/PID/stat``). A stopped process never handles the SIGTERM torchrun sends the remaining
   workers, so torchrun would wait its shutdown timeout (30 s) before its SIGKILL; the process ids come
   from :func:`share_processes` (host, pid and start time, so a reused pid is never killed). A stopped
   peer on another machine is left to that machine's torchrun (``--shutdown-timeout``);
2. records the job's first failure in the rendezvous store (torchrun's agent keeps it alive after a
   rank exits), so a rank that fails only because a peer went away says which rank failed first;
3. prints ``dynabatch train: error: [rank N] ...`` (one line; a traceback too for a bug, i.e. not a
   ``ValueError``/``FileNotFoundError``/:class:`~dynabatch.engine.dist.PipelineError`, or with
   ``DYNABATCH_DEBUG=1``) and writes torchrun's error file (``TORCHELASTIC_ERROR_FILE``). A rank that fails only
   because another rank's bad input ended the run first (the first failure a user error, its own not), or that
   failed the same check with the same message (a check every rank makes), prints nothing: the run's one line is
   the first rank's, and the error file still names it (its line, without a traceback). torchrun
   names the failure with the smallest timestamp as the root cause and keeps whole seconds, so a rank
   that fails because another failed first records one second after that one;
4. exits at once (``os._exit``: 2 for a user error, 1 otherwise, 130 on Ctrl-C) without tearing the
   process groups down, which can hang when a peer is dead.

Ctrl-C under torchrun reaches every rank: the first rank to record it makes it the job's first failure, rank 0
prints its line (``dynabatch train: interrupted at step N; the newest checkpoint is ...``, the
:class:`~dynabatch.engine.errors.Interrupted` message) and every rank, also one that failed only because a peer
left, exits 130 without a line of its own. A run started directly (:mod:`dynabatch.engine.launch`) never
delivers SIGINT to its ranks: the launcher stops them and the command prints the line.

Fault injection (environment variables, for tests): ``DYNABATCH_SLOW_START_S=SECONDS`` makes rank 0
sleep after loading its data (:func:`maybe_slow_start`); ``DYNABATCH_CRASH_AT=STEP[:RANK]`` kills a
process at the start of a step (:func:`maybe_crash`).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import timedelta

from dynabatch.engine.errors import Interrupted, PipelineError

USER_ERRORS = (ValueError, FileNotFoundError)
"""Bad input or a run that cannot go on as configured: one line, exit status 2."""

_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""``OSError``s that the machine's storage, not a bug, caused (disk full, read-only, no permission)."""


def is_user_error(error: BaseException) -> bool:
    """A :data:`USER_ERRORS` or a storage ``OSError``: one line and exit 2, no traceback."""
    return isinstance(error, USER_ERRORS) or (isinstance(error, OSError) and error.errno in _STORAGE_ERRNOS)


def user_message(error: BaseException) -> str:
    """The one-line text of a user error; a storage error says which file and what to do."""
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError) and error.errno in _STORAGE_ERRNOS:
        where = f" writing {error.filename!r}" if error.filename else ""
        return (f"{error.strerror or error}{where}; free disk space or fix the folder's permissions (or pass another "
                "--output-dir), then rerun (with --resume-from-checkpoint to continue from the newest checkpoint)")
    return str(error)

_STORE_TIMEOUT_S = 2.0  # the store's host may be gone too; never wait long for it when exiting

INTERRUPTED_STATUS = 130
"""The exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it)."""


def interruption_message(error: KeyboardInterrupt) -> str:
    """What a command stopped by Ctrl-C says after ``dynabatch CMD: ``: an :class:`Interrupted`'s own line (a
    training run's step and newest checkpoint), else ``interrupted``."""
    return str(error) if isinstance(error, Interrupted) and str(error) else "interrupted"


def error_line(prog: str, message: str) -> str:
    """The CLI's one-line error: ``dynabatch CMD: error: MESSAGE``."""
    return f"{prog}: error: {message}"


@dataclass(frozen=True)
class ProcessId:
    """One rank's process, as its peers on the same machine can check it."""

    host: str
    """Host name and boot id: the same machine (and boot)."""
    pid: int
    start_ticks: int
    """Start time in clock ticks since boot (-1 without ``/proc``): the same process, not a reused pid."""


LAUNCHER_PID_ENV = "DYNABATCH_LAUNCHER_PID"
"""Set by :mod:`dynabatch.engine.launch` in each rank's environment: the launcher's pid, which the rank follows
(:func:`follow_launcher`)."""


def die_with_parent(parent: int | None = None) -> None:
    """Linux: the kernel kills this process (``SIGKILL``) when its parent dies, however it dies (``SIGKILL``,
    ``os._exit``, the out-of-memory killer), so no child outlives the process that would stop it: a planner child
    holding its rank's output pipes open, or a rank training on (and writing checkpoints) after its launcher is
    gone. ``parent``: the pid the parent must have; a process whose parent already differs (it died before the
    request took effect) is killed now. Elsewhere nothing changes."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return
    expected = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != expected or os.getppid() == 1:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def follow_launcher() -> None:
    """A rank started by ``dynabatch train --stages N`` ends with its launcher, and one started by torchrun with
    torchrun's agent (its parent): a launcher killed by ``SIGKILL`` (which it cannot pass on, unlike Ctrl-C or
    ``SIGTERM``) left every rank training on as an orphan, writing into the output folder a resumed run then
    shares. The launcher's variable is removed, so a process this rank starts does not follow the launcher too."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher is not None and launcher.isdigit():
        die_with_parent(int(launcher))
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: its parent is the node's agent
        die_with_parent()


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start ticks) of process ``pid`` from ``/proc``; ``None`` if unreadable or gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": fields 3.. of proc(5)
    return fields[0], int(fields[19])


def current_process() -> ProcessId:
    """This process's :class:`ProcessId`."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    stat = _proc_stat(os.getpid())
    return ProcessId(f"{socket.gethostname()}/{boot}", os.getpid(), stat[1] if stat else -1)


def share_processes(ctx) -> tuple[ProcessId, ...]:
    """Collective over the world (``ctx.delivery_group``): every rank's :class:`ProcessId`, by rank."""
    import torch.distributed as dist

    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, current_process(), group=ctx.delivery_group)
    return tuple(gathered)


def kill_stopped_peers(rank: int, processes: tuple[ProcessId, ...]) -> list[tuple[int, int]]:
    """SIGKILL the peers of ``rank`` on this machine whose process is stopped (state ``T``); returns
    their (rank, pid)."""
    me = current_process()
    killed = []
    for r, p in enumerate(processes):
        if r == rank or p.host != me.host or p.start_ticks < 0:
            continue
        stat = _proc_stat(p.pid)
        if stat is None or stat != ("T", p.start_ticks):
            continue
        _store_set(killed_by_a_peer_key(p.pid))  # first, so the launcher never sees it dead before it is said
        try:
            os.kill(p.pid, signal.SIGKILL)
        except OSError:  # gone meanwhile, or not ours to kill
            continue
        killed.append((r, p.pid))
    return killed


def killed_by_a_peer_key(pid: int) -> str:
    """The store key a rank sets (in the job's store itself, under no group's prefix) before it kills the stopped
    process ``pid``: the local launcher (:mod:`dynabatch.engine.launch`) then leaves that rank's SIGKILL to the
    killer's own line (``killed rank 1 (pid P), which was stopped``) instead of guessing the out-of-memory killer."""
    return f"dynabatch/killed_stopped/{pid}"


def _job_store(unprefixed: bool = False):
    """The job's rendezvous store, waiting at most :data:`_STORE_TIMEOUT_S` on it (``unprefixed``: under no group's
    prefix, the keys as the store's host reads them); raises when there is none."""
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    while unprefixed and isinstance(store, c10d.PrefixStore):
        store = store.underlying_store
    store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))
    return store


def _store_set(key: str) -> None:
    """Set ``key`` in the job's store as its host reads it, when one is reachable (a courtesy, as in
    :func:`claim_first_failure`)."""
    with suppress(Exception):  # exiting anyway; the store is only a courtesy
        _job_store(unprefixed=True).set(key, "1")


@dataclass(frozen=True)
class FailureRecord:
    """The first failure of a job, as the rendezvous store holds it."""

    rank: int
    message: str
    timestamp: int
    """Whole seconds since the epoch (torchrun's resolution)."""
    user_error: bool = False
    """The failure was bad input (:func:`is_user_error`): that rank's line is the run's one line."""
    interrupted: bool = False
    """The failure was Ctrl-C: rank 0 prints its message (the interruption line), no rank anything else."""


def claim_first_failure(mine: FailureRecord) -> FailureRecord:
    """Record ``mine`` as the job's first failure unless a rank did so before; returns the first one.
    Without a reachable store (its host gone, or no process group), ``mine``."""
    try:
        store = _job_store()
        key = f"dynabatch/first_failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        value = json.dumps([mine.rank, mine.message, mine.timestamp, mine.user_error, mine.interrupted])
        first = json.loads(store.compare_set(key, "", value))
        return FailureRecord(int(first[0]), str(first[1]), int(first[2]), bool(first[3]) if len(first) > 3 else False,
                             bool(first[4]) if len(first) > 4 else False)
    except Exception:  # noqa: BLE001 - exiting anyway; the store is only a courtesy
        return mine


def write_error_file(message: str, callstack: str, timestamp: int) -> None:
    """torchrun's per-worker error file (``TORCHELASTIC_ERROR_FILE``; nothing when unset), in the format
    of ``torch.distributed.elastic.multiprocessing.errors.ErrorHandler``, with our ``timestamp``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": callstack, "timestamp": str(timestamp)}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass


def _describe(error: BaseException) -> str:
    if is_user_error(error):
        return user_message(error)
    if isinstance(error, KeyboardInterrupt):
        return interruption_message(error)
    if isinstance(error, PipelineError):
        return f"PipelineError: {error}"
    return f"{type(error).__name__}: {error}"


def _exit_status(error: BaseException) -> int:
    if is_user_error(error):
        return 2
    return INTERRUPTED_STATUS if isinstance(error, KeyboardInterrupt) else 1


def _is_bug(error: BaseException) -> bool:
    return not (is_user_error(error) or isinstance(error, (PipelineError, KeyboardInterrupt)))


def failure_message(rank: int, error: BaseException, first: FailureRecord, killed: list[tuple[int, int]]) -> str:
    """The one line rank ``rank`` prints for ``error``: ``[rank N] ...``, naming the rank that failed
    first when it was another one and this rank's own error is not a user error, and the stopped
    peers it killed."""
    own = _describe(error)
    if first.rank != rank and not is_user_error(error):
        text = f"[rank {rank}] stopped because rank {first.rank} failed first ({first.message}); here: {own}"
    else:
        text = f"[rank {rank}] {own}"
    for r, pid in killed:
        text += (f"; killed rank {r} (pid {pid}), which was stopped (SIGSTOP) and could not exit on the "
                 "launcher's SIGTERM")
    return " ".join(text.split("\n"))


def report_and_exit(rank: int, error: BaseException, processes: tuple[ProcessId, ...], prog: str) -> None:
    """Steps 1-4 of the module docstring for ``error`` on ``rank``; never returns."""
    try:
        killed = kill_stopped_peers(rank, processes)
        now = int(time.time())
        first = claim_first_failure(FailureRecord(rank, _describe(error), now, is_user_error(error),
                                                  isinstance(error, KeyboardInterrupt)))
        if first.interrupted and not killed:  # Ctrl-C reached every rank: the run's one line is rank 0's
            if rank == 0:
                sys.stderr.write(f"{prog}: {first.message}\n")
            write_error_file(first.message, first.message, now)
            os._exit(INTERRUPTED_STATUS)
        line = failure_message(rank, error, first, killed)
        stack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        # another rank's bad input ended the run first: its line is the run's, unless this rank has news of its own
        # (another user error, or peers it killed); a check every rank makes alike says the same once
        echo = (first.rank == rank or not first.user_error or bool(killed)
                or (is_user_error(error) and first.message != _describe(error)))
        if echo and (_is_bug(error) or os.environ.get("DYNABATCH_DEBUG")):
            sys.stderr.write(stack)
        if echo or os.environ.get("DYNABATCH_DEBUG"):
            sys.stderr.write(error_line(prog, line) + "\n")
        # the error file too: torchrun prints every rank's under "Failures", so a consequence's stack is noise there
        write_error_file(line, stack + line if _is_bug(error) and echo else line,
                         now if first.rank == rank else max(now, first.timestamp + 1))
    finally:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(_exit_status(error))


@contextmanager
def fail_fast(ctx, prog: str = "dynabatch train") -> Iterator[None]:
    """Run a multi-rank body so that an exception ends this rank at once with its own line (module
    docstring). Collective on entry (:func:`share_processes`). In a world of one, or without a process
    group, exceptions pass through unchanged (the caller tears down and the CLI prints)."""
    import torch.distributed as dist

    if ctx.world_size == 1 or not dist.is_initialized():
        yield
        return
    processes: tuple[ProcessId, ...] = ()
    try:
        processes = share_processes(ctx)
        yield
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - every failure must end the job promptly
        report_and_exit(ctx.rank, e, processes, prog)


def maybe_slow_start() -> None:
    """Fault injection: ``DYNABATCH_SLOW_START_S=SECONDS`` sleeps that long; the trainer calls it on rank 0
    right after loading the data, standing in for a mixture that takes long to tokenize."""
    seconds = os.environ.get("DYNABATCH_SLOW_START_S")
    if seconds:
        time.sleep(float(seconds))


def maybe_crash(step: int, rank: int) -> None:
    """Fault injection for tests: ``DYNABATCH_CRASH_AT=STEP[:RANK]`` kills this process at that step."""
    spec = os.environ.get("DYNABATCH_CRASH_AT")
    if spec:
        at, _, who = spec.partition(":")
        if int(at) == step and (not who or int(who) == rank):
            os._exit(17)
