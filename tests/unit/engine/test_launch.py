"""The local launcher (``dynabatch train --stages 2`` without torchrun): a rank ended by a signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dynabatch.engine.launch import launch_local

KILLED_RANK_1 = ("import os, signal, time\n"
                 "if os.environ['RANK'] == '1':\n"
                 "    time.sleep(0.5)\n"
                 "    os.kill(os.getpid(), signal.SIGKILL)\n"
                 "time.sleep(60)\n")


def test_a_rank_killed_by_a_signal_is_named_and_exits_128_plus_the_signal(capfd):
    """A rank killed by SIGKILL (the out-of-memory killer, say) prints nothing itself and its peers only see a
    broken connection: the launcher names it, stops the others, and the run exits 137 as a shell says it (it was
    247, ``sys.exit(-9)``)."""
    start = time.monotonic()
    code = launch_local(["-c", KILLED_RANK_1], 2)
    assert code == 137
    assert time.monotonic() - start < 10  # rank 0 (asleep) is stopped at once, not waited for
    err = capfd.readouterr().err
    assert err.count("rank 1 (pid ") == 1 and "was killed by SIGKILL" in err


CRASHED_RANK_1 = ("import os, signal, time\n"
                  "if os.environ['RANK'] == '1':\n"
                  "    time.sleep(0.5)\n"
                  "    os.kill(os.getpid(), signal.SIGSEGV)\n"
                  "time.sleep(60)\n")


def test_a_rank_crashed_in_native_code_is_not_called_out_of_memory(capfd):
    """A SIGSEGV is the rank's own crash, not the out-of-memory killer (which sends only SIGKILL): the line says so."""
    code = launch_local(["-c", CRASHED_RANK_1], 2)
    assert code == 128 + signal.SIGSEGV
    err = capfd.readouterr().err
    assert "rank 1 (pid " in err and "was killed by SIGSEGV (a crash in native code;" in err
    assert "out of memory" not in err


STOPPED_RANK_1 = ("import os, signal, time\n"
                  "import torch.distributed as dist\n"
                  "from dynabatch.engine import faults\n"
                  "dist.init_process_group('gloo')\n"
                  "procs = [None, None]\n"
                  "dist.all_gather_object(procs, faults.current_process())\n"
                  "if dist.get_rank() == 1:\n"
                  "    os.kill(os.getpid(), signal.SIGSTOP)\n"
                  "else:\n"  # rank 0 finds its peer stopped, as fail_fast does after a timeout, and kills it
                  "    while faults._proc_stat(procs[1].pid)[0] != 'T':\n"
                  "        time.sleep(0.05)\n"
                  "    assert faults.kill_stopped_peers(0, tuple(procs)) == [(1, procs[1].pid)]\n"
                  "    time.sleep(1)\n"
                  "    os._exit(1)\n"
                  "time.sleep(60)\n")


def test_a_stopped_rank_a_peer_killed_is_not_guessed_out_of_memory(capfd):
    """A rank stopped (SIGSTOP) is killed by the peer that timed out on it, whose line says so; the launcher added
    'rank 1 was killed by SIGKILL (out of memory, or killed by hand?)', contradicting it."""
    code = launch_local(["-c", STOPPED_RANK_1], 2)
    assert code in (1, 137)
    assert "was killed by" not in capfd.readouterr().err


SLOW_TO_STOP = ("import os, signal, sys, time\n"
                "def stop(*_):\n"
                "    time.sleep(1.5)\n"
                "    sys.exit(143)\n"
                "signal.signal(signal.SIGTERM, stop)\n"
                "open(os.path.join(sys.argv[1], 'started-' + os.environ['RANK']), 'w').close()\n"
                "time.sleep(60)\n")


def test_a_second_sigterm_while_the_ranks_stop_is_no_traceback(tmp_path):
    """``timeout`` or a job scheduler may send SIGTERM twice (to the launcher, then to its process group); the second
    one arriving while the launcher waits for its ranks to stop must not end it with a traceback."""
    launcher = ("import sys\n"
                "from dynabatch.engine.launch import launch_local\n"
                f"sys.exit(launch_local(['-c', {SLOW_TO_STOP!r}, {str(tmp_path)!r}], 2))\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("started-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)  # the launcher is in its wait for the ranks, which take 1.5 s to stop
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]


RANK_OF_THE_CLI = ("import os, sys, time\n"
                   "import dynabatch.cli as cli\n"
                   "def run(argv):\n"  # the command a rank runs, after main() has set the rank up
                   "    open(os.path.join(sys.argv[1], 'rank-' + os.environ['RANK']), 'w').write(str(os.getpid()))\n"
                   "    time.sleep(60)\n"
                   "cli._run_command = run\n"
                   "cli.main([])\n")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launcher_killed_outright_takes_its_ranks_with_it(tmp_path):
    """SIGKILL to the launcher (the out-of-memory killer, ``kill -9``, a scheduler past its grace period) cannot be
    passed on: its ranks trained on as orphans, writing into the output folder a resumed run would then share."""
    launcher = ("import sys\n"
                "from dynabatch.engine.launch import launch_local\n"
                f"sys.exit(launch_local(['-c', {RANK_OF_THE_CLI!r}, {str(tmp_path)!r}], 2))\n")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank-*"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    pids = [int(p.read_text() or 0) for p in tmp_path.glob("rank-*")]
    assert len(pids) == 2 and all(pids), f"the ranks did not start: {proc.stderr.read()[-3000:]}"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"ranks {left} outlived their launcher"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_torchrun_worker_ends_with_its_agent_killed_outright(tmp_path):
    """torchrun starts its workers in sessions of their own and sets nothing to end them with it: an agent killed by
    SIGKILL left them training on. A worker (TORCHELASTIC_RUN_ID set) follows its parent, the agent."""
    agent = ("import os, subprocess, sys, time\n"
             f"subprocess.Popen([sys.executable, '-c', {RANK_OF_THE_CLI!r}, {str(tmp_path)!r}], start_new_session=True,\n"
             "                 env=dict(os.environ, RANK='0', TORCHELASTIC_RUN_ID='none'))\n"
             "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", agent], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("rank-0")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.1)
    pid = int((tmp_path / "rank-0").read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the worker outlived its agent")
