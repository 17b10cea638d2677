"""Two levels of help (issue 42, item 1): ``--help`` lists the basic options a run needs, ``--help-all`` every
option with the research switches in an ``experimental`` group; both come from the fields' ``level`` metadata.
An option shared by several commands accepts the same choices in each."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

import numpy as np
import pytest

from dynabatch.cli import command_parser, main
from dynabatch.training.config import SECTIONS, TrainConfig
from dynabatch.training.config.flags import add_help_levels, add_sections, basic_help
from dynabatch.training.config.sections import arg, experimental

COMMANDS = ("train", "bench", "plan", "simulate", "profile", "data-report")


def _listed(text: str) -> list[str]:
    """The options a help text lists: the first ``--flag`` of every line that starts with one."""
    return [m.group(1) for m in re.finditer(r"^  (--[\w-]+)", text, re.M)]


def _level(name: str) -> str:
    return TrainConfig.__dataclass_fields__[name].metadata["level"]


def test_train_help_lists_the_basic_fields_one_line_each_within_32(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    listed = _listed(text)
    basic = [f.name for s in SECTIONS for f in dataclasses.fields(s) if f.metadata["level"] == "basic"]
    assert listed == ["--help", "--help-all", "--config", *("--" + n.replace("_", "-") for n in basic)]
    assert len(listed) <= 32
    for name in ("model", "tokenizer", "mixture", "data", "max_input_len", "global_batch_tokens", "stages",
                 "replicas", "memory_gib", "dtype", "device", "learning_rate", "lr_scheduler_type", "max_steps",
                 "seed", "output_dir", "save_steps", "logging_steps", "report_to", "eval_mixture"):
        assert _level(name) == "basic", name
    for line in text.splitlines():
        if line.startswith("  --learning-rate") or line.startswith("  --max-steps"):
            assert "(default: " in line  # one line: flag, what it does, its default
    hidden = len(dataclasses.fields(TrainConfig)) - len(basic)
    assert f"{hidden} more options" in text and "--help-all" in text.splitlines()[-1]


def test_help_all_lists_every_field_and_the_research_switches_apart(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    text = capsys.readouterr().out
    listed = set(re.findall(r"(--[\w-]+)", text))
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in listed, f.name
    _, p = command_parser("train")
    group = next(g for g in p._action_groups if g.title == "experimental")
    in_group = {a.dest for a in group._group_actions}
    assert in_group == {f.name for f in dataclasses.fields(TrainConfig) if f.metadata["level"] == "experimental"}
    for name in ("placement", "layer_split", "split_blocks", "recompute", "cost_profile", "calibrate", "plan_costs",
                 "planner", "attention", "attention_kernel", "pack_rows", "plan_candidates", "timeout_s",
                 "packing_rows", "policy"):
        assert name in in_group, name
    assert p._action_groups[-1] is group  # listed last


def test_both_levels_follow_the_level_metadata():
    """Nothing is listed by hand: a section's field marked experimental leaves ``--help`` and joins the group."""

    @dataclasses.dataclass(frozen=True)
    class Toy:
        _argument_group_name = "toy"
        alpha: int = arg(1, "the basic one")
        beta: int = experimental(2, "a research switch")

    p = argparse.ArgumentParser(prog="toy", add_help=False)
    add_help_levels(p)
    add_sections(p, [Toy])
    assert _listed(basic_help(p)) == ["--help", "--help-all", "--alpha"]
    full = p.format_help()
    assert "--beta" in full.split("experimental:")[1] and "1 more options" in basic_help(p)
    assert p.parse_args(["--beta", "5"]).beta == 5  # a hidden flag still parses


def test_help_text_carries_no_measurements():
    for f in dataclasses.fields(TrainConfig):
        text = f.metadata["help"]
        assert not re.search(r"measured (faster|slower)|\d\.\d+x|docs/benchmarks", text), (f.name, text)


def _train_fields() -> dict[str, argparse.Action]:
    return {a.dest: a for a in command_parser("train")[1]._actions if a.option_strings}


@pytest.mark.parametrize("command", COMMANDS[1:])
def test_a_shared_option_takes_the_same_choices_in_every_command(command):
    train = _train_fields()
    shared = 0
    for action in command_parser(command)[1]._actions:
        if action.dest not in TrainConfig.__dataclass_fields__ or not action.option_strings:
            continue
        shared += 1
        mine = train[action.dest]
        assert list(action.choices or ()) == list(mine.choices or ()), (command, action.dest)
        kinds = [getattr(a.type, "__name__", None) for a in (action, mine)]  # a choice's type is a fresh lambda
        assert (kinds[0], action.nargs) == (kinds[1], mine.nargs), (command, action.dest)
    assert shared


def test_simulate_takes_placement_auto_as_train_does(tmp_path, capsys):
    """``--placement auto`` in simulate: linear and the family's virtual stages simulated, one kept by train's rule."""
    rng = np.random.default_rng(0)
    lengths = str(tmp_path / "lengths.npz")
    e = rng.integers(50, 400, 60)
    np.savez(lengths, input_len=e, target_len=np.ones_like(e))
    args = ["simulate", "--lengths", lengths, "--model", "gpt", "--preset", "gpt-1.3b", "--stages", "4",
            "--num-batches", "1", "--global-batch-tokens", "8192", "--methods", "dynamic", "--json"]
    assert main([*args, "--placement", "auto"]) == 0
    auto = json.loads(capsys.readouterr().out)["methods"]["dynamic"]
    runs = {}
    for name in ("linear", "interleaved:2"):
        assert main([*args, "--placement", name]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["methods"]["dynamic"]
    from dynabatch.training.config.placement_choice import pick_placement

    chosen = pick_placement({k: r["step_s"] for k, r in runs.items()}, {"linear": 1, "interleaved:2": 2})
    assert auto["step_s"] == runs[chosen]["step_s"] and auto["placement"] == chosen  # and the JSON says which
    assert runs["interleaved:2"]["placement"] == "interleaved:2"
    assert main([*args, "--placement", "zigzag"]) == 2
    assert "or auto" in capsys.readouterr().err


@pytest.mark.parametrize("level", ["--help", "--help-all"])
def test_both_help_levels_start_with_a_short_usage_naming_the_positional_arguments(level, capsys):
    with pytest.raises(SystemExit):
        main(["export", level])
    assert capsys.readouterr().out.splitlines()[0] == "usage: dynabatch export [options] checkpoint out"
    with pytest.raises(SystemExit):
        main(["train", level])
    assert capsys.readouterr().out.splitlines()[:2] == ["usage: dynabatch train [options]", ""]


def test_help_all_names_each_flag_once_without_its_underscore_twin(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    text = capsys.readouterr().out
    assert not re.search(r"--\w+_\w+", text)  # the --name_with_underscores spellings parse but are not listed
    assert "  --max-input-len MAX_INPUT_LEN\n" in text and "  --dtype {fp32,bf16,fp16}\n" in text
    assert "  --full-determinism [true|false]\n" in text and "[FULL_DETERMINISM]" not in text
    assert "  --learning-rate, --lr LEARNING_RATE\n" in text  # other aliases stay, the value named once
    _, p = command_parser("train")
    assert p.parse_args(["--max_input_len", "64"]).max_input_len == 64


def test_top_level_help_says_what_the_tool_is_and_where_the_options_are(capsys):
    assert main([]) == 0
    text = capsys.readouterr().out
    assert "micro-batching" in text.split("positional arguments")[0]
    assert "``" not in text and "module" not in text
    assert "dynabatch COMMAND --help" in " ".join(text.split())


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_no_python_module_for_a_user_to_read(command, capsys):
    """A user reads ``--help`` in a terminal: it said ``dynabatch.model_presets`` where the preset names belong."""
    with pytest.raises(SystemExit):
        main([command, "--help-all"])
    text = capsys.readouterr().out
    assert not re.findall(r"dynabatch\.[a-z_]+", text)
    assert "TrainConfig" not in text  # --config named the Python class its file fills


def test_a_refused_flag_value_names_the_flag_as_help_spells_it(capsys):
    assert main(["train", "--bad-rows", "maybe"]) == 2
    err = capsys.readouterr().err
    assert "argument --bad-rows: invalid choice: 'maybe'" in err and "--bad_rows" not in err
    assert main(["train", "--lr", "x"]) == 2
    assert "argument --learning-rate/--lr: invalid float value: 'x'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "simulate", "bench"])
def test_tune_baselines_help_says_which_settings_it_tries(command):
    from dynabatch.data.baselines import baseline_spec

    action = next(a for a in command_parser(command)[1]._actions if a.dest == "tune_baselines")
    rows = ", ".join(map(str, baseline_spec("packing_free").grid))
    assert f"packing_free: {rows} rows per micro-batch" in action.help and "knob" not in action.help


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_plan_and_simulate_take_cost_profile_as_an_experimental_flag(command, capsys):
    """plan and simulate take train's --cost-profile (an experimental field, listed by --help-all alone), so their
    --split-blocks and --recompute help (train's text) may say what happens with one."""
    with pytest.raises(SystemExit):
        main([command, "--help-all"])
    text = capsys.readouterr().out
    assert "--cost-profile" in _listed(text) and "--split-blocks" in text and "--recompute" in text
    assert _level("cost_profile") == "experimental"
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--cost-profile" not in _listed(capsys.readouterr().out)
