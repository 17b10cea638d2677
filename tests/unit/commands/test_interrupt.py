"""Ctrl-C: a real ``python -m dynabatch`` process sent SIGINT ends with one line and exit 130, never a traceback.

A training run's line names the step it was on and the newest complete checkpoint to resume from; any other
command's says it was interrupted. A stuck process would fail the test at its timeout, not hang it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

DEADLINE_S = 120.0
"""The longest a test waits for the process to reach the point where it is interrupted, or to exit after."""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DYNABATCH_DEBUG")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _interrupt(proc: subprocess.Popen, ready) -> tuple[int, str]:
    """Wait until ``ready()`` (or the process ends), send SIGINT as Ctrl-C would, and return (exit code, stderr)."""
    deadline = time.monotonic() + DEADLINE_S
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, f"the process ended before it was interrupted: {proc.communicate()[1][-3000:]}"
    assert ready(), "the process never got to the point where the test interrupts it"
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the interrupted process did not exit within {DEADLINE_S:.0f} s: {err[-3000:]}")
    return proc.returncode, err


def _only_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_ctrl_c_in_training_is_one_line_naming_the_newest_checkpoint(tmp_path, toy_mixture_dir):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dynabatch", "train", "--model", "t5-tiny", "--tokenizer", "byt5", "--mixture",
           os.path.join(toy_mixture_dir, "toy.json"), "--global-batch-tokens", "1024", "--max-input-len", "128",
           "--max-target-len", "32", "--output-dir", str(out), "--max-steps", "100000", "--save-steps", "1",
           "--calibrate", "off", "--no-timeline", "--task-loss-every", "0", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    code, err = _interrupt(proc, lambda: any((out / "checkpoints").glob("step-*/manifest.json")))
    assert code == 130, err[-3000:]
    line = _only_line(err)
    m = re.fullmatch(r"dynabatch train: interrupted at step (\d+); the newest checkpoint is (\S+/step-(\d{6})): "
                     r"resume with --resume-from-checkpoint", line)
    assert m, line
    step, checkpoint, saved = int(m.group(1)), m.group(2), int(m.group(3))
    assert 1 <= saved <= step  # a step is saved once it has finished; the interrupted one never is
    assert os.path.isfile(os.path.join(checkpoint, "manifest.json"))
    assert os.path.dirname(checkpoint) == str(out / "checkpoints")


def _torch_loaded(pid: int) -> bool:
    """Whether process ``pid`` has loaded torch: the CLI has entered ``main`` (its heavy imports come after)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


def test_ctrl_c_in_plan_is_one_line(tmp_path):
    # GPT on 4 stages plans for about 5 s on 2 cores after loading torch: interrupted once torch is loaded
    proc = subprocess.Popen([sys.executable, "-m", "dynabatch", "plan", "--model", "gpt", "--stages", "4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    code, err = _interrupt(proc, lambda: _torch_loaded(proc.pid))
    assert code == 130, err[-3000:]
    assert _only_line(err) == "dynabatch plan: interrupted"


def test_launcher_says_the_interrupted_line_without_importing_the_training_stack(tmp_path):
    """``dynabatch train --stages N`` says its Ctrl-C line after the ranks are gone: reading the step and the newest
    checkpoint must not import transformers and the training loop (5-17 s of silence after Ctrl-C on 2 cores)."""
    ckpt = tmp_path / "checkpoints" / "step-000004"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n{"step": 6, "lo')  # a torn last line
    code = ("import sys\n"
            "import dynabatch.engine.launch\n"  # what the launcher has loaded when its ranks are stopped
            "from dynabatch.commands.train import interrupted_run\n"
            f"print(interrupted_run({str(tmp_path)!r}))\n"
            "heavy = [m for m in ('transformers', 'dynabatch.training.trainer', 'dynabatch.models') if m in sys.modules]\n"
            "print('heavy:', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=DEADLINE_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"interrupted at step 6; the newest checkpoint is {ckpt}: resume with" in out.stdout
    assert "heavy: []" in out.stdout
