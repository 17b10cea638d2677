"""Reshardable checkpoints through real gloo processes (torchrun): a 2-stage GPT-2 checkpoint (tied embedding
and head on the first and last stage) resumes on 1 stage, a 1-stage one on 2 stages, and a 2-replica one on
1 replica; the resumed steps train the same samples as an uninterrupted run and their losses equal its
losses within fp32 tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dynabatch.cli import main
from dynabatch.engine.checkpoint import data_files, step_dir

STEPS, SAVE_AT = 4, 2
RTOL = 1e-5


def _flags(out, toy_mixture_dir, *extra: str) -> list[str]:
    return ["train", "--model", "gpt2-tiny", "--tokenizer", "byt5", "--global-batch-tokens", "1024",
            "--max-input-len", "128", "--max-target-len", "32", "--logging-steps", "0", "--no-timeline",
            "--task-loss-every", "0", "--calibrate", "off", "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
            "--output-dir", str(out),
            "--max-steps", str(STEPS), "--save-steps", str(SAVE_AT), "--timeout-s", "60", *extra]


def _torchrun(out, toy_mixture_dir, *extra: str) -> str:
    """``dynabatch train`` on 2 gloo ranks; returns its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dynabatch",
           *_flags(out, toy_mixture_dir, *extra)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run.stdout + run.stderr


def _in_process(capsys, out, toy_mixture_dir, *extra: str) -> str:
    """``dynabatch train`` in a world of one, in this process; returns its standard error."""
    code = main(_flags(out, toy_mixture_dir, *extra))
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    return err


def _records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _same_continuation(resumed, reference) -> None:
    """The resumed run logged steps SAVE_AT.. with the uninterrupted run's samples and losses."""
    got, want = _records(resumed), _records(reference)[SAVE_AT:]
    assert [r["step"] for r in got] == list(range(SAVE_AT, STEPS))
    assert [r["samples_digest"] for r in got] == [r["samples_digest"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=RTOL), (g["step"], g["loss"], w["loss"])
        assert g["lr"] == pytest.approx(w["lr"], rel=RTOL)


def _checkpoint(out) -> str:
    return step_dir(os.path.join(out, "checkpoints"), SAVE_AT)


def test_two_stage_checkpoint_resumes_on_one_stage_and_a_one_stage_one_on_two(tmp_path, toy_mixture_dir, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    _in_process(capsys, one, toy_mixture_dir)  # uninterrupted 1-stage run, checkpoints at 2 and 4
    _torchrun(two, toy_mixture_dir, "--stages", "2")  # uninterrupted 2-stage run
    assert len(data_files(_checkpoint(two))) == 2  # each stage wrote its own file

    err = _in_process(capsys, tmp_path / "two-to-one", toy_mixture_dir, "--resume-from-checkpoint", _checkpoint(two))
    assert "changed settings apply from step 2" in err and "stages: 2 -> 1" in err
    _same_continuation(tmp_path / "two-to-one", two)

    text = _torchrun(tmp_path / "one-to-two", toy_mixture_dir, "--stages", "2", "--resume-from-checkpoint",
                     _checkpoint(one))
    assert "stages: 1 -> 2" in text
    _same_continuation(tmp_path / "one-to-two", one)


@pytest.mark.slow  # ~35 s; the stage test above covers loading by global names, this one replicas' deduplicated save
def test_two_replica_checkpoint_resumes_on_one_replica(tmp_path, toy_mixture_dir, capsys):
    two = tmp_path / "replicas"
    _torchrun(two, toy_mixture_dir, "--replicas", "2")
    err = _in_process(capsys, tmp_path / "resumed", toy_mixture_dir, "--resume-from-checkpoint", _checkpoint(two))
    assert "replicas: 2 -> 1" in err
    _same_continuation(tmp_path / "resumed", two)
