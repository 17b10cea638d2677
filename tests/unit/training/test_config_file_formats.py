"""``--config`` files in YAML, JSON or TOML (by their ending) mean the same config; a key given twice, a syntax error
or another ending is one line naming the file; ``report_to`` may be a list in a file, as Hugging Face's
``TrainingArguments`` takes it, and stays comma-separated text on the command line."""

from __future__ import annotations

import argparse
import json

import pytest

from dynabatch.cli import main
from dynabatch.commands import train
from dynabatch.training.config import TrainConfig
from dynabatch.training.config.flags import load_config_file, parse_config, write_config_file


def _train(argv: list[str]) -> TrainConfig:
    """The config ``dynabatch train ARGV`` runs (train's own parser)."""
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    return parse_config(p, argv)[1]


def _error(capsys, tmp_path, config) -> str:
    """The one error line of ``dynabatch train --config CONFIG``, asserting exit 2 and that nothing was written."""
    code = main(["train", "--config", str(config), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dynabatch train: error: "), err[-2000:]
    assert not (tmp_path / "out").exists()
    return lines[0].removeprefix("dynabatch train: error: ")


def test_toml_flat_or_nested_means_what_yaml_and_json_mean(tmp_path):
    (tmp_path / "run.toml").write_text('method = "packing"\nsteps = 9\n\n[optim]\nlr = 3e-4\n\n[pipeline]\nstages = 2\n')
    (tmp_path / "run.yaml").write_text("method: packing\nsteps: 9\noptim:\n  lr: 3e-4\npipeline:\n  stages: 2\n")
    (tmp_path / "run.json").write_text(json.dumps({"method": "packing", "max_steps": 9, "learning_rate": 3e-4,
                                                   "stages": 2}))
    files = [str(tmp_path / f"run.{ext}") for ext in ("toml", "yaml", "json")]
    assert [load_config_file(f) for f in files] == [
        {"method": "packing", "max_steps": 9, "learning_rate": 3e-4, "stages": 2}] * 3
    cfg = _train(["--config", files[0], "--max-steps", "20"])  # flags win over the file, as with YAML
    assert (cfg.method, cfg.max_steps, cfg.learning_rate, cfg.stages) == ("packing", 20, 3e-4, 2)


def test_a_toml_key_given_twice_is_one_line_naming_file_key_and_lines(tmp_path, capsys):
    twice = tmp_path / "twice.toml"
    twice.write_text('seed = 1\n[optim]\nlearning_rate = 0.1\nwarmup_steps = 2\nlearning_rate = 0.2\n')
    assert _error(capsys, tmp_path, twice) == (f"config file {twice}: key 'learning_rate' is given twice (line 5, "
                                               "first at line 3); keep one")
    table = tmp_path / "table.toml"
    table.write_text('[optim]\nseed = 1\n[pipeline]\nstages = 2\n[optim]\nwarmup_steps = 2\n')
    assert _error(capsys, tmp_path, table) == (f"config file {table}: table [optim] is given twice (line 5, first "
                                               "at line 1); keep one")


def test_a_toml_syntax_error_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("seed = 1\nlearning_rate = \n")
    assert _error(capsys, tmp_path, bad) == (f"config file {bad}: TOML syntax error at line 2, column 17: Invalid "
                                             "value; fix the file")


@pytest.mark.parametrize("name", ["run.ini", "run.cfg", "run"])
def test_another_ending_says_which_formats_are_read(name, tmp_path, capsys):
    config = tmp_path / name
    config.write_text("seed = 1\n")
    ending = "no ending" if "." not in name else f"'.{name.split('.')[1]}'"
    assert _error(capsys, tmp_path, config) == (f"config file {config}: unknown file type ({ending}); accepted: "
                                                ".yaml, .yml, .json, .toml (YAML, JSON or TOML by that ending): "
                                                "rename or convert the file")


def test_report_to_as_a_list_in_a_file_and_comma_text_on_the_command_line(tmp_path):
    for text, want in (("report_to: [tensorboard]\n", "tensorboard"), ("report_to: [tensorboard, wandb]\n",
                                                                         "tensorboard,wandb"),
                       ("report_to: []\n", "none"), ("report_to: all\n", "all"), ("report_to: none\n", "none")):
        (tmp_path / "r.yaml").write_text(text)
        assert _train(["--config", str(tmp_path / "r.yaml")]).report_to == want, text
    (tmp_path / "r.toml").write_text('[logging]\nreport_to = ["tensorboard"]\n')
    assert _train(["--config", str(tmp_path / "r.toml")]).report_to == "tensorboard"
    assert _train(["--report-to", "tensorboard,wandb"]).report_to == "tensorboard,wandb"
    assert _train(["--report-to", "all"]).report_to == "all"
    cfg = _train(["--config", str(tmp_path / "r.toml")])  # the run's config.yaml records the text and reads back
    write_config_file(str(tmp_path / "config.yaml"), cfg)
    assert "report_to: tensorboard\n" in (tmp_path / "config.yaml").read_text()
    assert _train(["--config", str(tmp_path / "config.yaml")]) == cfg


def test_a_report_to_list_with_an_unknown_or_odd_entry_is_one_line(tmp_path, capsys):
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("report_to: [tensorboard, mlflow]\n")
    assert _error(capsys, tmp_path, unknown) == (f"config file {unknown}: report_to: unknown tracker 'mlflow'; "
                                                 "valid: tensorboard, wandb, all, none")
    odd = tmp_path / "odd.yaml"
    odd.write_text("report_to: [tensorboard, 3]\n")
    assert _error(capsys, tmp_path, odd) == (f"config file {odd}: report_to: a list holds tracker names "
                                             "(tensorboard, wandb, all, none), got 3")
