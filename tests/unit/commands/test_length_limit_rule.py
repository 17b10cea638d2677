"""One minimum length limit for every command: ``--max-input-len`` / ``--max-target-len`` (and ``data-report
--max-lens``) of 1 are refused by each command with the same line, exit 2, before anything loads or launches; 2 is
accepted by each (:data:`dynabatch.data.batching.MIN_LENGTH_LIMIT`)."""

from __future__ import annotations

import argparse
import json

import pytest

from dynabatch.cli import main
from dynabatch.commands import bench, bench_run, train
from dynabatch.data.batching import MIN_LENGTH_LIMIT, LengthLimits
from dynabatch.training.config.flags import parse_config

COMMANDS = {  # each command's cheapest arguments around the length flags
    "train": ["--model", "t5-tiny", "--tokenizer", "byt5", "--steps", "1"],
    "plan": ["--model", "t5", "--num-batches", "1"],
    "simulate": ["--model", "t5", "--num-batches", "1"],
    "bench": ["--model", "t5-tiny", "--stages", "2"],
    "data-report": ["--family", "t5", "--num-batches", "1"],
}
FLAGS = {command: ("--max-input-len", "--max-target-len") for command in COMMANDS} | {
    "data-report": ("--max-target-len",)}


def _error(capsys, argv: list[str]) -> str:
    """The one error line of ``dynabatch ARGV``, asserting exit 2."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1, err[-2000:]
    return lines[0].split(": error: ", 1)[1]


def test_the_rule_is_two_tokens():
    assert MIN_LENGTH_LIMIT == 2
    LengthLimits("seq2seq", max_input_len=2, max_target_len=2, max_seq_len=2)
    with pytest.raises(ValueError, match=r"^max_seq_len must be >= 2 \(a sample keeps its EOS and one token\), got 1$"):
        LengthLimits("causal", max_seq_len=1)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_length_limit_of_one_is_refused_alike_by_every_command(command, capsys, tmp_path):
    extra = ["--output-dir", str(tmp_path / "out")] if command == "train" else []
    for flag in FLAGS[command]:
        msg = _error(capsys, [command, *COMMANDS[command], *extra, flag, "1"])
        assert msg == f"{flag} must be >= 2 (a sample keeps its EOS and one token), got 1"
    assert not (tmp_path / "out").exists()


def test_data_report_max_lens_of_one_is_refused_by_the_same_rule(capsys):
    msg = _error(capsys, ["data-report", *COMMANDS["data-report"], "--max-lens", "512,1"])
    assert msg == ("--max-lens takes a comma list of integers >= 2 (a sample keeps its EOS and one token; "
                   "e.g. 512,1024), got '512,1'")


def test_a_config_file_length_of_one_names_the_file(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("max_target_len: 1\n")
    msg = _error(capsys, ["train", "--config", str(config), "--output-dir", str(tmp_path / "out")])
    assert msg == f"config file {config}: --max-target-len must be >= 2 (a sample keeps its EOS and one token), got 1"


def _parsed(module, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_train_and_bench_accept_two():
    """``train``'s config and ``bench``'s checks before its launch accept the smallest limit (bench's derived
    ``--max-target-len`` default keeps to the rule too, rather than refusing a value the user never gave)."""
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    cfg = parse_config(p, ["--max-input-len", "2", "--max-target-len", "2", "--global-batch-tokens", "8"])[1]
    assert (cfg.max_input_len, cfg.max_target_len) == (2, 2)
    args = _parsed(bench, ["--model", "t5-tiny", "--max-input-len", "4"])
    bench_run.resolve_defaults(args)
    assert args.max_target_len == 2  # 4 // 4 is 1, under the rule: the default is the rule's minimum


@pytest.fixture
def tiny_lengths(tmp_path) -> str:
    path = tmp_path / "tiny.jsonl"  # 1-token samples are samples: the rule is on limits, not on sample lengths
    path.write_text("".join(json.dumps({"input_len": 1 + i % 2, "target_len": 1 + i % 2}) + "\n" for i in range(40)))
    return str(path)


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_plan_and_simulate_accept_two(command, tiny_lengths, capsys):
    code = main([command, *COMMANDS[command], "--lengths", tiny_lengths, "--methods", "dynamic,padding",
                 "--global-batch-tokens", "64", "--max-input-len", "2", "--max-target-len", "2"])
    assert code == 0, capsys.readouterr().err[-2000:]


def test_data_report_accepts_two(capsys, toy_mixture_dir):
    code = main(["data-report", *COMMANDS["data-report"], "--mixture", f"{toy_mixture_dir}/toy.json", "--methods",
                 "padding", "--global-batch-tokens", "64", "--max-lens", "2", "--max-target-len", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "padding" in out
