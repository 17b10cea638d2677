"""Bad input end to end: each mistake gives exit code 2 and a one-line error saying what, where and what to do.

Library-level checks live next to their modules (test_sources, test_mixture, test_batching,
test_plan_step, test_stage_split, test_trainer); these run the CLI (in-process, ``cli.main``) to show
the message a user actually sees.
"""

from __future__ import annotations

import json
import re
import types

import numpy as np
import pytest

from conftest import random_rows, write_jsonl
from dynabatch.cli import main

TRAIN = ["train", "--model", "t5-tiny", "--tokenizer", "byt5", "--global-batch-tokens", "1024",
         "--max-input-len", "128", "--max-target-len", "32", "--log-every", "0", "--no-timeline", "--steps", "1"]


def _spec(tmp_path, sources, **extra) -> str:
    path = tmp_path / "mix.json"
    path.write_text(json.dumps({"name": "bad", "sources": sources, **extra}))
    return str(path)


def _train_error(tmp_path, capsys, *args: str) -> str:
    code = main([*TRAIN, "--output-dir", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if "dynabatch train: error:" in line]
    assert lines, err[-2000:]
    return lines[-1]


def test_empty_source_file_names_the_source(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    msg = _train_error(tmp_path, capsys, "--mixture", _spec(tmp_path, [{"task": "nothing", "data_files": "empty.jsonl"}]))
    assert "source 'nothing' has no rows" in msg and "empty.jsonl" in msg and "remove the source" in msg


def test_invalid_utf8_value_names_the_file(tmp_path, capsys):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"inputs": "a", "targets": "b"}\n{"inputs": "caf\xe9", "targets": "x"}\n')
    msg = _train_error(tmp_path, capsys, "--mixture", _spec(tmp_path, [{"task": "latin", "data_files": "latin1.jsonl"}]))
    assert "source 'latin'" in msg and "latin1.jsonl" in msg and "not valid UTF-8" in msg and "re-encode" in msg


def test_missing_field_names_source_and_row(tmp_path, capsys):
    write_jsonl(tmp_path / "rows.jsonl", [{"inputs": "a", "targets": "b"}, {"inputs": "a", "target": "typo"}])
    msg = _train_error(tmp_path, capsys, "--mixture", _spec(tmp_path, [{"task": "typo", "data_files": "rows.jsonl"}]))
    assert "source 'typo', row 1: missing field 'targets'" in msg and "bad_rows: skip" in msg


def test_overlong_sample_with_overlong_error(tmp_path, capsys):
    write_jsonl(tmp_path / "long.jsonl", [{"inputs": "x " * 300, "targets": "y"}] + random_rows("l", 20, 2, 10, 3))
    msg = _train_error(tmp_path, capsys, "--overlong", "error",
                       "--mixture", _spec(tmp_path, [{"task": "long", "data_files": "long.jsonl"}]))
    assert "of source 'long' has" in msg and "over the limits (max_input_len=128" in msg
    assert "raise the limits, or use --overlong truncate or drop (overlong='truncate' or 'drop' in Python)" in msg


def test_rates_summing_to_zero(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", random_rows("a", 5, 1, 5, 2))
    spec = _spec(tmp_path, [{"task": "a", "data_files": "a.jsonl", "rate": 0.0}], rule="fixed")
    msg = _train_error(tmp_path, capsys, "--mixture", spec)
    assert "sum to zero; give at least one source a positive rate" in msg


def test_missing_mixture_and_tokenizer(tmp_path, capsys):
    msg = _train_error(tmp_path, capsys, "--mixture", str(tmp_path / "nope.json"))
    assert "nope.json' not found" in msg
    msg = _train_error(tmp_path, capsys, "--tokenizer", str(tmp_path / "no-tokenizer"))
    assert "no-tokenizer' is neither one of" in msg and "tokenizer.json" in msg


def test_more_stages_than_blocks_via_cli(tmp_path, capsys, monkeypatch):
    # A 3-process torchrun is too slow for the unit suite: stand in for its world and check the CLI path.
    import dynabatch.training.trainer as trainer

    ctx = types.SimpleNamespace(rank=0, world_size=3, stage_index=0, device="cpu", is_planner=True)
    monkeypatch.setenv("RANK", "0")  # rank 0 of that world: the command does not launch ranks of its own
    monkeypatch.setattr(trainer, "connect", lambda cfg: ctx)
    monkeypatch.setattr(trainer, "shutdown", lambda: None)
    monkeypatch.setattr(trainer, "prepare_output_dir", lambda output_dir, ctx, **kw: None)  # broadcasts in a real world of 3
    monkeypatch.setattr(trainer, "check_same_settings", lambda ctx, given: None)  # gathers in a real world of 3
    msg = _train_error(tmp_path, capsys, "--stages", "3", "--model", "gpt2-tiny")
    assert "number of transformer blocks of this gpt2 model (2), got 3" in msg and "use --stages 2 or fewer" in msg


def test_more_chunks_than_blocks_names_the_placement():
    """``--stages 2 --placement interleaved:2`` on a 2-block model: the four chunks are named, not a number of stages
    the user never gave (checked before any data is loaded)."""
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import check_num_stages
    from dynabatch.schedule.placement import Placement

    model = build_model("gpt2-tiny")
    check_num_stages(model, 2, Placement.parse("linear", 2))
    with pytest.raises(ValueError, match=r"--placement interleaved:2 cuts 2 stages into 4 chunks, more than the 2 "
                                         r"transformer blocks of this gpt2 model"):
        check_num_stages(model, 2, Placement.parse("interleaved:2", 2))


def test_gpt_sample_too_big_for_memory_names_it_and_hints_slicing(tmp_path, capsys):
    rng = np.random.default_rng(0)
    e = rng.integers(50, 400, 200)
    e[5] = 8000
    path = tmp_path / "lens.npz"
    np.savez(path, input_len=e, target_len=rng.integers(1, 20, 200))
    args = ["plan", "--lengths", str(path), "--model", "gpt", "--preset", "gpt-6.7b", "--stages", "4",
            "--max-input-len", "8192", "--num-batches", "1", "--global-batch-tokens", "20000"]
    # every method (the default): dynamic is left out, and dynamic_sliced cannot fit the sample either: its error,
    # one line (the left-out warning is said only when the run goes on)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sample 5 of global batch 0" in err[0] and "even when sliced" in err[0]
    assert main([*args, "--methods", "dynamic,token_budget"]) == 2
    msg = capsys.readouterr().err
    assert "dynabatch plan: error: sample 5 of global batch 0 (input_len=8000, target_len=" in msg
    assert "The smallest budget that fits every sample is" in msg
    assert "(or use --methods dynamic_sliced to cut such samples into token slices)" in msg  # plan's method name


@pytest.mark.parametrize("kernel,expected", [("varlen", "--attention-kernel varlen needs CUDA"),
                                             ("flex", "--attention-kernel flex cannot train on CPU")])
def test_an_attention_kernel_that_cannot_train_here_is_refused(tmp_path, capsys, kernel, expected):
    from dynabatch.models import attention_kernels

    assert attention_kernels.attention_kernel() == "auto"  # in-process runs (train, bench) give the process its own back
    msg = _train_error(tmp_path, capsys, "--attention-kernel", kernel)
    assert expected in msg and "use auto or sdpa" in msg
    assert attention_kernels.attention_kernel() == "auto"  # refused before it was set


@pytest.mark.parametrize("pack_rows", ["auto", "flat"])
def test_packed_rows_with_dense_attention_are_refused(tmp_path, capsys, pack_rows):
    msg = _train_error(tmp_path, capsys, "--attention", "dense", "--pack-rows", pack_rows)
    assert f"--pack-rows {pack_rows} puts several samples in a padding-free row; it needs --attention segments" in msg


def test_a_model_folder_a_run_cannot_load_is_one_line_before_anything_loads(tmp_path, capsys):
    """A folder with config.json but no weights (a half-copied checkpoint), a folder without config.json, a file, a
    path that does not exist: one line naming what is missing, and no output folder is left behind."""
    from transformers import T5Config

    broken = tmp_path / "broken"
    T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=384).save_pretrained(broken)
    (tmp_path / "empty").mkdir()
    (tmp_path / "data.jsonl").write_text("{}\n")
    cases = {str(broken): "holds config.json but no weights", str(tmp_path / "empty"): "holds no config.json",
             str(tmp_path / "data.jsonl"): "is a file, not a model folder", str(tmp_path / "nope"): "no such folder"}
    for model, expected in cases.items():
        out = tmp_path / "out"
        code = main(["train", "--model", model, "--tokenizer", "byt5", "--steps", "1", "--output-dir", str(out)])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if "dynabatch train: error:" in ln]
        assert code == 2 and len(lines) == 1 and expected in lines[0] and "save_pretrained" in lines[0], err[-2000:]
        assert "Traceback" not in err and not out.exists()


def test_two_ranks_refuse_a_bad_model_or_tokenizer_once_before_the_launch(tmp_path):
    import subprocess
    import sys

    for flags, expected in ((["--tokenizer", "bogus"], "tokenizer 'bogus' is neither"),
                            (["--model", str(tmp_path / "nope")], "no such folder")):
        r = subprocess.run([sys.executable, "-m", "dynabatch", "train", "--stages", "2", "--steps", "1",
                            "--output-dir", str(tmp_path / "out"), *flags], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.count("error:") == 1 and expected in r.stderr, r.stderr[-2000:]
        assert "[rank" not in r.stderr and not (tmp_path / "out").exists()  # no rank started


def test_more_stages_than_blocks_is_refused_once_before_the_launch(tmp_path):
    """``--stages 3`` on gpt2-tiny (2 blocks): the launcher says so in one line with the fix, before any rank starts
    (the ranks used to start, load the model and refuse it each, after most of a minute on 2 cores)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dynabatch", "train", "--stages", "3", "--model", "gpt2-tiny",
                        "--steps", "1", "--output-dir", str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr[-2000:]
    assert ("--stages must be between 1 and the number of transformer blocks of this gpt2 model (2), got 3; "
            "use --stages 2 or fewer") in r.stderr, r.stderr[-2000:]
    assert "[rank" not in r.stderr and not (tmp_path / "out").exists()  # no rank started


def test_blocks_of_a_model_folder_are_read_from_its_config_alone(tmp_path):
    from transformers import GPT2Config, LlamaConfig, T5Config

    from dynabatch.model_presets import num_blocks, stages_problem

    T5Config(num_layers=3, num_decoder_layers=2).save_pretrained(tmp_path / "t5")
    T5Config(num_layers=3).save_pretrained(tmp_path / "t5-same")
    GPT2Config(n_layer=5).save_pretrained(tmp_path / "gpt2")
    LlamaConfig(num_hidden_layers=7).save_pretrained(tmp_path / "llama")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    assert num_blocks(str(tmp_path / "t5")) == ("t5", 5)
    assert num_blocks(str(tmp_path / "t5-same")) == ("t5", 6)
    assert num_blocks(str(tmp_path / "gpt2")) == ("gpt2", 5)
    assert num_blocks(str(tmp_path / "llama")) == ("llama", 7)
    assert num_blocks("t5-tiny") == ("t5", 4) and num_blocks("llama-tiny") == ("llama", 2)
    assert num_blocks(str(tmp_path / "bad")) is None and num_blocks("nosuch") is None
    assert stages_problem(str(tmp_path / "llama"), 7) is None
    assert stages_problem(str(tmp_path / "llama"), 8).endswith("got 8; use --stages 7 or fewer, or a model with more blocks")


def test_columns_without_data_is_one_line_with_the_fix_before_anything_loads(tmp_path, capsys):
    """``dynabatch train --columns ...`` without ``--data`` (the built-in mixture, or ``--mixture``): one line saying to
    pass --data or drop --columns, before the model is built (the line used to come after it, without a fix)."""
    out = tmp_path / "out"
    for extra in ([], ["--mixture", _spec(tmp_path, [{"task": "t", "data_files": "x.jsonl"}])]):
        code = main(["train", "--columns", "inputs=question", "--steps", "1", "--output-dir", str(out), *extra])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if "dynabatch train: error:" in ln]
        assert code == 2 and len(lines) == 1, err[-2000:]
        assert "pass --data FILE with it, or drop --columns" in lines[0], lines[0]
        assert "tokenizer:" not in err and not out.exists()  # nothing loaded, nothing written


def test_a_bad_eval_mixture_is_one_line_naming_the_flag_before_anything_loads(tmp_path, capsys):
    """A missing ``--eval-mixture`` file, or a data file passed as the spec: one line naming the flag, before the
    model and the training data load (rank 0 read it only after them and the start-up lines, as 'mixture spec')."""
    data = tmp_path / "qa.jsonl"
    data.write_text('{"inputs": "a", "targets": "b"}\n{"inputs": "c", "targets": "d"}\n')
    out = tmp_path / "out"
    for spec, says in ((tmp_path / "missing.yaml", "not found"), (data, "unknown file type ('.jsonl')")):
        code = main(["train", "--eval-mixture", str(spec), "--steps", "1", "--output-dir", str(out)])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if "dynabatch train: error:" in ln]
        assert code == 2 and len(lines) == 1, err[-2000:]
        assert "--eval-mixture: mixture spec " in lines[0] and says in lines[0], lines[0]
        assert "tokenizer:" not in err and not out.exists()  # nothing loaded, nothing written


def test_bench_refuses_more_stages_than_blocks_before_the_launch(tmp_path, capsys):
    code = main(["bench", "--model", "gpt2-tiny", "--stages", "3", "--timed-steps", "1", "--untimed-steps", "0"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert code == 2 and len(lines) == 1 and "[rank" not in err, err[-2000:]
    assert "transformer blocks of this gpt2 model (2), got 3; use --stages 2 or fewer" in lines[0], lines[0]


def test_a_global_batch_below_one_sample_per_replica_is_refused_before_the_launch(tmp_path):
    """2 replicas of t5-tiny with 256 tokens a step and 32 + 128 tokens a sample: one line from the launcher, naming
    the flag and the least budget (each rank used to say it after start-up, as ``global_batch_tokens 256 ...``)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dynabatch", "train", "--replicas", "2", "--model", "t5-tiny",
                        "--max-input-len", "32", "--global-batch-tokens", "256", "--steps", "1",
                        "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr[-2000:]
    assert ("--global-batch-tokens 256 holds less than one maximal sample (max_input_len=32, max_target_len=128, "
            "160 tokens) per replica (2)") in r.stderr and "raise it to at least 320" in r.stderr, r.stderr[-2000:]
    assert "[rank" not in r.stderr and not (tmp_path / "out").exists()  # no rank started


def test_a_decoder_only_global_batch_needs_only_its_sequence_limit(tmp_path, capsys):
    """A decoder-only sample is at most --max-input-len tokens in all (--max-target-len is T5's): a budget of one
    such sequence trains; a T5 budget below its input + target limits is one line, before the launch and in the
    trainer alike (the configuration used to add T5's default target limit for every model and refuse both)."""
    from dynabatch.commands.train import _budget_problem
    from dynabatch.training.config import TrainConfig

    gpt = TrainConfig(model="gpt2-tiny", max_input_len=32, global_batch_tokens=32)
    assert _budget_problem(gpt) is None
    t5 = TrainConfig(model="t5-tiny", max_input_len=32, global_batch_tokens=32)
    want = ("--global-batch-tokens 32 cannot hold one maximal sample (max_input_len=32, max_target_len=128, 160 "
            "tokens); raise it to at least 160 or lower the length limits")
    with pytest.raises(ValueError, match=re.escape(want)):
        _budget_problem(t5)
    assert main(["train", "--model", "t5-tiny", "--max-input-len", "32", "--global-batch-tokens", "32",
                 "--output-dir", str(tmp_path / "t5")]) == 2
    assert capsys.readouterr().err.strip().endswith(want)
    assert main(["train", "--model", "gpt2-tiny", "--max-input-len", "32", "--global-batch-tokens", "32",
                 "--steps", "1", "--calibrate", "off", "--output-dir", str(tmp_path / "gpt")]) == 0


def test_sequence_kind_of_a_preset_or_folder(tmp_path):
    from transformers import GPT2Config, T5Config

    from dynabatch.model_presets import sequence_kind

    T5Config(num_layers=1).save_pretrained(tmp_path / "t5")
    GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    assert sequence_kind(str(tmp_path / "t5")) == "seq2seq" and sequence_kind(str(tmp_path / "gpt2")) == "causal"
    assert sequence_kind("t5-tiny") == "seq2seq" and sequence_kind("llama-tiny") == "causal"
    assert sequence_kind("gpt") == "causal" and sequence_kind("nosuch") is None
