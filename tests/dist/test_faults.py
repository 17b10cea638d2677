"""Faults of a 2-rank ``dynabatch train`` under torchrun, with real processes and real signals.

* slow start: rank 0 takes longer than ``--timeout-s`` to load its data (``DYNABATCH_SLOW_START_S``);
  rank 1 waits for the first plan under ``--startup-timeout-s`` instead, so the run trains; with a
  startup timeout shorter than the load, rank 1's error says rank 0 did not finish loading in time;
* a rank stopped with SIGSTOP mid-run ends the whole job within ``--timeout-s`` + 10 s (torchrun
  alone would wait 30 s more: a stopped worker never handles its SIGTERM), and the output names it;
* a user error that only rank 0 sees (a malformed row in the mixture): rank 0 prints its own
  ``[rank 0]`` line and exits 2, and torchrun's root cause is rank 0, not the peer that exited after it;
* (no torchrun) only stopped processes whose pid and start time match a peer's are killed.

The slow-start tests need the trainer to call ``engine.faults.maybe_slow_start`` after loading the data.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import LOOPBACK, child_pids, listening_sockets, random_rows, write_jsonl, write_mixture

STAGES = 2


def _cmd(mixture: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(STAGES),
            "-m", "dynabatch", "train", "--model", "gpt2-tiny", "--tokenizer", "byt5", "--mixture", mixture,
            "--global-batch-tokens", "1024", "--max-input-len", "128", "--stages", str(STAGES), "--output-dir", out,
            "--log-every", "0", "--no-timeline", "--task-loss-every", "0", *extra]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DYNABATCH_DEBUG")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def torchrun(mixture: str, out: str, *extra: str, env_extra: dict | None = None, timeout: float = 120):
    return subprocess.run(_cmd(mixture, out, *extra), capture_output=True, text=True, env=_env(**(env_extra or {})),
                          timeout=timeout)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> str:
    """Two small sources: a fast start-up."""
    return write_mixture(tmp_path_factory.mktemp("faults-mixture"), "faults", {"a": (60, 1, 20, 4), "b": (60, 2, 40, 8)})


def _steps(out: str) -> list[int]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.endswith("\n")]


def test_slow_data_loading_waits_under_the_startup_timeout(tmp_path, mixture):
    out = str(tmp_path / "run")
    r = torchrun(mixture, out, "--steps", "2", "--timeout-s", "3", env_extra={"DYNABATCH_SLOW_START_S": "8"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(out) == [0, 1]


def test_startup_timeout_names_rank_0_loading(tmp_path, mixture):
    out = str(tmp_path / "run")
    r = torchrun(mixture, out, "--steps", "2", "--timeout-s", "3", "--startup-timeout-s", "2",
                 env_extra={"DYNABATCH_SLOW_START_S": "20"})
    assert r.returncode != 0
    assert ("dynabatch train: error: [rank 1] PipelineError: rank 1, step 0: rank 0 did not finish loading the data "
            "and planning the first step within startup_timeout_s=2 s; raise --startup-timeout-s") in r.stderr, \
        r.stderr[-3000:]


def _worker_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker with ``RANK=rank`` (a child of the launcher)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(name)
        except (OSError, IndexError, ValueError):
            continue
    return None


def test_stopped_rank_ends_the_job_within_the_timeout(tmp_path, mixture):
    timeout_s = 5
    out = str(tmp_path / "run")
    proc = subprocess.Popen(_cmd(mixture, out, "--steps", "100000", "--timeout-s", str(timeout_s)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    victim = None
    try:
        deadline = time.monotonic() + 90
        while not _steps(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None and _steps(out), "the run did not reach its first step"
        victim = _worker_pid(proc.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        output, _ = proc.communicate(timeout=timeout_s + 30)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if victim is not None:  # never leave a stopped process behind
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(victim, sig)
                except OSError:
                    pass
    assert proc.returncode != 0
    assert took < timeout_s + 10, f"the job took {took:.1f} s to end after the stop\n{output[-3000:]}"
    assert "dynabatch train: error: [rank 0] PipelineError: rank 0 (stage 0, replica 0)" in output, output[-3000:]
    assert "Timed out" in output, output[-3000:]  # a transfer or collective with rank 1, whichever came first
    assert f"killed rank 1 (pid {victim}), which was stopped (SIGSTOP)" in output, output[-3000:]


def _wait_state(pid: int, state: str) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == state:
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} never reached state {state}")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_kill_stopped_peers_kills_only_stopped_processes_it_knows():
    from dynabatch.engine.faults import ProcessId, current_process, kill_stopped_peers

    stopped, running, reused = (subprocess.Popen(["sleep", "30"]) for _ in range(3))
    try:
        for p in (stopped, reused):
            os.kill(p.pid, signal.SIGSTOP)
            _wait_state(p.pid, "T")
        me = current_process()
        ids = [me]
        for p in (stopped, running, reused):
            with open(f"/proc/{p.pid}/stat") as f:
                ids.append(ProcessId(me.host, p.pid, int(f.read().rsplit(")", 1)[1].split()[19])))
        ids[3] = ProcessId(me.host, reused.pid, ids[3].start_ticks + 1)  # same pid, another process
        assert kill_stopped_peers(0, tuple(ids)) == [(1, stopped.pid)]
        assert stopped.wait(timeout=5) == -signal.SIGKILL
        assert running.poll() is None and reused.poll() is None
    finally:
        for p in (stopped, running, reused):
            p.kill()
            p.wait()


def _root_cause(stderr: str) -> str:
    assert "Root Cause (first observed failure):" in stderr, stderr[-3000:]
    return stderr.split("Root Cause (first observed failure):", 1)[1]


def _bad_mixture(tmp_path) -> str:
    """A one-source mixture whose row 7 has no targets: rank 0 finds it while loading, after the ranks started."""
    d = tmp_path / "bad"
    d.mkdir()
    rows = random_rows("a", 20, 1, 20, 4)
    del rows[7]["targets"]
    write_jsonl(d / "a.jsonl", rows)
    with open(d / "bad.json", "w") as f:
        json.dump({"name": "bad", "sources": [{"task": "a", "data_files": "a.jsonl"}]}, f)
    return str(d / "bad.json")


def test_user_error_on_rank_0_is_its_own_line_and_the_root_cause(tmp_path, mixture):
    r = torchrun(_bad_mixture(tmp_path), str(tmp_path / "run"), "--steps", "2", "--timeout-s", "20")
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dynabatch train: error: [rank 0] ")]
    assert len(lines) == 1 and "source 'a', row 7: missing field 'targets'" in lines[0], r.stderr[-3000:]
    ours = r.stderr.split(" failed (exitcode: ", 1)[0]  # what the ranks wrote before torchrun's report
    assert "Traceback" not in ours, ours[-3000:]
    root = _root_cause(r.stderr)
    assert "rank      : 0 (local_rank: 0)" in root and "exitcode  : 2" in root, root
    assert "[rank 0] source 'a', row 7: missing field 'targets'" in root, root  # our line, from the error file
    # rank 1 fails only because rank 0's bad input ended the run: it adds no line (nor a traceback) of its own
    rank1 = [ln for ln in r.stderr.splitlines() if ln.startswith("dynabatch train: error: [rank 1] ")]
    assert not rank1, rank1
    assert "Traceback" not in r.stderr.split("Failures:", 1)[-1], r.stderr[-3000:]  # nor in its error file


def direct(mixture: str, out: str, *extra: str, timeout: float = 120):
    """``dynabatch train --stages 2`` started directly: it launches its own two ranks (dynabatch.engine.launch)."""
    cmd = _cmd(mixture, out, *extra)
    cmd = [sys.executable, *cmd[cmd.index("-m", 3):]]  # drop torch.distributed.run and its flags
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)


def test_direct_launch_trains_on_its_own_ranks(tmp_path, mixture):
    out = str(tmp_path / "run")
    r = direct(mixture, out, "--steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _steps(out) == [0, 1]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert all(len(json.loads(line)["stage_time_measured_s"]) == STAGES for line in f)


def test_direct_launch_exits_2_with_the_rank_s_one_line(tmp_path, mixture):
    """A user error found on rank 0 after the launch: the run exits 2 (torchrun would say 1) with rank 0's line, no
    launcher traceback, and rank 1 is stopped at once instead of waiting out its timeout."""
    start = time.monotonic()
    r = direct(_bad_mixture(tmp_path), str(tmp_path / "run"), "--steps", "2", "--timeout-s", "60")
    assert r.returncode == 2, r.stderr[-3000:]
    assert time.monotonic() - start < 50  # not rank 1's 60 s timeout
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dynabatch train: error: [rank 0] ")]
    assert len(lines) == 1 and "source 'a', row 7: missing field 'targets'" in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    # the launcher hosts the rendezvous store, so rank 1 (if it got to fail before the launcher stopped it) reads
    # that rank 0's bad input failed first, and adds no line: the run's error is one line
    assert r.stderr.count("dynabatch train: error:") == 1, r.stderr[-3000:]
    bad = tmp_path / "bad_flag"
    r = direct(mixture, str(bad), "--steps", "2", "--replicas", "0")  # refused before any rank starts
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and not bad.exists(), r.stderr[-2000:]


def test_direct_launch_passes_sigterm_on_and_leaves_no_rank_behind(tmp_path, mixture):
    """A job scheduler's SIGTERM to the launcher ends every rank (exit 143), not only the launcher. While it trains,
    no socket of the launcher (its rendezvous store) or of a rank listens outside loopback."""
    out = str(tmp_path / "run")
    cmd = _cmd(mixture, out, "--steps", "100000")
    proc = subprocess.Popen([sys.executable, *cmd[cmd.index("-m", 3):]], env=_env(), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not _steps(out) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    ranks = child_pids(proc.pid)
    assert _steps(out) and len(ranks) == STAGES, (ranks, proc.poll())
    listening = listening_sockets([proc.pid, *ranks])
    assert listening and all(addr in LOOPBACK for addr, _ in listening), listening
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]  # stopped and reaped by the launcher


def test_direct_launch_ctrl_c_is_one_line_from_the_launcher(tmp_path, mixture):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) to a run that launched its own ranks: the
    ranks never see it (no rank prints a traceback or a line), the launcher stops them and the run ends with one
    line naming the newest checkpoint, exit 130."""
    out = str(tmp_path / "run")
    cmd = _cmd(mixture, out, "--steps", "100000", "--save-steps", "1", "--log-level", "warning")
    proc = subprocess.Popen([sys.executable, *cmd[cmd.index("-m", 3):]], env=_env(), stderr=subprocess.PIPE, text=True,
                            stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 90
    while not glob.glob(os.path.join(out, "checkpoints", "step-*", "manifest.json")) \
            and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    ranks = child_pids(proc.pid)
    assert proc.poll() is None and len(ranks) == STAGES, (ranks, proc.poll())
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the launcher did not exit within 60 s of Ctrl-C")
    assert proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert re.fullmatch(r"dynabatch train: interrupted at step \d+; the newest checkpoint is \S+/step-\d{6}: "
                        r"resume with --resume-from-checkpoint", lines[0]), lines[0]
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]


@pytest.mark.parametrize("flags, expected", [
    (["--lengths", "/nonexistent/lengths.npz"], "[rank 0] lengths file '/nonexistent/lengths.npz' not found"),
    (["--global-batch-tokens", "0"], "global_batch_tokens must be >= 1, got 0"),
])
def test_bench_on_two_ranks_says_a_bad_input_once(tmp_path, flags, expected):
    """``dynabatch bench --stages 2``: a bad flag value is refused once before the launch; bad input found on rank 0
    after it is rank 0's one line (rank 1, which fails only because rank 0 left, adds no line nor traceback)."""
    cmd = [sys.executable, "-m", "dynabatch", "bench", "--model", "t5-tiny", "--stages", "2", "--timed-steps", "1",
           "--untimed-steps", "0", "--methods", "dynamic", *flags]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=240, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("dynabatch bench: error:") == 1 and expected in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_a_budget_without_one_maximal_sample_per_replica_is_refused_at_start(tmp_path, mixture):
    """2 replicas, a budget of 200 tokens and samples of up to 128 + 32: a global batch may hold one sample, which
    one replica would lack (the planner failed on such a step mid-run); refused before the data loads, in one line."""
    cmd = [sys.executable, "-m", "dynabatch", "train", "--model", "t5-tiny", "--tokenizer", "byt5", "--mixture",
           mixture, "--replicas", "2", "--global-batch-tokens", "200", "--max-input-len", "128", "--max-target-len",
           "32", "--steps", "2", "--output-dir", str(tmp_path / "run")]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("error:") == 1 and "raise it to at least 320" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_a_check_every_rank_makes_alike_is_said_once(tmp_path, mixture):
    """A fresh run into a used folder: both ranks refuse it with the same line (rank 0 decides and shares it); the
    run prints it once, and the folder is untouched."""
    out = tmp_path / "used"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = direct(mixture, str(out), "--steps", "2")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("dynabatch train: error:") == 1 and "is not empty" in r.stderr, r.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["notes.txt"]


@pytest.mark.slow  # ~20 s; test_user_error_on_rank_0_is_its_own_line_and_the_root_cause runs the same path under
# torchrun (rank 1, failing only because rank 0 left, records no traceback in its error file) through train
def test_bench_under_torchrun_a_rank_that_fails_after_rank_0_s_bad_input_records_no_traceback(tmp_path):
    """``torchrun ... dynabatch bench`` where only rank 0 finds the input bad (a sample over the memory budget, found
    while planning): rank 1, waiting in a collective, fails with gloo's "Connection closed by peer". It printed no
    line, but its error file held its traceback, and torchrun's report printed it under "Failures"."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dynabatch",
           "bench", "--model", "gpt2-tiny", "--stages", "2", "--memory-gib", "0.04", "--timed-steps", "1",
           "--untimed-steps", "0", "--methods", "dynamic"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=180, cwd=tmp_path)
    assert r.returncode != 0 and r.stderr.count("dynabatch bench: error: [rank 0] ") == 1, r.stderr[-3000:]
    assert "do not fit alone" in _root_cause(r.stderr), r.stderr[-3000:]
    assert "Traceback" not in r.stderr.split("Failures:", 1)[-1], r.stderr[-3000:]
