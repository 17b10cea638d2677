"""Every command and API goes through the one resolver (issue 42, item 5): ``plan``, ``simulate``, ``bench``,
``profile``, ``data-report`` and the DataLoader decide their ``auto`` values by the rules of
:data:`dynabatch.training.config.resolve.RULES`, so a changed rule changes what they run, and ``plan``/``simulate`` report the
choices."""

from __future__ import annotations

import json
import re

import pytest

from dynabatch.cli import command_parser, main
from dynabatch.training.config import TrainConfig, resolve
from dynabatch.training.config.resolve import RULES, SEARCHES, Found, args_view, decide, resolve_args

PLAN = ["--model", "gpt", "--stages", "5", "--num-batches", "1", "--global-batch-tokens", "16384", "--methods",
        "dynamic", "--layer-split", "reference", "--json"]
"""Five stages of gpt-1.3b: the reference split cuts inside a block when it may (and not with --split-blocks off)."""


def _no_split_rule(cfg, found):
    return ("off", "a test's rule") if cfg.split_blocks == "auto" else None


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_plan_and_simulate_report_the_resolved_choices_and_follow_a_changed_rule(command, monkeypatch, capsys):
    assert main([command, *PLAN]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["resolved"]["split_blocks"][0] == "on" and auto["resolved"]["pack_rows"][0] == "off"
    assert auto["resolved"]["recompute"][0] == SEARCHES["recompute"] and all(why for _, why in auto["resolved"].values())
    assert main([command, *PLAN, "--split-blocks", "off"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert "split_blocks" not in whole["resolved"] and whole["layout"] != auto["layout"]  # given: not decided
    monkeypatch.setitem(RULES, "split_blocks", _no_split_rule)
    assert main([command, *PLAN]) == 0
    changed = json.loads(capsys.readouterr().out)
    assert changed["resolved"]["split_blocks"] == ["off", "a test's rule"]
    assert changed["layout"] == whole["layout"]  # the split follows the rule
    assert main([command, *PLAN[:-1]]) == 0  # the table: one line of the choices
    assert "resolved: --tokenizer builtin" in capsys.readouterr().out


def test_simulate_prices_a_baselines_recompute_auto_by_the_rule(monkeypatch):
    from dynabatch.commands.common import resolve as workload
    from dynabatch.commands.common import method_recompute

    args = command_parser("simulate")[1].parse_args(["--model", "gpt"])
    w = workload(args)
    assert w.cost_model.recompute == "auto"  # resolved per_micro_batch, the planners' auto
    assert (method_recompute("dynamic", w), method_recompute("padding", w)) == ("auto", "none")
    monkeypatch.setitem(RULES, "recompute", lambda cfg, found: ("selective", "a test's rule")
                        if cfg.recompute == "auto" else None)
    assert method_recompute("padding", w) == "selective"


def test_plan_prices_each_baseline_with_its_own_recompute(capsys):
    """``plan`` prices a baseline as ``train`` and ``simulate`` run it (the rule: a baseline's ``auto`` is none): at
    12 GiB, T5-large's baselines priced with ``--recompute auto`` equal those priced with ``none``. Before, the
    baselines took dynamic's ``auto`` and paid recomputation they never run (packing_free 0.595 s a step instead
    of 0.491 s over two batches), which made dynamic look 1.02x faster there where it ties (1.00x)."""
    argv = ["plan", "--model", "t5", "--lengths", "data/heavy_tail_1024.npz", "--memory-gib", "12", "--num-batches",
            "1", "--methods", "dynamic,length_grouped,token_budget,packing_free", "--json"]
    rows = {}
    for recompute in ("auto", "none"):
        assert main([*argv, "--recompute", recompute]) == 0
        rows[recompute] = json.loads(capsys.readouterr().out)["methods"]
    for method in ("length_grouped", "token_budget", "packing_free"):
        assert rows["auto"][method]["predicted_step_s"] == rows["none"][method]["predicted_step_s"], method


def test_bench_resolves_each_methods_config_by_the_rules(monkeypatch):
    from dynabatch.commands import bench, bench_run

    args = command_parser("bench")[1].parse_args(["--model", "gpt2-mini", "--stages", "1"])
    bench_run.resolve_defaults(args)
    found = Found(cuda_available=False, sequence_kind="causal")
    resolved = bench_run.method_configs(args, ["dynamic", "padding", bench.PEER], found)
    assert all(r.unresolved() == [] for r in resolved.values())
    cfgs = {m: r.config for m, r in resolved.items()}
    assert (cfgs["dynamic"].recompute, cfgs["padding"].recompute) == (SEARCHES["recompute"], "none")
    assert cfgs[bench.PEER].method == "packing" and cfgs["dynamic"].attention_kernel == "sdpa"
    assert (cfgs["dynamic"].device, cfgs["dynamic"].plan_costs, cfgs["dynamic"].tokenizer) == ("cpu", "base", "builtin")
    for name in [n for n in RULES if n in TrainConfig.__dataclass_fields__]:  # resolved: every rule leaves it
        for m, cfg in cfgs.items():                                              # as it is (components' decide())
            assert decide(cfg, name, found) == getattr(cfg, name), (m, name)
    monkeypatch.setitem(RULES, "policy", lambda cfg, found: ("1f1b", "a test's rule") if cfg.policy == "auto" else None)
    changed = bench_run.method_configs(args, ["dynamic"], found)["dynamic"]
    assert changed.config.policy == "1f1b" and changed.reasons["policy"] == "a test's rule"
    assert bench_run.resolved_json({"dynamic": changed})["dynamic"]["policy"] == ["1f1b", "a test's rule"]


def test_a_resolved_train_config_is_left_as_it_is_by_every_rule():
    """What ``train`` hands its components: the rules they may still ask (decide) answer with its own values."""
    for found in (Found(cuda_available=False, sequence_kind="seq2seq"), Found(cuda_available=True, sequence_kind="causal")):
        cfg = resolve(TrainConfig(stages=2, placement="linear"), found).config
        for name in [n for n in RULES if n in TrainConfig.__dataclass_fields__]:
            assert decide(cfg, name, found) == getattr(cfg, name), name
        assert cfg.calibration_mode == cfg.calibrate and cfg.cuts_inside_blocks == (cfg.split_blocks == "on")


def test_profile_and_data_report_decide_by_the_rules(tmp_path, monkeypatch, capsys):
    from dynabatch.commands import profile

    args = command_parser("profile")[1].parse_args(["--model", "gpt2-mini"])
    device, decided = profile._device(args)
    assert device == "cpu" and {k: v for k, (v, _) in decided.items()} == {  # this CPU machine
        "device": "cpu", "clock": "thread_cpu", "p2p": "gloo"}
    args = command_parser("profile")[1].parse_args(["--threads", "2", "--p2p", "none"])
    assert {k: v for k, (v, _) in profile._device(args)[1].items()} == {"device": "cpu", "clock": "wall"}
    cuda = Found(cuda_available=True, cuda_devices=1)
    assert resolve_args(command_parser("profile")[1].parse_args([]), cuda)["p2p"][0] == "none"  # no peer
    args = command_parser("data-report")[1].parse_args([])
    assert resolve_args(args, Found()) == {"tokenizer": ("builtin", "no --model folder holding a tokenizer")}
    monkeypatch.setitem(RULES, "tokenizer", lambda cfg, found: ("byt5", "a test's rule")
                        if cfg.tokenizer == "auto" else None)
    args = command_parser("data-report")[1].parse_args([])
    assert resolve_args(args, Found()) == {"tokenizer": ("byt5", "a test's rule")} and args.tokenizer == "byt5"
    monkeypatch.setitem(RULES, "tokenizer", lambda cfg, found: ("builtin", "a test's rule")
                        if cfg.tokenizer == "auto" else None)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"inputs": "a b c " * (i % 5 + 1), "targets": "x y"}) + "\n" for i in range(30)))
    assert main(["data-report", "--data", str(rows), "--num-batches", "1", "--max-lens", "128", "--family", "seq2seq",
                 "--global-batch-tokens", "512"]) == 0
    assert capsys.readouterr().out.startswith("tokenizer: builtin (--tokenizer auto: a test's rule;")


def test_resolve_args_reads_trains_defaults_for_the_fields_a_command_lacks():
    args = command_parser("plan")[1].parse_args(["--pack-rows", "auto"])
    decided = resolve_args(args, Found())
    assert decided["pack_rows"][0] == SEARCHES["pack_rows"] and args.pack_rows == SEARCHES["pack_rows"]
    assert "device" not in decided and not hasattr(args, "device")  # plan takes no --device
    assert "policy" not in decided  # nor --policy


def test_the_dataloader_decides_its_hardware_by_the_rule(monkeypatch):
    from transformers import GPT2Config

    from dynabatch.data.batching import LengthLimits
    from dynabatch.data.tokenize import load_tokenizer
    from dynabatch.integrations.dataloader import DynaBatchDataLoader, default_cost_model

    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"inputs": ["a b c d"] * 8, "targets": ["e f"] * 8})
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=8192)

    def loader():
        return DynaBatchDataLoader(rows, LengthLimits("causal", max_input_len=32, max_seq_len=32), token_budget=128,
                                   model_config=config, tokenizer=load_tokenizer("builtin"))

    assert loader().resolved == {"hardware": ("cpu", "no CUDA device: the cpu preset")}
    assert loader().cost_model.model.hardware.name == "cpu"
    view = args_view(hardware="auto")
    assert decide(view, "hardware", Found(cuda_available=True)) == "cuda"  # the CUDA device's own preset
    with pytest.raises(ValueError, match="hardware='cuda' prices this machine's CUDA device, but CUDA is not"):
        default_cost_model(config, "cuda")  # this CPU machine
    monkeypatch.setitem(RULES, "hardware", lambda cfg, found: ("a100-80gb", "a test's rule")
                        if cfg.hardware == "auto" else None)
    changed = loader()
    assert changed.resolved == {"hardware": ("a100-80gb", "a test's rule")}
    assert changed.cost_model.model.hardware.name == "a100-80gb"


def test_the_hf_trainer_takes_the_attention_choices_of_train():
    from dynabatch.core.attention import ATTENTION_PATHS
    from dynabatch.integrations.trainer import DynaBatchTrainer

    train = next(a for a in command_parser("train")[1]._actions if a.dest == "attention")
    assert list(ATTENTION_PATHS) == list(train.choices)
    with pytest.raises(ValueError, match="unknown attention 'flash'; valid: " + ", ".join(ATTENTION_PATHS)):
        DynaBatchTrainer(attention="flash")


@pytest.mark.parametrize("name", ["method", "dtype", "attention"])
def test_the_dataloader_takes_the_choices_of_trains_flag(name):
    """An option the DataLoader shares with ``train`` refuses a value naming exactly ``train``'s choices."""
    from dynabatch.data.batching import LengthLimits
    from dynabatch.data.tokenize import load_tokenizer
    from dynabatch.integrations.dataloader import DynaBatchDataLoader

    choices = next(a for a in command_parser("train")[1]._actions if a.dest == name).choices
    limits = LengthLimits("seq2seq", max_input_len=32, max_target_len=8)
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"inputs": ["a b c"] * 4, "targets": ["d"] * 4})
    with pytest.raises(ValueError, match="unknown .*" + re.escape(f"valid: {', '.join(choices)}") + "$"):
        DynaBatchDataLoader(rows, limits, token_budget=64, tokenizer=load_tokenizer("builtin"), **{name: "nope"})
