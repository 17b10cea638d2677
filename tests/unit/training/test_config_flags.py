"""One configuration (issue 18, item 3): typed sections, one flag generator for every command, HF-style names
with today's names as aliases, defaults in ``--help``, config files flat or nested by section."""

from __future__ import annotations

import argparse
import importlib
import json
import os

import pytest

from dynabatch.cli import COMMANDS
from dynabatch.training.config import SECTIONS, TrainConfig, canonical
from dynabatch.training.config.flags import HelpFormatter, add_config_arguments, load_config_file, parse_config

FLAG_COMMANDS = ("train", "bench", "plan", "simulate", "profile", "data-report")


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"dynabatch {command}", formatter_class=HelpFormatter)
    importlib.import_module(COMMANDS[command][0]).add_arguments(p)
    return p


def _train(argv: list[str]) -> TrainConfig:
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return parse_config(p, argv)[1]


def test_hf_names_and_todays_names_give_the_same_config():
    new = _train(["--learning-rate", "3e-4", "--max-steps", "7", "--save-steps", "2", "--save-total-limit", "3",
                  "--logging-steps", "0", "--lr-scheduler-type", "cosine", "--resume-from-checkpoint"])
    old = _train(["--lr", "3e-4", "--steps", "7", "--checkpoint-every", "2", "--keep-checkpoints", "3",
                  "--log-every", "0", "--lr-schedule", "cosine", "--resume"])
    underscores = _train(["--learning_rate", "3e-4", "--max_steps", "7", "--save_steps", "2", "--save_total_limit", "3",
                          "--logging_steps", "0", "--lr_scheduler_type", "cosine", "--resume_from_checkpoint", "latest"])
    assert new == old == underscores
    assert (new.learning_rate, new.max_steps, new.save_steps, new.resume_from_checkpoint) == (3e-4, 7, 2, "latest")
    assert _train([]).resume_from_checkpoint is None
    assert _train(["--resume-from-checkpoint", "runs/x/checkpoints/step-000004"]).resume_from_checkpoint.endswith("04")
    assert TrainConfig.of(lr=1e-4, steps=3, resume=True) == TrainConfig(learning_rate=1e-4, max_steps=3,
                                                                          resume_from_checkpoint="latest")
    with pytest.raises(ValueError, match="older name of learning_rate"):
        canonical({"lr": 1e-3, "learning_rate": 1e-3})
    with pytest.raises(ValueError, match=r"unknown TrainConfig fields \['stepz'\]"):
        TrainConfig.of(stepz=3)


def test_bools_and_choices_come_from_the_field_types():
    cfg = _train(["--no-timeline", "--slice-long", "--model", "gpt2-tiny", "--overwrite-output-dir", "false"])
    assert (cfg.timeline, cfg.slice_long, cfg.overwrite_output_dir) == (False, True, False)
    with pytest.raises(SystemExit):  # argparse: not one of the Literal's choices
        _train(["--policy", "zigzag"])
    with pytest.raises(ValueError, match="policy must be one of gpipe, 1f1b, adaptive, auto, per_step; got 'zigzag'"):
        TrainConfig(policy="zigzag")
    with pytest.raises(ValueError, match="report_to: unknown tracker 'mlflow'"):
        TrainConfig(report_to="tensorboard,mlflow")
    assert TrainConfig(report_to=" TensorBoard").report_to == "tensorboard"  # names in any case, as typed in docs
    assert TrainConfig(report_to=["TensorBoard", "WandB"]).report_to == "tensorboard,wandb"


def test_config_file_flat_or_nested_with_older_names_and_flags_on_top(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text("optim:\n  lr: 3e-4\n  max_steps: 9\npipeline:\n  stages: 2\nmethod: packing\n")
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"learning_rate": 3e-4, "steps": 9, "stages": 2, "method": "packing"}))
    assert load_config_file(str(nested)) == load_config_file(str(flat)) == {
        "learning_rate": 3e-4, "max_steps": 9, "stages": 2, "method": "packing"}
    cfg = _train(["--config", str(nested), "--max-steps", "20"])  # 20 is the default: given, so it wins
    assert (cfg.learning_rate, cfg.max_steps, cfg.stages) == (3e-4, 20, 2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  stages: 2\n")
    with pytest.raises(ValueError, match="section 'optim' has no field 'stages'"):
        load_config_file(str(bad))
    both = tmp_path / "both.yaml"  # an older name and its new one in one section: the message names the file
    both.write_text("optim:\n  lr: 0.5\n  learning_rate: 0.002\n")
    with pytest.raises(ValueError, match=r"^config file .*both.yaml, section 'optim': lr is an older name of "
                                         "learning_rate; give one of them$"):
        load_config_file(str(both))
    # A config's sections round-trip through a nested file.
    out = tmp_path / "round.json"
    out.write_text(json.dumps(cfg.sections()))
    assert TrainConfig(**load_config_file(str(out))) == cfg


def test_every_field_is_in_exactly_one_section_with_help():
    names = [f for s in SECTIONS for f in s.__dataclass_fields__]
    assert len(names) == len(set(names)) == len(TrainConfig.__dataclass_fields__)
    for s in SECTIONS:
        for f in s.__dataclass_fields__.values():
            assert f.metadata.get("help"), f"{s.__name__}.{f.name} has no help"


@pytest.mark.parametrize("command", FLAG_COMMANDS)
def test_every_flag_has_help_and_help_shows_defaults(command):
    p = _parser(command)
    for action in p._actions:
        if action.dest != "help":
            assert action.help, f"dynabatch {command} {action.option_strings} has no help"
    text = p.format_help()
    assert "(default: " in text


def test_a_flag_means_the_same_field_in_every_command():
    """A flag's main spelling (its first option string) names the same destination wherever it appears,
    and a field shared with ``train`` keeps train's flag names (older aliases may differ)."""
    seen: dict[str, tuple[str, str]] = {}
    train_dests = {a.dest for a in _parser("train")._actions}
    for command in FLAG_COMMANDS:
        for action in _parser(command)._actions:
            if not action.option_strings or action.dest == "help":
                continue
            main = action.option_strings[0]
            if main in seen:
                assert seen[main][1] == action.dest, (main, command, seen[main])
            seen[main] = (command, action.dest)
            if action.dest in train_dests and main.startswith("--") and not main.startswith("--no-"):
                assert main == "--" + action.dest.replace("_", "-"), (command, main)


def test_baseline_knob_defaults_agree_between_commands():
    knobs = ("samples_per_micro_batch", "token_budget_tokens", "packing_rows", "packing_free_rows")
    train = vars(_parser("train").parse_args([]))
    for command in ("bench", "plan", "simulate", "data-report"):
        args = vars(_parser(command).parse_args([]))
        assert {k: args[k] for k in knobs} == {k: train[k] for k in knobs}, command


def test_plan_takes_an_analytic_preset_as_model_and_refuses_an_unknown_one(capsys):
    from dynabatch.cli import main

    small = ["--num-batches", "1", "--methods", "padding", "--global-batch-tokens", "4096", "--max-input-len", "512",
             "--json"]
    # t5: the built-in mixture tokenized for t5 is the one test_gpu_bench and test_hf_integration load too (each
    # family's tokenization costs ~30 s once per test run; no default-suite test needs it for gpt)
    assert main(["plan", "--model", "t5-base", *small]) == 0
    by_preset = json.loads(capsys.readouterr().out)
    assert main(["plan", "--model", "t5", "--preset", "t5-base", *small]) == 0
    keys = ("real_tokens", "computed_tokens", "micro_batches")
    again = json.loads(capsys.readouterr().out)["methods"]["padding"]
    assert {k: again[k] for k in keys} == {k: by_preset["methods"]["padding"][k] for k in keys}
    assert main(["plan", "--model", "gpt-7z", "--num-batches", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither an analytic preset" in err[0]
    # a --preset of another family than --model's was a NameError traceback; with --model not a family, --preset
    # silently replaced it
    for model, said in (("gpt", "--preset t5-base is a seq2seq model but --model gpt is a causal family"),
                        ("t5-d256", "--preset t5-base names the analytic preset of a family given as --model")):
        assert main(["plan", "--model", model, "--preset", "t5-base", *small]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0] and "Traceback" not in err[0], err


def test_plan_and_simulate_price_a_model_preset_or_folder_that_train_runs(capsys, tmp_path):
    """``--model`` of plan and simulate also takes what ``train`` takes, a model preset or a local checkpoint folder
    (only its config.json is read), priced analytically from its config on ``--hardware``: a user sees the plans for
    their own model before a run. A folder of an unsupported model is one line."""
    from transformers import AutoConfig

    from dynabatch.cli import main
    from dynabatch.model_presets import build_config

    lengths = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "heavy_tail_1024.npz")
    small = ["--num-batches", "1", "--methods", "dynamic,padding", "--global-batch-tokens", "8192", "--max-input-len",
             "1024", "--stages", "2", "--hardware", "cpu", "--lengths", lengths, "--json"]
    assert main(["plan", "--model", "t5-d256", "--max-target-len", "128", *small]) == 0
    t5 = json.loads(capsys.readouterr().out)
    assert t5["baselines_compared"] == "fitting" and t5["best_baseline"] == "padding"  # plan names it, as simulate does
    assert t5["layout"].count("t5_encoder") and "t5_decoderx4" in t5["layout"].replace(" ", "")  # t5-d256's 4 + 4 blocks
    states = {}
    for layers in (2, 4):  # a config, no weights: nothing loads
        build_config("llama-tiny").__class__(**{**build_config("llama-tiny").to_dict(),
                                               "num_hidden_layers": layers}).save_pretrained(tmp_path / f"llama{layers}")
    for command, layers in (("plan", 2), ("simulate", 2), ("plan", 4)):
        folder = str(tmp_path / f"llama{layers}")
        assert main([command, "--model", folder, *small]) == 0, command
        out = json.loads(capsys.readouterr().out)
        assert out["model"] == folder and "lm_head" in out["layout"] and out["methods"]["dynamic"], command
        states[layers] = sum(out["model_states"]["model_state_gib_per_device"])
    assert states[4] > states[2]  # the folder's own config is priced: two more blocks, more states
    # packing_free's rows of 4 samples (up to 8,192 tokens each) outgrow 6 GiB in any schedule, so no whole-sample
    # baseline fits: the ratio says it is against those
    long_tail = ["--lengths", lengths.replace("heavy_tail_1024", "long_tail_32k"), "--max-input-len", "8192",
                 "--global-batch-tokens", "32768", "--memory-gib", "6", "--packing-free-rows", "4", "--num-batches",
                 "10", "--methods", "dynamic,packing_free", "--stages", "2", "--hardware", "cpu"]
    assert main(["plan", "--model", "t5-d256", *long_tail]) == 0
    said = capsys.readouterr().out
    assert ("dynamic vs best baseline (packing_free; no whole-sample baseline fits the memory: the best of those that do not; "
            "predicted step time)") in said, said[-1500:]
    AutoConfig.for_model("bart").save_pretrained(tmp_path / "bart")
    assert main(["plan", "--model", str(tmp_path / "bart"), *small]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bart" in err[0], err


@pytest.mark.parametrize("command", ("plan", "simulate"))
def test_plan_and_simulate_json_record_the_flags_that_reproduce_it(command, capsys):
    """plan's and simulate's JSON hold every flag under ``config``, as bench's does: the results alone did not say the
    hardware preset, batch size or baseline knobs, and the numbers could not be had again from the file. Run again
    from its ``config``, the command gives the same numbers."""
    from dynabatch.cli import main

    argv = [command, "--model", "t5-d256", "--hardware", "cpu", "--stages", "2", "--num-batches", "1", "--methods",
            "dynamic,packing_free", "--global-batch-tokens", "4096", "--max-input-len", "512", "--packing-free-rows",
            "2", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    config = first["config"]
    assert (config["hardware"], config["global_batch_tokens"], config["packing_free_rows"]) == ("cpu", 4096, 2)
    again = [command]
    for key, value in config.items():
        if value is not None and value is not False:
            again += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    assert main([*again, "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    keys = ("real_tokens", "computed_tokens", "micro_batches", "predicted_step_s" if command == "plan" else "step_s")
    for m in ("dynamic", "packing_free"):
        assert {k: second["methods"][m][k] for k in keys} == {k: first["methods"][m][k] for k in keys}


@pytest.mark.parametrize("command", ("bench", "plan", "simulate"))
def test_json_means_stdout_without_a_path_and_a_file_with_one(command, tmp_path):
    p = _parser(command)
    assert p.parse_args(["--json"]).json == "-"
    assert p.parse_args(["--json", str(tmp_path / "r.json")]).json == str(tmp_path / "r.json")


def test_simulate_json_to_a_file_also_prints_the_table(tmp_path, capsys):
    from dynabatch.cli import main

    out = tmp_path / "sim.json"
    assert main(["simulate", "--model", "t5", "--num-batches", "1", "--methods", "padding", "--global-batch-tokens",
                 "4096", "--max-input-len", "512", "--json", str(out)]) == 0
    assert "padding" in capsys.readouterr().out and json.loads(out.read_text())["methods"]["padding"]


def test_a_flag_at_odds_with_a_config_file_value_is_refused_at_parse_time_naming_both(tmp_path):
    """A run's config.yaml holds plan_costs resolved (calibrated for T5): --full-determinism on top of it is refused
    when the flags are parsed, naming the file, which value came from where, and the flag that reconciles them."""
    run = tmp_path / "config.yaml"
    run.write_text("experimental:\n  plan_costs: calibrated\n")
    with pytest.raises(ValueError, match=r"^config file .*config.yaml: full_determinism plans with costs that do not "
                                         r"depend on measured times; plan_costs 'calibrated' follows the online fit: "
                                         r"pass --plan-costs base \(or auto\) with --full-determinism, or drop "
                                         r"--full-determinism \(plan_costs from the file, --full-determinism from "
                                         r"the command line\)$"):
        _train(["--config", str(run), "--full-determinism"])
    cfg = _train(["--config", str(run), "--full-determinism", "--plan-costs", "base"])
    assert (cfg.full_determinism, cfg.plan_costs) == (True, "base")
    with pytest.raises(ValueError, match=r"^full_determinism plans .* or drop --full-determinism$"):
        TrainConfig(full_determinism=True, plan_costs="scaled")  # refused where the configuration is made


def test_a_config_file_integer_given_as_a_float_says_whole_number(tmp_path):
    bad = tmp_path / "seed.yaml"
    bad.write_text("seed: 1e3\n")  # YAML 1.1 reads it as a string
    with pytest.raises(ValueError, match=r"^config file .*seed.yaml: seed must be a whole number, got '1e3'$"):
        load_config_file(str(bad))


def test_columns_are_recorded_in_one_spelling_whatever_their_order():
    """config.yaml and a resume's comparison record --columns canonically: the same mapping given in another order
    or with spaces is the same setting (a resume refused 'targets=a,inputs=q' -> 'inputs=q,targets=a')."""
    from dynabatch.training.config.paths import canonical_columns, run_paths

    spellings = ["inputs=q,targets=a,task=t", "targets=a, inputs=q ,task=t", "task=t,targets=a,inputs=q"]
    assert {canonical_columns(s) for s in spellings} == {"task=t,inputs=q,targets=a"}
    assert run_paths({"columns": "targets=a,inputs=q"}) == run_paths({"columns": "inputs=q, targets=a"})


def test_a_calibration_file_with_calibration_off_is_refused_not_ignored(tmp_path):
    with pytest.raises(ValueError, match=r"^calibration_file 'c.json' warm-starts the online calibration, which "
                                         r"calibrate off turns off: drop --calibration-file, or --calibrate off$"):
        _train(["--calibrate", "off", "--calibration-file", "c.json"])
    assert _train(["--calibration-file", "c.json"]).calibration_file == "c.json"  # read (and checked) at start


def test_a_run_config_file_with_a_cost_profile_flag_names_the_recompute_it_holds(tmp_path):
    """A run's config.yaml holds recompute resolved (per_micro_batch), which a cost profile cannot price: --cost-profile
    on top of it is refused when the flags are parsed, naming the file and the value it gives (the planner's check
    at run start called it '--recompute auto', a value nobody had given)."""
    run = tmp_path / "config.yaml"
    run.write_text("model:\n  model: t5-tiny\nexperimental:\n  recompute: per_micro_batch\n  split_blocks: auto\n")
    with pytest.raises(ValueError, match=r"^config file .*config.yaml: recompute per_micro_batch needs a cost model "
                                         r"that prices recomputation, and a cost profile does not: pass --recompute "
                                         r"none \(or auto\) with --cost-profile, or drop --cost-profile \(recompute "
                                         r"from the file, --cost-profile from the command line\)$"):
        _train(["--config", str(run), "--cost-profile", "p.json"])
    assert _train(["--config", str(run), "--cost-profile", "p.json", "--recompute", "auto"]).recompute == "auto"


@pytest.mark.parametrize("flag", ["--generate-every", "--generation-max-new-tokens"])
def test_a_generation_flag_without_evaluation_data_is_refused_not_ignored(flag, tmp_path):
    """Like --eval-steps / --eval-samples: a generation flag with nothing to evaluate would do nothing. Their
    defaults are not 0, so the flag given is what counts; a run's config.yaml (which holds them) still loads."""
    with pytest.raises(ValueError, match=f"{flag} sets the generation metrics of evaluation, and no evaluation data"):
        _train([flag, "2"])
    assert _train([flag, "2", "--eval-holdout", "0.1"]).eval_holdout == 0.1
    saved = tmp_path / "config.yaml"
    saved.write_text("generate_every: 2\ngeneration_max_new_tokens: 8\n")
    assert _train(["--config", str(saved)]).generate_every == 2
