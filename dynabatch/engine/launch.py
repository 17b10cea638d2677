"""Launching a run of several processes on this machine without ``torchrun``.

``dynabatch train --stages 2`` (or ``bench``) started directly, outside a ``torchrun`` world, starts its own ranks:
:func:`launch_local` runs the command once per rank with the environment ``torchrun
--standalone`` would give it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``OMP_NUM_THREADS=1``
unless set) and waits for them. The launcher hosts the rendezvous store, as torchrun's agent does, so the store
outlives any rank and a rank failing after another still reads which one failed first; the store accepts
connections on 127.0.0.1 only (a plain ``TCPStore`` listens on every interface, unauthenticated). Then:

* the run's exit status is the failing rank's own (2 for bad input, :mod:`dynabatch.engine.faults`; 2 wins when
  ranks seen failing together differ), where ``torchrun`` would report 1 and a launcher traceback; a rank ended by
  a signal is named in one line and gives ``128 + N`` (137 for SIGKILL);
* once a rank has failed the others are stopped (SIGTERM, SIGKILL after :data:`GRACE_S`), so a rank waiting on
  the dead one never holds the job until its timeout;
* Ctrl-C is the launcher's alone: the ranks start with SIGINT blocked (:func:`_start_ranks`), so none prints a
  traceback or a line of its own while the launcher stops them (as after a failure) and returns 130, for the
  command to print the run's one line (``dynabatch train: interrupted at step N; ...``). A SIGTERM or SIGHUP to the
  launcher (a job scheduler ending the job) is passed on (exit 143 / 129), so no rank is left running without it;
  a launcher killed outright (``SIGKILL``, the out-of-memory killer) takes its ranks with it, as each rank asks the
  kernel at start (:func:`~dynabatch.engine.faults.follow_launcher`).
  The ranks share the launcher's process group, so Ctrl-Z still stops them all.

Several machines still launch with ``torchrun`` (docs/user_guide/training.md, "Launching with torchrun").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from dynabatch.cost.p2p import loopback_store
from dynabatch.engine.faults import LAUNCHER_PID_ENV, killed_by_a_peer_key

GRACE_S = 10.0
"""Seconds the other ranks get to exit after SIGTERM before SIGKILL."""


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment of rank ``rank``: this process's, plus what ``torchrun --standalone`` sets for a worker
    (every rank a client of the launcher's rendezvous store on 127.0.0.1:``port``). :func:`launch_local` adds its
    own pid, which the ranks it starts follow (:func:`~dynabatch.engine.faults.follow_launcher`); a caller that
    starts the ranks otherwise (forked from a server, whose pid is their parent's) leaves it out."""
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every rank still running, SIGKILL what is left after :data:`GRACE_S`."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Signalled(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_signalled(signum, _frame) -> None:
    raise _Signalled(signum)


def _start_ranks(command: list[str], world_size: int, port: int, procs: list[subprocess.Popen]) -> None:
    """Start ranks ``0 .. world_size - 1`` of ``python *command`` into ``procs``, each with SIGINT blocked (a
    child keeps its parent's signal mask), so a terminal's Ctrl-C reaches only the launcher. The launcher blocks
    SIGINT only while it starts them: a Ctrl-C meanwhile stays pending and is raised right after."""
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for r in range(world_size):
            env = {**rank_environment(r, world_size, port), LAUNCHER_PID_ENV: str(os.getpid())}
            procs.append(subprocess.Popen([sys.executable, *command], env=env))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _run_status(failed: list[int]) -> int:
    """The run's exit status from the failed ranks' codes: 2 (bad input) wins, then a rank's own status; a rank
    ended by a signal (``Popen``'s code ``-N``) is ``128 + N`` as a shell says it (137 for SIGKILL), where passing
    ``-9`` on would exit 247."""
    if 2 in failed:
        return 2
    own = [c for c in failed if c > 0]
    return own[0] if own else 128 - failed[0]


def _signal_cause(signum: int) -> str:
    """What likely sent ``signum``: the out-of-memory killer sends only SIGKILL, and a SIGSEGV, SIGBUS, SIGFPE,
    SIGILL or SIGABRT is the process's own crash in native code (torch, a kernel, a library), which the one guess
    given for every signal ("out of memory, or killed by hand?") sent looking in the wrong place."""
    if signum == signal.SIGKILL:
        return "out of memory, or killed by hand?"
    if signum in (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT):
        return "a crash in native code; its output above may say where"
    return "killed by hand or by a job scheduler?"


def _killed_by_a_peer(store, pid: int) -> bool:
    """Whether a rank recorded that it killed ``pid``, a rank it found stopped (SIGSTOP): its own line says so."""
    try:
        return store.check([killed_by_a_peer_key(pid)])
    except Exception:  # noqa: BLE001 - only a courtesy: without it the line guesses the cause
        return False


def _say_signalled(procs: list[subprocess.Popen], store=None) -> None:
    """One line per rank ended by a signal (the kernel's out-of-memory killer, a ``kill -9``, a crash in native
    code): its peers' lines only say the connection to it broke, and a rank killed so prints nothing of its own. A
    stopped rank a peer killed is that peer's news (the launcher's guess contradicted it)."""
    for rank, p in enumerate(procs):
        if p.returncode is not None and p.returncode < 0:
            if store is not None and p.returncode == -signal.SIGKILL and _killed_by_a_peer(store, p.pid):
                continue
            signum = -p.returncode
            print(f"rank {rank} (pid {p.pid}) was killed by {signal.Signals(signum).name} ({_signal_cause(signum)}); "
                  "the run stops", file=sys.stderr, flush=True)


def launch_local(command: list[str], world_size: int, poll_s: float = 0.1) -> int:
    """Run ``python *command`` (e.g. ``-m dynabatch train ...``) as ranks ``0 .. world_size - 1`` on this machine
    (module docstring); returns the run's exit status."""
    store = loopback_store(world_size, timeout_s=300.0)  # outlives any rank, as torchrun's does; 127.0.0.1 only
    previous = {sig: signal.signal(sig, _raise_signalled) for sig in (signal.SIGTERM, signal.SIGHUP)}
    procs: list[subprocess.Popen] = []
    try:
        _start_ranks(command, world_size, store.port, procs)
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:  # a rank failing because a peer went away exits 1; the peer's own bad-input 2 names the run
                _say_signalled(procs, store)
                _stop(procs)
                return _run_status(failed)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    except _Signalled as e:
        for sig in previous:  # a second SIGTERM while the ranks stop (timeout, a job scheduler) changes nothing
            signal.signal(sig, signal.SIG_IGN)
        _stop(procs)
        return 128 + e.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
