"""Logging (``--log-level``): rank-0 filtering, ``[rank N]`` prefixes, lines that keep the progress bar whole,
and a two-rank run whose log holds every line once and no ``datasets`` progress bars."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
from tqdm import tqdm

from dynabatch.cli import main
from dynabatch.engine.log import log_result, setup_logging
from dynabatch.models.families import check_model
from family_configs import build, decoder_config

BASE = ["--model", "t5-tiny", "--tokenizer", "byt5", "--global-batch-tokens", "1024", "--max-input-len", "128",
        "--max-target-len", "32", "--no-timeline", "--calibrate", "off"]
THIRD_PARTY_BAR = re.compile(r"^\s*(Map|Filter|Generating|Casting|Flattening)\b")
"""The start of a ``datasets`` progress-bar line (``Map: 100%|...| 600/600 [...]``)."""


def _segments(text: str) -> list[str]:
    """The lines of captured output, progress-bar redraws (carriage returns) split apart."""
    return [s for s in re.split(r"[\r\n]", text) if s.strip()]


def test_other_ranks_log_warnings_only_with_their_rank(capsys):
    log = logging.getLogger("dynabatch.training.trainer")
    setup_logging("info", rank=1)
    log.info("step 0: loss 9.1")
    log.warning("disk is slow")
    assert capsys.readouterr().err.splitlines() == ["[rank 1] warning: disk is slow"]
    setup_logging("warning", rank=0)
    log.info("step 0: loss 9.1")
    log.error("checkpoint failed")
    assert capsys.readouterr().err.splitlines() == ["error: checkpoint failed"]
    setup_logging("debug", rank=0)
    setup_logging("info", rank=0)  # replaces the handler: one line per message
    log.debug("details")
    log.info("== summary ==")
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["== summary =="] and captured.out == ""


def test_a_model_warning_is_one_log_line_said_by_rank_0_once(tmp_path, capsys):
    """The start-up check of a length limit above a rotary model's trained positions runs on every rank, and more
    than once on each: the run says it in one ``warning:`` line (no file path, no ``UserWarning:``), on rank 0."""
    folder = str(tmp_path / "llama")
    build(decoder_config("llama", max_position_embeddings=32, num_layers=2)).save_pretrained(folder)
    capsys.readouterr()  # the saving's progress bar
    with warnings.catch_warnings():  # gives back the process's warning printer and filters
        warnings.simplefilter("default")
        setup_logging("info", rank=1)
        check_model(folder, 64)
        assert capsys.readouterr().err == ""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        setup_logging("info", rank=0)
        for _ in range(2):
            check_model(folder, 64)
        with warnings.catch_warnings():  # a filter change clears Python's record of warnings given
            warnings.filterwarnings("ignore", message="unrelated")
        check_model(folder, 64)
        assert capsys.readouterr().err.splitlines() == [
            "warning: the length limit (--max-input-len) is 64 tokens but this llama model was trained for 32 positions "
            "(max_position_embeddings); longer samples use untrained rotary positions"]


@pytest.mark.parametrize("level", ["debug", "info", "warning", "error"])
def test_result_lines_are_printed_at_every_level_without_a_prefix(capsys, level):
    log = logging.getLogger("dynabatch.training.trainer")
    setup_logging(level, rank=0)
    log.info("step 0: loss 9.1")
    log_result(log, "speed-up of dynamic over padding (real tokens/s, same batches): 1.50x")
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "speed-up of dynamic over padding (real tokens/s, same batches): 1.50x"
    assert ("step 0: loss 9.1" in lines) == (level in ("debug", "info"))


def test_a_line_logged_during_the_progress_bar_is_a_line_of_its_own(capsys):
    setup_logging("info", rank=0)
    bar = tqdm(total=3, desc="train dynamic", file=sys.stderr)
    bar.update(1)
    logging.getLogger("dynabatch.training.trainer").info('{"step": 0, "loss": 9.1}')
    bar.update(1)
    bar.close()
    segments = _segments(capsys.readouterr().err)
    assert '{"step": 0, "loss": 9.1}' in segments  # not glued to a bar redraw
    assert any(s.startswith("train dynamic") for s in segments)


def test_warning_level_shows_warnings_but_no_info_lines(tmp_path, toy_mixture_dir, capsys):
    code = main(["train", *BASE, "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--output-dir",
                 str(tmp_path / "o"), "--max-steps", "2", "--logging-steps", "1", "--task-loss-every", "1",
                 "--log-level", "warning", "--resume-from-checkpoint"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    lines = [s for s in _segments(captured.err) if not s.startswith("train dynamic")]  # the bar stays on rank 0
    assert lines[:1] == [f"warning: --resume-from-checkpoint: no complete checkpoint in {tmp_path / 'o' / 'checkpoints'}; starting from "
                         "step 0"], lines
    # the run's result is printed at every level: the summary, and nothing else of the info lines
    assert lines[1:2] == ["== summary =="] and len(lines) == 3 and lines[2].startswith("dynamic: 2 steps, loss "), lines
    assert captured.out == ""
    assert len(_records(tmp_path / "o")) == 2


def _records(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_two_ranks_log_each_line_once_without_third_party_bars(tmp_path, toy_mixture_dir):
    out = tmp_path / "pipe"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    env["OMP_NUM_THREADS"] = "1"  # else torchrun prints a banner about setting it
    env["HF_DATASETS_CACHE"] = str(tmp_path / "hf-cache")  # a fresh cache: datasets builds (with its bars) again
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dynabatch",
           "train", *BASE, "--stages", "2", "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
           "--output-dir", str(out), "--max-steps", "2", "--logging-steps", "1", "--report-to", "tensorboard"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    segments = _segments(run.stdout + run.stderr)
    lines = [s for s in segments if not s.startswith("train dynamic")]
    steps = [json.loads(s)["step"] for s in lines if s.startswith('{"step"')]
    assert steps == [0, 1]  # rank 0's step lines, once each
    assert lines.count("== summary ==") == 1
    assert not [s for s in lines if "[rank 1]" in s]
    assert len(lines) == len(set(lines)), lines
    assert not [s for s in segments if THIRD_PARTY_BAR.match(s)]
    events = glob.glob(str(out / "**" / "events.out.tfevents.*"), recursive=True)
    assert [os.path.dirname(e) for e in events] == [str(out / "runs")]  # rank 0's one event file
