"""`dynabatch train / export` on save_pretrained folders of Llama-style models, and the start-up checks.

A random-weight Qwen2 folder (GQA, untied head) with the tokenizer's files beside it trains in this
process with a checkpoint, resumes, exports to a folder that ``AutoModelForCausalLM`` loads and
``generate()`` runs on; a Llama folder trains as 2 pipeline stages under torchrun with token slices.
Unsupported models and length limits above a position table fail at start with one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from dynabatch.cli import main
from family_configs import build, decoder_config

COMMON = ["--tokenizer", "byt5", "--global-batch-tokens", "1024", "--max-input-len", "160", "--log-every", "0",
          "--no-timeline", "--lr", "3e-3"]


def _folder(tmp_path, model_type: str, byt5) -> str:
    path = str(tmp_path / model_type)
    build(decoder_config(model_type, vocab_size=512)).save_pretrained(path)
    byt5.save_pretrained(path)
    return path


def _run(cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _losses(out_dir) -> list[float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_train_resume_export_generate_qwen2_folder(tmp_path, toy_mixture_dir, byt5, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    def cli(*argv: str) -> None:  # in this process: no subprocess imports
        code = main(list(argv))
        err = capsys.readouterr().err
        assert code == 0, err[-2000:]

    model_dir, out = _folder(tmp_path, "qwen2", byt5), str(tmp_path / "run")
    train = ["train", "--model", model_dir, *COMMON, "--output-dir", out,
             "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--checkpoint-every", "4"]
    cli(*train, "--steps", "4")
    cli(*train, "--steps", "6", "--resume")
    losses = _losses(out)
    assert len(losses) == 6 and losses[-1] < losses[0]
    cli("export", os.path.join(out, "checkpoints"), str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.num_key_value_heads == 2
    fresh = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.equal(model.lm_head.weight, fresh.lm_head.weight)  # trained, untied head exported
    ids = torch.tensor([[5, 6, 7]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 7)


def test_torchrun_two_stages_with_token_slices_llama_folder(tmp_path, toy_mixture_dir, byt5):
    model_dir, out = _folder(tmp_path, "llama", byt5), str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "dynabatch",
           "train", "--model", model_dir, "--stages", "2", "--steps", "3", "--slice-long", *COMMON,
           "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--output-dir", out]
    done = _run(cmd)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(_losses(out)) == 3


def _error(capsys, *args: str) -> str:
    code = main(["train", *COMMON, "--steps", "1", *args])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    return next(line for line in err.splitlines() if "dynabatch train: error:" in line)


def test_unsupported_models_and_position_limits_fail_at_start(tmp_path, capsys):
    from transformers import AutoConfig, GPT2Config

    bart = tmp_path / "bart"
    AutoConfig.for_model("bart").save_pretrained(bart)  # a config alone: the check needs no weights or data
    msg = _error(capsys, "--model", str(bart), "--output-dir", str(tmp_path / "o1"), "--mixture", "missing.yaml")
    assert "model type 'bart' is not supported" in msg and "llama (LlamaForCausalLM, Qwen2ForCausalLM" in msg
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_positions=128, n_embd=32, n_layer=2, n_head=2, vocab_size=512).save_pretrained(gpt2)
    msg = _error(capsys, "--model", str(gpt2), "--output-dir", str(tmp_path / "o2"), "--mixture", "missing.yaml")
    assert "is 160 tokens but this gpt2 model has only 128 positions" in msg
