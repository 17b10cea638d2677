"""One resolver (issue 42, item 2): every ``auto`` decided in :mod:`dynabatch.training.config.resolve` with a reason; the run
prints the choices, writes ``OUTPUT/config.yaml`` (every field, resolved), and ``--config`` of that file runs the
same again; a resume says which fields differ; the components follow the resolver's rules."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import yaml

from dynabatch.cli import main
from dynabatch.engine.checkpoint import CheckpointInfo
from dynabatch.training.config import TrainConfig, decide, lower, resolve
from dynabatch.training.config.resolve import RULES, SEARCHES, Found
from dynabatch.training.resume import resume_settings_line

SMALL = ["--max-input-len", "64", "--max-target-len", "16", "--global-batch-tokens", "1024", "--no-timeline",
         "--logging-steps", "0"]
CPU_T5 = Found(cuda_available=False, sequence_kind="seq2seq")
CUDA_GPT = Found(cuda_available=True, sequence_kind="causal")


def _values(tree):
    for value in tree.values():
        yield from _values(value) if isinstance(value, dict) else (value,)


def _losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def test_every_auto_is_decided_with_a_reason():
    for found in (CPU_T5, CUDA_GPT):
        resolved = resolve(TrainConfig(stages=2, placement="linear"), found)
        assert resolved.unresolved() == []
        assert all(resolved.reasons[name] for name in resolved.reasons)
    cpu = resolve(TrainConfig(), CPU_T5)
    assert (cpu.config.device, cpu.config.attention_kernel, cpu.config.planner, cpu.config.pack_rows) == (
        "cpu", "sdpa", "thread", "off")
    assert (cpu.config.plan_costs, cpu.config.calibrate, cpu.config.split_blocks) == ("calibrated", "quick", "on")
    assert (cpu.config.policy, cpu.config.recompute) == (SEARCHES["policy"], SEARCHES["recompute"])
    cuda = resolve(TrainConfig(method="packing"), CUDA_GPT).config
    assert (cuda.device, cuda.attention_kernel, cuda.planner, cuda.pack_rows, cuda.plan_costs, cuda.recompute) == (
        "cuda", SEARCHES["attention_kernel"], "process", SEARCHES["pack_rows"], "base", "none")
    given = TrainConfig(device="cpu", policy="1f1b", recompute="full", planner="process")
    assert {k: getattr(resolve(given, CUDA_GPT).config, k) for k in ("device", "policy", "recompute", "planner")} == {
        "device": "cpu", "policy": "1f1b", "recompute": "full", "planner": "process"}  # given values stay
    assert "placement" not in resolve(TrainConfig(stages=2, placement="auto"), CPU_T5).reasons  # chosen at start
    assert resolve(TrainConfig(placement="auto"), CPU_T5).config.placement == "linear"  # one stage


def test_the_cpu_allocator_keeps_freed_tensors_for_an_encoder_decoder_on_cpu(tmp_path, monkeypatch):
    """``--cpu-allocator auto``: ``keep`` on CPU for an encoder-decoder (its eager attention scores) when its ranks'
    ``--memory-gib`` twice over fit the host's memory, else ``system``, as for a decoder-only model and on CUDA; a
    train run of t5-tiny on CPU runs inside ``freed_tensors_kept`` (in effect on glibc), and gives the process its
    torch thread count back."""
    import platform
    import sys

    from conftest import spy_freed_tensors_kept
    from dynabatch.training import trainer

    assert resolve(TrainConfig(), CPU_T5).config.cpu_allocator == "keep"
    assert resolve(TrainConfig(), Found(cuda_available=False, sequence_kind="causal")).config.cpu_allocator == "system"
    assert resolve(TrainConfig(), CUDA_GPT).config.cpu_allocator == "system"
    assert resolve(TrainConfig(cpu_allocator="system"), CPU_T5).config.cpu_allocator == "system"
    roomy, tight = (Found(cuda_available=False, sequence_kind="seq2seq", world_size=2, host_memory_gib=g)
                    for g in (16.0, 15.9))  # 2 ranks x 4 GiB x 2
    assert resolve(TrainConfig(memory_gib=4.0), roomy).config.cpu_allocator == "keep"
    tight_run = resolve(TrainConfig(memory_gib=4.0), tight)
    assert tight_run.config.cpu_allocator == "system"
    assert "2 ranks x --memory-gib 4 x 2 (a kept heap's resident set) = 16 GiB" in tight_run.reasons["cpu_allocator"]
    seen = spy_freed_tensors_kept(monkeypatch, trainer)
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if threads == 1 else 1)  # the run sets --threads 1: this process gets its own back
    try:
        assert main(["train", "--max-steps", "1", "--output-dir", str(tmp_path / "run"), *SMALL]) == 0
        assert torch.get_num_threads() == (2 if threads == 1 else 1)
    finally:
        torch.set_num_threads(threads)
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert seen == [(True, glibc)]


def test_components_ask_the_same_rules_and_lower_the_search_names():
    cfg = TrainConfig()  # not resolved: a component asking for one field gets the rule's answer
    assert decide(cfg, "plan_costs", Found(sequence_kind="causal")) == "base"
    assert cfg.calibration_mode == "quick" and cfg.cuts_inside_blocks
    assert lower("policy", SEARCHES["policy"]) == "auto" and lower("policy", "1f1b") == "1f1b"
    assert list(RULES)[0] == "device"  # later rules read the device decided first


def test_train_writes_a_resolved_config_yaml_and_runs_the_same_again_from_it(tmp_path, capsys):
    """Under --full-determinism (plans from costs that do not depend on measured times): without it t5 plans follow
    the online fit of each run's own timings, and two runs may cut a step differently (losses then differ in the
    last bits)."""
    first, again = str(tmp_path / "first"), str(tmp_path / "again")
    assert main(["train", "--max-steps", "2", "--output-dir", first, "--full-determinism", *SMALL]) == 0
    err = capsys.readouterr().err
    assert "resolved configuration" in err and "--policy" in err  # the table, once
    # the progress line of the last step (plain lines off a terminal) shows that step's loss, not the one before
    last = [line for line in err.splitlines() if " 2/2 " in line]
    assert last and f"loss={_losses(first)[-1]:.3f}" in last[-1], last
    with open(os.path.join(first, "metrics.jsonl"), encoding="utf-8") as f:  # the rate each step's update used
        lrs = [r["lr"] for r in map(json.loads, f) if "loss" in r]
    assert lrs == pytest.approx([1e-3 / 6, 2e-3 / 6]), lrs  # steps 0 and 1 of the 5-step warm-up, not 1 and 2
    path = os.path.join(first, "config.yaml")
    with open(path, encoding="utf-8") as f:
        written = yaml.safe_load(f)
    values = list(_values(written))
    assert "auto" not in values and "device" != written["batching"]["pack_rows"]
    assert len(values) == len(TrainConfig.__dataclass_fields__)  # every field
    assert main(["train", "--config", path, "--output-dir", again]) == 0
    assert _losses(again) == _losses(first) and len(_losses(first)) == 2
    with open(os.path.join(again, "config.yaml"), encoding="utf-8") as f:
        rewritten = yaml.safe_load(f)
    rewritten["checkpoint"]["output_dir"] = first
    assert rewritten == written


def test_a_resume_reads_config_yaml_and_names_the_fields_that_differ(tmp_path, capsys):
    run = str(tmp_path / "run")
    assert main(["train", "--max-steps", "2", "--output-dir", run, *SMALL]) == 0
    capsys.readouterr()
    assert main(["train", "--max-steps", "3", "--output-dir", run, "--resume-from-checkpoint", "--learning-rate",
                 "5e-4", *SMALL]) == 0
    err = capsys.readouterr().err
    assert "config.yaml of the earlier run differs in" in err
    assert "learning_rate: 0.001 -> 0.0005" in err and "max_steps: 2 -> 3" in err
    assert err.count("learning_rate: 0.001 -> 0.0005") == 1  # one line, from the checkpoint and config.yaml both


def test_a_resume_says_its_changed_settings_in_one_line():
    """The checkpoint's settings decide what applies from its step; the earlier run's config.yaml adds only whether
    it says the same, or what it says otherwise (a later start than the checkpoint's wrote it)."""
    saved = TrainConfig(max_steps=4)
    info = CheckpointInfo(path="run/checkpoints/step-000002", step=2, manifest={"config": saved.to_dict()})
    now = dataclasses.replace(saved, learning_rate=5e-4)
    head = "--resume-from-checkpoint run/checkpoints/step-000002: "
    assert resume_settings_line(info, now, None) == (
        head + "changed settings apply from step 2: learning_rate: 0.001 -> 0.0005")
    assert resume_settings_line(info, now, saved.to_dict()) == (
        head + "changed settings apply from step 2: learning_rate: 0.001 -> 0.0005 (config.yaml of the earlier "
        "run differs in the same)")
    assert resume_settings_line(info, now, now.to_dict()) == (
        head + "changed settings apply from step 2: learning_rate: 0.001 -> 0.0005 (config.yaml of the earlier "
        "run differs in nothing)")
    assert resume_settings_line(info, saved, None) is None
    assert resume_settings_line(info, saved, saved.to_dict()) == (
        head + "no setting differs from the checkpoint's (nor from config.yaml of the earlier run)")
    assert resume_settings_line(info, saved, now.to_dict()) == (
        head + "no setting differs from the checkpoint's (config.yaml of the earlier run differs in learning_rate: "
        "0.0005 -> 0.001)")


def test_config_yaml_never_resumes_nor_overwrites_when_run_again(tmp_path, capsys):
    """``--overwrite-output-dir`` and ``--resume-from-checkpoint`` say how one start treated its folder: the written
    file holds their defaults, so ``--config`` of it into the same folder is refused, not a deletion of the run it
    describes."""
    run = str(tmp_path / "run")
    assert main(["train", "--max-steps", "1", "--output-dir", run, "--overwrite-output-dir", *SMALL]) == 0
    assert main(["train", "--max-steps", "2", "--output-dir", run, "--resume-from-checkpoint", *SMALL]) == 0
    path = os.path.join(run, "config.yaml")
    with open(path, encoding="utf-8") as f:
        written = yaml.safe_load(f)
    assert written["checkpoint"]["overwrite_output_dir"] is False
    assert written["checkpoint"]["resume_from_checkpoint"] is None
    capsys.readouterr()
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        before = f.read()
    assert main(["train", "--config", path, "--max-steps", "3"]) == 2
    assert "is not empty" in capsys.readouterr().err
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        assert f.read() == before


def test_a_compare_run_resolves_recompute_for_its_own_method_also_from_config_yaml(tmp_path):
    """The first run's resolved ``recompute`` (dynamic: per micro-batch) is written to ``config.yaml``; the baseline
    it is compared with recomputes nothing, in the first run and in a rerun of that file, whose compare run's own file
    names no compare run."""
    first, again = str(tmp_path / "first"), str(tmp_path / "again")
    assert main(["train", "--max-steps", "1", "--output-dir", first, "--compare-method", "packing_free", *SMALL]) == 0
    assert main(["train", "--config", os.path.join(first, "config.yaml"), "--output-dir", again]) == 0
    for run in (first, again):
        with open(os.path.join(run, "config.yaml"), encoding="utf-8") as f:
            assert _values_by_name(yaml.safe_load(f))["recompute"] != "none"
        with open(os.path.join(run, "compare-packing_free", "config.yaml"), encoding="utf-8") as f:
            compared = _values_by_name(yaml.safe_load(f))
        assert compared["recompute"] == "none" and compared["method"] == "packing_free"
        assert compared["compare_method"] is None


def _values_by_name(sections: dict) -> dict:
    return {k: v for fields in sections.values() for k, v in fields.items()}


def test_the_run_follows_a_changed_rule(tmp_path, monkeypatch, capsys):
    """Change the resolver's policy rule: the run schedules every step with the new choice and says why."""
    monkeypatch.setitem(RULES, "policy", lambda cfg, found: ("1f1b", "a test's rule") if cfg.policy == "auto" else None)
    run = str(tmp_path / "run")
    assert main(["train", "--max-steps", "2", "--output-dir", run, *SMALL]) == 0
    assert "a test's rule" in capsys.readouterr().err
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        policies = [p for r in map(json.loads, f) for p in r.get("schedule_policy", [])]
    assert policies and set(policies) == {"1f1b"}
    with open(os.path.join(run, "config.yaml"), encoding="utf-8") as f:
        assert yaml.safe_load(f)["pipeline"]["policy"] == "1f1b"


def test_a_resolved_search_name_is_accepted_by_every_command_that_takes_the_option():
    cfg = TrainConfig(policy=SEARCHES["policy"], recompute=SEARCHES["recompute"], pack_rows=SEARCHES["pack_rows"],
                      attention_kernel=SEARCHES["attention_kernel"])
    assert resolve(cfg, CPU_T5).config.policy == SEARCHES["policy"]
    with pytest.raises(ValueError, match="policy must be one of"):
        TrainConfig(policy="per_micro_batch")


def test_full_determinism_plans_with_the_base_model_and_refuses_a_measured_one():
    det = resolve(TrainConfig(full_determinism=True), CPU_T5)
    assert det.config.plan_costs == "base" and "--full-determinism" in det.reasons["plan_costs"]
    assert resolve(TrainConfig(), CPU_T5).config.plan_costs == "calibrated"  # t5 without it: the online fit
    with pytest.raises(ValueError, match="full_determinism plans with costs that do not depend on measured times"):
        resolve(TrainConfig(full_determinism=True, plan_costs="calibrated"), CPU_T5)


def test_full_determinism_in_process_gives_equal_runs_and_puts_torch_back(tmp_path):
    import torch

    runs = [str(tmp_path / name) for name in ("a", "b")]
    for run in runs:
        assert main(["train", "--max-steps", "3", "--output-dir", run, "--full-determinism", *SMALL]) == 0
        assert not torch.are_deterministic_algorithms_enabled()  # the switch lasts the run only
    records = []
    for run in runs:
        with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
            records.append([(r["samples_digest"], r["num_micro_batches"], r["loss"]) for r in map(json.loads, f)])
    assert records[0] == records[1] and len(records[0]) == 3


def test_max_target_len_for_a_decoder_only_model_is_said_to_have_no_effect():
    """--max-target-len is T5's decoder limit: a decoder-only run given another value warns that it has no effect
    (it used to pass without a word); the default, or any value for T5, says nothing."""
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.run_start import describe_target_len

    line = describe_target_len(TrainConfig(model="gpt2-tiny", max_input_len=256, max_target_len=32))
    assert line == ("--max-target-len 32 has no effect on the decoder-only model gpt2-tiny: its samples, inputs and "
                    "targets together, are cut at --max-input-len 256")
    assert describe_target_len(TrainConfig(model="gpt2-tiny")) is None
    assert describe_target_len(TrainConfig(model="t5-tiny", max_target_len=32)) is None


def test_zero_with_one_replica_is_said_once_and_runs_as_zero_0(tmp_path, capsys):
    """``--zero 1`` on one replica has nothing to shard: the run warns once and keeps whole states (as ``--zero 0``);
    with two replicas there is no such line."""
    from dynabatch.training.run_start import describe_zero

    assert describe_zero(0, 1) is None and describe_zero(1, 2) is None and describe_zero(2, 4) is None
    assert "--zero 2 with one replica" in describe_zero(2, 1)
    out = str(tmp_path / "z")
    assert main(["train", "--max-steps", "1", "--output-dir", out, "--zero", "1", *SMALL]) == 0
    err = capsys.readouterr().err
    assert err.count("--zero 1 with one replica: there is nothing to shard") == 1, err[-2000:]
    assert len(_losses(out)) == 1


def test_moving_boundaries_keep_one_chunk_per_device_and_refuse_what_they_do_not_handle():
    resolved = resolve(TrainConfig(stages=2, placement="auto", moving_boundaries=True), CPU_T5)
    assert resolved.config.placement == "linear" and "--moving-boundaries" in resolved.reasons["placement"]
    with pytest.raises(ValueError, match="moving_boundaries moves the cuts of a linear layout; placement 'cyclic'"):
        TrainConfig(stages=2, placement="cyclic", moving_boundaries=True)
    with pytest.raises(ValueError, match="--zero 1 does not shard yet: use --zero 0 or drop --moving-boundaries"):
        TrainConfig(stages=2, replicas=2, zero=1, moving_boundaries=True)
