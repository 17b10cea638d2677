"""Reliability of `dynabatch train` (issue 19): divergence, output folders, resume settings, config errors.

Through the real CLI in-process (``cli.main``, a world of one: no subprocess imports), training runs
included. Two-rank (torchrun) divergence lives in tests/dist/test_faults_training.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import numpy as np
import pytest
import torch

from dynabatch.cli import main

BASE = ["--tokenizer", "byt5", "--global-batch-tokens", "1024", "--max-input-len", "128", "--max-target-len", "32",
        "--log-every", "0", "--no-timeline"]


def _cli(capsys, tmp_path, toy_mixture_dir, out: str, *extra: str, model: str = "t5-tiny") -> subprocess.CompletedProcess:
    """``dynabatch train`` in this process; its exit code and output as a ``CompletedProcess``."""
    argv = ["train", "--model", model, *BASE, "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
            "--output-dir", str(tmp_path / out), *extra]
    code = main(argv)
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, captured.out, captured.err)


def _records(path) -> list[dict]:
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _error_line(err: str, command: str = "train") -> str:
    lines = [line for line in err.splitlines() if f"dynabatch {command}: error:" in line]
    assert len(lines) >= 1, err[-3000:]
    return lines[-1]


def _tree_digest(folder) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


# ---------------------------------------------------------------------------------------------- divergence


@pytest.mark.parametrize("model", ["t5-tiny", "gpt2-tiny"])
def test_diverging_run_stops_with_a_clear_error_and_keeps_finite_checkpoints(tmp_path, toy_mixture_dir, model, capsys):
    from dynabatch.engine.checkpoint import latest_checkpoint, list_checkpoints
    from dynabatch.training.reshard import model_weights

    out = _cli(capsys, tmp_path, toy_mixture_dir, "div", "--steps", "12", "--lr", "1e6", "--checkpoint-every", "1",
               "--keep-checkpoints", "2", "--max-bad-steps", "2", model=model)
    assert out.returncode == 2, out.stderr[-3000:]
    msg = _error_line(out.stderr)
    assert "training diverged" in msg and "non-finite" in msg and "--max-bad-steps 2" in msg and "--learning-rate" in msg
    records = _records(tmp_path / "div")
    skipped = [r["step"] for r in records if r["skipped"]]
    assert len(skipped) >= 2 and skipped[-2:] == [records[-2]["step"], records[-1]["step"]]
    assert f"up to step {records[-1]['step']}" in msg
    assert f"warning: step {skipped[0]}:" in out.stderr + out.stdout
    root = str(tmp_path / "div" / "checkpoints")
    info = latest_checkpoint(root)
    assert info is not None and len(list_checkpoints(root)) >= 1
    weights = model_weights(info.path)
    assert weights and all(torch.isfinite(w).all() for w in weights.values())


def test_skipped_step_leaves_weights_and_optimizer_untouched():
    """One process: a NaN loss skips the optimizer step (weights and AdamW state unchanged); a finite one applies."""
    from dynabatch.data.collate import collate_causal
    from dynabatch.data.sample import TokenizedSample
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import build_stage, layout_for, pipeline_spec_for
    from dynabatch.engine.dist import init_distributed, shutdown
    from dynabatch.engine.executor import Executor
    from dynabatch.engine.step import train_step

    ctx = init_distributed(1, 1, rank=0, world_size=1, init_method=f"file://{os.getcwd()}/.pg-{os.getpid()}")
    try:
        model = build_model("gpt2-tiny", vocab_size=300, seed=0)
        layout = layout_for(model, 1)
        stage = build_stage(model, layout, 0)
        opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
        ex = Executor(stage, ctx, opt)
        spec = pipeline_spec_for(model, layout, "float32")
        samples = [TokenizedSample(task="t", input_ids=np.arange(3, 10 + i, dtype=np.int32),
                                   target_ids=np.array([5, 6, 1], dtype=np.int32)) for i in range(3)]
        mb = collate_causal(samples, [[0], [1, 2]], pad_id=0)
        first = train_step(ex, ctx, 0, [[mb]], spec=spec)
        assert not first.skipped and len(opt.state) > 0
        before = {k: v.clone() for k, v in stage.state_dict().items()}
        steps_before = [s["step"].clone() for s in opt.state.values()]
        stage.register_forward_hook(lambda m, i, o: setattr(o, "loss_sum", o.loss_sum * float("nan")) or o)
        bad = train_step(ex, ctx, 1, [[mb]], spec=spec)
        assert bad.skipped and bad.loss != bad.loss
        for k, v in stage.state_dict().items():
            assert torch.equal(v, before[k]), k
        assert all(torch.equal(s["step"], b) for s, b in zip(opt.state.values(), steps_before))
    finally:
        shutdown()
        if os.path.exists(f".pg-{os.getpid()}"):
            os.remove(f".pg-{os.getpid()}")


# ------------------------------------------------------------------------------------------ output folders


def _train_inproc(tmp_path, capsys, out_dir, *extra: str) -> tuple[int, str]:
    code = main(["train", "--model", "t5-tiny", *BASE, "--steps", "1", "--output-dir", str(out_dir), *extra])
    return code, capsys.readouterr().err


def test_fresh_run_into_a_used_folder_is_refused_and_touches_nothing(tmp_path, capsys):
    out = tmp_path / "old"
    (out / "checkpoints" / "step-000010").mkdir(parents=True)
    (out / "checkpoints" / "step-000010" / "manifest.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 9}\n')
    (out / "notes.txt").write_text("mine")
    before = _tree_digest(out)
    code, err = _train_inproc(tmp_path, capsys, out)
    assert code == 2, err[-2000:]
    msg = _error_line(err)
    assert "is not empty" in msg and "checkpoints" in msg and "--resume" in msg and "--overwrite-output-dir" in msg
    assert _tree_digest(out) == before


def test_overwrite_output_dir_replaces_only_run_files(tmp_path, toy_mixture_dir, capsys):
    out = tmp_path / "old"
    first = _cli(capsys, tmp_path, toy_mixture_dir, "old", "--steps", "1")  # the earlier run, and its run file
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000001"]
    (out / "notes.txt").write_text("mine")
    for folder in ("runs", "wandb"):  # the user's, added after a run that wrote neither (no --report-to)
        (out / folder).mkdir()
        (out / folder / "mine.txt").write_text("mine")
    run = _cli(capsys, tmp_path, toy_mixture_dir, "old", "--steps", "2", "--overwrite-output-dir")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "runs" / "mine.txt").read_text() == "mine" and (out / "wandb" / "mine.txt").read_text() == "mine"
    assert [r["step"] for r in _records(out)] == [0, 1]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-000002"]


def test_overwrite_output_dir_never_deletes_entries_no_run_wrote(tmp_path, capsys):
    """Folders a user named like a run's (``runs/``, ``wandb/``, ``checkpoints/``), with no run file saying a run
    wrote them: refused in one line, nothing touched."""
    out = tmp_path / "project"
    (out / "runs" / "exp1").mkdir(parents=True)
    (out / "runs" / "exp1" / "results.txt").write_text("r")
    (out / "wandb").mkdir()
    (out / "wandb" / "settings").write_text("x")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "mydata.bin").write_bytes(b"data")
    before = _tree_digest(out)
    code, err = _train_inproc(tmp_path, capsys, out, "--overwrite-output-dir")
    assert code == 2, err[-2000:]
    msg = _error_line(err)
    assert "nothing was deleted" in msg and "runs" in msg and "wandb" in msg and "dynabatch-run.json" in msg
    assert _tree_digest(out) == before


def test_overwrite_keeps_what_the_folder_held_before_the_earlier_run(tmp_path):
    from dynabatch.engine.outputs import RUN_FILE, output_dir_problem

    out = tmp_path / "run"
    (out / "runs").mkdir(parents=True)  # the user's, there before the earlier run started (its run file says so)
    (out / "runs" / "mine.txt").write_text("mine")
    (out / "notes.txt").write_text("notes")
    (out / RUN_FILE).write_text(json.dumps({"present_before": ["notes.txt", "runs"]}))
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # the earlier run's
    (out / "compare-packing_free").mkdir()
    assert output_dir_problem(str(out), resume=False, overwrite=False) is not None  # not empty: refused
    assert (out / "metrics.jsonl").exists()
    assert output_dir_problem(str(out), resume=False, overwrite=True) is None
    assert sorted(os.listdir(out)) == sorted(["notes.txt", "runs", RUN_FILE])
    assert (out / "runs" / "mine.txt").read_text() == "mine"
    assert json.loads((out / RUN_FILE).read_text())["present_before"] == ["notes.txt", "runs"]
    fresh = tmp_path / "fresh"
    assert output_dir_problem(str(fresh), resume=False, overwrite=False) is None  # created, empty: recorded as such
    assert json.loads((fresh / RUN_FILE).read_text())["present_before"] == []
    (fresh / "config.yaml").write_text("model: {}\n")  # that run stopped on bad input before its first step
    assert output_dir_problem(str(fresh), resume=False, overwrite=False) is None  # so the corrected rerun starts
    assert sorted(os.listdir(fresh)) == [RUN_FILE]
    (fresh / "metrics.jsonl").write_text('{"step": 0}\n')  # a run that trained: refused, as any used folder
    assert "is not empty" in output_dir_problem(str(fresh), resume=False, overwrite=False)


def test_overwrite_deletes_the_folders_a_run_claimed_and_no_others(tmp_path):
    from dynabatch.engine.outputs import RUN_FILE, output_dir_problem, run_dirs

    out = tmp_path / "run"
    claims = run_dirs(("tensorboard",), "packing_free")
    assert claims == ["checkpoints", "runs", "compare-packing_free"]
    assert output_dir_problem(str(out), resume=False, overwrite=False, claims=claims) is None
    assert json.loads((out / RUN_FILE).read_text())["claimed"] == sorted(claims)
    for name in ("checkpoints", "runs", "compare-packing_free", "wandb", "compare-other"):  # the run's three, then two
        (out / name).mkdir()                                                              # folders of the user's
        (out / name / "f").write_text(name)
    (out / "checkpoints" / "f").unlink()  # checkpoints/ holds the run's checkpoints (user files there are kept)
    (out / "checkpoints" / "step-000002").mkdir()
    (out / "checkpoints" / "step-000002" / "run_id").write_text("r")
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert output_dir_problem(str(out), resume=False, overwrite=True, claims=["checkpoints"]) is None
    assert sorted(os.listdir(out)) == sorted(["wandb", "compare-other", RUN_FILE])
    assert json.loads((out / RUN_FILE).read_text())["present_before"] == ["compare-other", "wandb"]


def test_overwrite_keeps_the_users_files_inside_the_runs_checkpoints_folder(tmp_path):
    """The run's checkpoints (a manifest or run id in a step folder) go; a file or a step-named folder of the user's
    in checkpoints/ stays (it was deleted with the whole folder), and checkpoints/ stays the new run's to claim."""
    from dynabatch.engine.outputs import RUN_FILE, output_dir_problem

    out = tmp_path / "run"
    assert output_dir_problem(str(out), resume=False, overwrite=False, claims=["checkpoints"]) is None
    ckpts = out / "checkpoints"
    for step, marker in (("step-000002", "manifest.json"), ("step-000004", "run_id"), ("step-000003", "my.txt")):
        (ckpts / step).mkdir(parents=True)
        (ckpts / step / marker).write_text("x")
    (ckpts / "README.txt").write_text("mine")
    assert output_dir_problem(str(out), resume=False, overwrite=True, claims=["checkpoints"]) is None
    assert sorted(os.listdir(ckpts)) == ["README.txt", "step-000003"]
    assert (ckpts / "step-000003" / "my.txt").read_text() == "x" and (ckpts / "README.txt").read_text() == "mine"
    record = json.loads((out / RUN_FILE).read_text())
    assert record["present_before"] == [] and record["claimed"] == ["checkpoints"]


def test_resume_writes_only_into_a_folder_a_run_wrote(tmp_path):
    """``--resume-from-checkpoint`` into a folder no run wrote (no run file, no checkpoint) is a fresh run's start:
    refused when it holds anything, nothing touched; a run's folder (run file, or an older run's checkpoints) resumes,
    and the folders the resumed run adds are claimed."""
    from dynabatch.engine.outputs import RUN_FILE, output_dir_problem

    mine = tmp_path / "keep"
    mine.mkdir()
    (mine / "summary.json").write_text('{"mine": 1}')
    problem = output_dir_problem(str(mine), resume=True, overwrite=False, claims=["checkpoints"])
    assert "no dynabatch-run.json or checkpoints/" in problem and "summary.json" in problem
    assert sorted(os.listdir(mine)) == ["summary.json"]
    empty = tmp_path / "new"
    assert output_dir_problem(str(empty), resume=True, overwrite=False, claims=["checkpoints"]) is None
    assert json.loads((empty / RUN_FILE).read_text())["claimed"] == ["checkpoints"]  # recorded as a fresh run's
    (empty / "checkpoints").mkdir()
    assert output_dir_problem(str(empty), resume=True, overwrite=False, claims=["checkpoints", "runs"]) is None
    assert json.loads((empty / RUN_FILE).read_text())["claimed"] == ["checkpoints", "runs"]
    bare = tmp_path / "bare"  # an empty checkpoints/ alone says no run: refused as such, nothing written
    (bare / "checkpoints").mkdir(parents=True)
    problem = output_dir_problem(str(bare), resume=True, overwrite=False)
    assert "holds an empty checkpoints/ folder" in problem and "no checkpoint to resume" in problem
    assert sorted(os.listdir(bare)) == ["checkpoints"] and not os.listdir(bare / "checkpoints")
    older = tmp_path / "older"  # a run from before run files: its checkpoints say whose the folder is
    (older / "checkpoints" / "step-000004").mkdir(parents=True)
    (older / "metrics.jsonl").write_text('{"step": 0}\n')
    assert output_dir_problem(str(older), resume=True, overwrite=False) is None
    assert not (older / RUN_FILE).exists()


def test_resume_into_a_folder_of_the_users_own_is_one_line(tmp_path, capsys):
    out = tmp_path / "keep"
    out.mkdir()
    for name in ("summary.json", "metrics.jsonl", "config.yaml"):
        (out / name).write_text('{"mine": 1}\n')
    before = _tree_digest(out)
    code, err = _train_inproc(tmp_path, capsys, out, "--resume-from-checkpoint")
    assert code == 2, err[-2000:]
    assert "--resume-from-checkpoint" in _error_line(err) and "summary.json" in _error_line(err)
    assert _tree_digest(out) == before


def test_a_corrected_rerun_after_bad_input_starts_in_the_same_folder(tmp_path, capsys):
    out = tmp_path / "run"
    code, err = _train_inproc(tmp_path, capsys, out, "--data", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "not found" in _error_line(err)
    assert sorted(os.listdir(out)) == ["dynabatch-run.json"]  # what it wrote before loading the data
    code, err = _train_inproc(tmp_path, capsys, out)
    assert code == 0, err[-3000:]


def test_output_dir_that_is_a_file_or_unwritable_is_one_line(tmp_path, capsys):
    path = tmp_path / "a-file"
    path.write_text("keep me")
    code, err = _train_inproc(tmp_path, capsys, path)
    assert code == 2 and "is a file, not a folder" in _error_line(err)
    assert path.read_text() == "keep me"
    code, err = _train_inproc(tmp_path, capsys, "/sys/dynabatch-cannot-write-here")
    assert code == 2 and "is not writable" in _error_line(err)


# ------------------------------------------------------------------------------------------------ resume


def test_a_decoder_only_resume_may_change_max_target_len():
    """--max-target-len is T5's limit: a GPT/Llama run resumed with another one goes on (the change is logged), where
    it was refused as a setting that decides the data; a T5 run's resume still refuses it."""
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.resume import compare_configs

    for model in ("gpt2-tiny", "llama-tiny"):
        old = TrainConfig(model=model).to_dict()
        assert compare_configs(old, TrainConfig(model=model, max_target_len=64), "CK") == ["max_target_len: 128 -> 64"]
    with pytest.raises(ValueError, match=r"checkpoint CK was written with other settings that cannot change "
                                         r"\(max_target_len: 128 -> 64\)"):
        compare_configs(TrainConfig(model="t5-tiny").to_dict(), TrainConfig(model="t5-tiny", max_target_len=64), "CK")


def test_resume_refuses_changed_data_settings_and_applies_a_new_lr(tmp_path, toy_mixture_dir, capsys):
    first = _cli(capsys, tmp_path, toy_mixture_dir, "run", "--steps", "2", "--lr", "1e-3", "--warmup-steps", "0",
                 "--lr-schedule", "constant")
    assert first.returncode == 0, first.stderr[-3000:]

    def refused(*extra: str) -> str:  # in-process: a refused resume stops before training
        code = main(["train", "--model", "t5-tiny", *BASE, "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
                     "--output-dir", str(tmp_path / "run"), "--resume", *extra])
        err = capsys.readouterr().err
        assert code == 2, err[-3000:]
        return _error_line(err)

    msg = refused("--steps", "4", "--max-input-len", "96", "--global-batch-tokens", "2048", "--lr-schedule", "constant")
    assert "max_input_len: 128 -> 96" in msg and "global_batch_tokens: 1024 -> 2048" in msg and "cannot change" in msg
    assert "model: 't5-tiny' -> 't5-mini'" in refused("--steps", "4", "--model", "t5-mini")
    assert "past --max-steps 1" in refused("--steps", "1", "--lr", "1e-3", "--warmup-steps", "0", "--lr-schedule", "constant")
    ok = _cli(capsys, tmp_path, toy_mixture_dir, "run", "--steps", "4", "--resume", "--lr", "5e-4", "--warmup-steps", "0",
              "--lr-schedule", "constant")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "learning_rate: 0.001 -> 0.0005" in ok.stdout + ok.stderr
    lrs = {r["step"]: r["lr"] for r in _records(tmp_path / "run")}
    assert sorted(lrs) == [0, 1, 2, 3]  # every step once
    assert lrs[1] == pytest.approx(1e-3) and lrs[2] == pytest.approx(5e-4) and lrs[3] == pytest.approx(5e-4)
    summary = (tmp_path / "run" / "summary.json").read_text()
    done = _cli(capsys, tmp_path, toy_mixture_dir, "run", "--steps", "4", "--resume", "--lr", "5e-4",
                "--warmup-steps", "0", "--lr-schedule", "constant")  # nothing left to train: the summary stays
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").read_text() == summary and json.loads(summary)["runs"][0]["steps"] == 2


def test_resume_on_edited_data_is_one_line(tmp_path, toy_mixture_dir, capsys):
    """A data file that shrank between the run and its resume: one line naming the source, exit 2 (a position in
    the earlier rows, read on the new ones, would index past them or silently draw other samples)."""
    import shutil

    data = tmp_path / "mixture"
    shutil.copytree(toy_mixture_dir, data)
    first = _cli(capsys, tmp_path, str(data), "run", "--steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    lines = (data / "summarize.jsonl").read_text().splitlines(keepends=True)
    (data / "summarize.jsonl").write_text("".join(lines[: len(lines) // 2]))
    before = _tree_digest(tmp_path / "run" / "checkpoints")
    again = _cli(capsys, tmp_path, str(data), "run", "--steps", "4", "--resume")
    assert again.returncode == 2, again.stderr[-3000:]
    msg = _error_line(again.stderr)
    assert "--resume-from-checkpoint" in msg and "the data changed" in msg and "'summarize' had 600 rows" in msg
    assert "Traceback" not in again.stderr
    assert _tree_digest(tmp_path / "run" / "checkpoints") == before


def test_resume_and_config_from_another_folder_with_paths_spelled_otherwise(tmp_path, toy_mixture_dir, capsys,
                                                                            monkeypatch):
    """The run records the files it read as absolute paths (config.yaml, the checkpoints), so a resume from another
    folder, spelling the same data file and columns otherwise, continues; ``--config OUTPUT/config.yaml`` runs from
    anywhere."""
    import shutil

    import yaml

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(os.path.join(toy_mixture_dir, "classify.jsonl"), work / "qa.jsonl")
    monkeypatch.chdir(work)
    args = ["train", "--model", "t5-tiny", *BASE, "--data", "qa.jsonl", "--columns", "inputs=inputs, targets=targets"]
    assert main([*args, "--steps", "1", "--output-dir", "run"]) == 0, capsys.readouterr().err[-3000:]
    recorded = yaml.safe_load((work / "run" / "config.yaml").read_text())
    assert recorded["data"]["data"] == str(work / "qa.jsonl")
    assert recorded["data"]["columns"] == "inputs=inputs,targets=targets"
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--model", "t5-tiny", *BASE, "--data", str(work / "qa.jsonl"), "--columns",
                 "inputs=inputs,targets=targets", "--steps", "2", "--output-dir", str(work / "run"), "--resume"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert [r["step"] for r in _records(work / "run")] == [0, 1]
    code = main(["train", "--config", str(work / "run" / "config.yaml"), "--output-dir", str(tmp_path / "again"),
                 "--steps", "1"])
    assert code == 0, capsys.readouterr().err[-3000:]


# ------------------------------------------------------------------------------------------ config errors


def test_max_grad_norm_zero_trains_without_clipping(tmp_path, capsys):
    """HF's spelling of no clipping: ``--max-grad-norm 0`` trains, the norm still logged."""
    code, err = _train_inproc(tmp_path, capsys, tmp_path / "run", "--max-grad-norm", "0")
    assert code == 0, err[-3000:]
    assert all(r["grad_norm"] > 0 for r in _records(tmp_path / "run"))


@pytest.mark.parametrize("flags, expected", [
    (["--seed", "-1"], "seed must be >= 0, got -1"),
    (["--timeout-s", "nan"], "timeout_s must be a finite number"),
    (["--timeout-s", "0.01"], "timeout_s must be at least 1 second"),
    (["--max-bad-steps", "0"], "max_bad_steps must be >= 1"),
    (["--bad-rows", "maybe"], "invalid choice: 'maybe' (choose from 'error', 'skip')"),
    (["--max-stepz", "3"], "unrecognized arguments: --max-stepz 3 (see `dynabatch train --help`)"),
    (["--dropout", "1.5"], "dropout must be in [0, 1)"),
    (["--eval-steps", "5"], "eval_steps 5 evaluates on evaluation data, and none is given: pass --eval-mixture"),
    (["--eval-samples", "4"], "eval_samples 4 caps evaluation data, and none is given: pass --eval-mixture SPEC or "
                              "--eval-holdout FRACTION, or drop --eval-samples"),
    (["--max-grad-norm", "-1"], "max_grad_norm must be >= 0 and finite (0: no clipping), got -1.0"),
    (["--max-grad-norm", "inf"], "max_grad_norm must be a finite number, got inf"),
])
def test_bad_flag_values_are_one_line(tmp_path, capsys, flags, expected):
    code, err = _train_inproc(tmp_path, capsys, tmp_path / "out", *flags)
    assert code == 2, err[-2000:]
    assert expected in _error_line(err)
    assert "Traceback" not in err


@pytest.mark.parametrize("text, expected", [
    ("steps: [1, 2\nlr: 3", "YAML syntax error at line"),
    ("steps: x", "steps must be a whole number, got 'x'"),
    ("- steps\n- 3", "must hold a mapping of TrainConfig fields"),
    ("mixture: 5", "mixture must be str, got 5 (int)"),
    ("stepz: 3", "unknown config keys ['stepz']"),
    ("optim: 3", "section 'optim' must be a mapping of its fields (each on its own line, indented under 'optim:'), got int 3"),
    ("steps: 3\nlr: 1e-3\nsteps: 5\n", "key 'steps' is given twice (line 3, first at line 1); keep one"),
    ("optim:\n  lr: 1e-3\n  lr: 2e-3\n", "key 'lr' is given twice (line 3, first at line 2); keep one"),
])
def test_bad_config_files_are_one_line(tmp_path, capsys, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code, err = _train_inproc(tmp_path, capsys, tmp_path / "out", "--config", str(path))
    assert code == 2, err[-2000:]
    msg = _error_line(err)
    assert expected in msg and "run.yaml" in msg


def test_yaml_scientific_notation_is_a_number(tmp_path):
    from dynabatch.training.config import TrainConfig, load_config_file

    path = tmp_path / "run.yaml"
    path.write_text("lr: 3e-4\nsteps: '7'\n")
    cfg = TrainConfig(**load_config_file(str(path)))
    assert cfg.learning_rate == pytest.approx(3e-4) and cfg.max_steps == 7
    bad = tmp_path / "run.json"
    bad.write_text('{"lr": 1e-3,}')
    with pytest.raises(ValueError, match=r"run.json: JSON syntax error at line 1"):
        load_config_file(str(bad))
    twice = tmp_path / "twice.json"
    twice.write_text('{"lr": 1e-3,\n "lr": 2e-3}')
    with pytest.raises(ValueError, match=r"twice.json: key 'lr' is given twice \(line 2, first at line 1\); keep one"):
        load_config_file(str(twice))


def test_full_disk_anywhere_is_one_line_with_exit_2(capsys, monkeypatch):
    import errno

    import dynabatch.commands.plan as plan_command

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/summary.json")

    monkeypatch.setattr(plan_command, "run", full)
    assert main(["plan"]) == 2
    msg = _error_line(capsys.readouterr().err, "plan")
    assert "No space left on device writing '/data/run/summary.json'; free disk space" in msg

    def bug(args):
        raise OSError(errno.EBADF, "Bad file descriptor")  # not the storage's fault: a traceback

    monkeypatch.setattr(plan_command, "run", bug)
    with pytest.raises(OSError):
        main(["plan"])
