"""A user's own model folder and data, without silent traps: the folder's own tokenizer by default (and a
mismatched one refused at start), an export whose tokenizer encodes as training did (and the inference
snippets of docs/inference.md run against it), tasks of a ``task`` column in ``data-report`` and ``bench
--data``, and evaluation that sees every held-out row exactly once."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import numpy as np
import pytest

from conftest import WORDS, random_rows, write_jsonl
from dynabatch.cli import main

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "inference.md")
SMALL = ["--global-batch-tokens", "1024", "--max-input-len", "128", "--max-target-len", "32", "--max-steps", "1",
         "--no-timeline", "--calibrate", "off", "--logging-steps", "0", "--task-loss-every", "0"]


def own_tokenizer(specials=("<pad>", "</s>", "<unk>"), vocab_size: int = 400):
    """A small byte-level BPE trained on the toy words: another vocabulary than the built-in tokenizer's; the
    special tokens get ids 0, 1, 2 in the order of ``specials``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def model_folder(path, tokenizer, preset: str = "t5-tiny") -> str:
    """A model folder as a user writes it: ``save_pretrained`` of a tiny model (pad 0, EOS 1) and of its tokenizer."""
    from dynabatch.model_presets import build_config, model_class

    config = build_config(preset, vocab_size=len(tokenizer))
    model_class(config).from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _snippet(index: int, folder: str) -> list[str]:
    """Run the ``index``-th Python block of docs/inference.md on ``folder``; what it printed, evaluated."""
    with open(DOCS, encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    code = blocks[index]
    assert 'folder = "hf-out"' in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace('folder = "hf-out"', f"folder = {folder!r}"), DOCS, "exec"), {})
    import ast

    return ast.literal_eval(out.getvalue().strip())


def _first_row(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.loads(f.readline())


# ---------------------------------------------------------------------------------------------- tokenizer


def test_a_model_folder_trains_with_its_own_tokenizer_and_its_export_encodes_as_training(tmp_path, capsys,
                                                                                          toy_mixture_dir):
    from transformers import AutoTokenizer

    from dynabatch.data.mixture import MixtureSpec
    from dynabatch.data.pipeline import MixtureData
    from dynabatch.data.tokenize import load_tokenizer

    tok = own_tokenizer()
    folder = model_folder(tmp_path / "my-t5", tok)
    out = tmp_path / "run"
    mixture = os.path.join(toy_mixture_dir, "toy.json")
    code = main(["train", "--model", folder, "--mixture", mixture, "--output-dir", str(out), *SMALL])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert f"tokenizer: {folder} (the --model folder's own (--tokenizer auto); vocabulary {len(tok)}," in err
    with open(out / "summary.json") as f:
        assert json.load(f)["config"]["tokenizer"] == folder

    hf = str(tmp_path / "hf-out")
    assert main(["export", str(out / "checkpoints"), hf]) == 0
    exported = AutoTokenizer.from_pretrained(hf)
    assert len(exported) == len(tok) != len(load_tokenizer("builtin"))
    data = MixtureData.load(MixtureSpec.from_file(mixture), load_tokenizer(folder), "seq2seq")
    row = _first_row(os.path.join(toy_mixture_dir, "short.jsonl"))  # row 0 of source 0
    trained_inputs, trained_targets = data.sources[0].input_ids[0].tolist(), data.sources[0].target_ids[0].tolist()
    assert trained_inputs[-1] == trained_targets[-1] == exported.eos_token_id == 1
    assert exported(row["inputs"])["input_ids"] == trained_inputs  # EOS included, as training fed the encoder
    assert exported(text_target=row["targets"])["input_ids"] == trained_targets
    with open(os.path.join(hf, "dynabatch_export.json")) as f:
        assert json.load(f)["encoding"] == "tokenizer(text) (EOS appended, as in training)"
    answers = _snippet(0, hf)  # docs/inference.md, encoder-decoder
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)


def test_a_preset_uses_the_builtin_tokenizer_and_a_causal_export_encodes_prompts_without_eos(tmp_path, capsys,
                                                                                               toy_mixture_dir):
    from transformers import AutoTokenizer

    from dynabatch.data.mixture import MixtureSpec
    from dynabatch.data.pipeline import MixtureData
    from dynabatch.data.tokenize import load_tokenizer

    out = tmp_path / "run"
    mixture = os.path.join(toy_mixture_dir, "toy.json")
    assert main(["train", "--model", "gpt2-tiny", "--mixture", mixture, "--output-dir", str(out), *SMALL]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "tokenizer: builtin" in line]
    assert said and said[0].endswith("tokenizer: builtin (--tokenizer auto with a model preset; vocabulary 8192, pad 0, "
                                     "eos 1)"), said  # no decoder start: a decoder-only model has none
    hf = str(tmp_path / "hf-out")
    assert main(["export", str(out / "checkpoints"), hf]) == 0
    exported = AutoTokenizer.from_pretrained(hf)
    data = MixtureData.load(MixtureSpec.from_file(mixture), load_tokenizer("builtin"), "causal")
    row = _first_row(os.path.join(toy_mixture_dir, "short.jsonl"))
    assert exported(row["inputs"])["input_ids"] == data.sources[0].input_ids[0].tolist()  # the prompt, no EOS
    answers = _snippet(1, hf)  # docs/inference.md, decoder-only
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)


@pytest.mark.parametrize("name", ["builtin", "gpt2"])
@pytest.mark.parametrize("family", ["seq2seq", "causal"])
def test_the_saved_inference_tokenizer_encodes_inputs_as_tokenize_dataset(tmp_path, name, family):
    from transformers import AutoTokenizer

    from dynabatch.data.source_spec import SourceSpec
    from dynabatch.data.sources import load_source
    from dynabatch.data.tokenize import inference_tokenizer, load_tokenizer, tokenize_dataset

    text = "Reverse the words: alpha beta gamma"
    path = write_jsonl(tmp_path / "a.jsonl", [{"inputs": text, "targets": "gamma beta alpha"}])
    ds, _ = load_source(SourceSpec(task="a", data_files=(path,)))
    tok = load_tokenizer(name)
    trained = tokenize_dataset(ds, tok, family)[0]
    inference_tokenizer(tok, family).save_pretrained(tmp_path / "saved")
    saved = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert saved(text)["input_ids"] == trained["input_ids"]
    assert (trained["input_ids"][-1] == tok.eos_token_id) == (family == "seq2seq")
    assert tok(text)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]  # the original is untouched
    # a decoder-only export pads prompts on the left, so batched generation continues each from its own end
    assert saved.padding_side == ("right" if family == "seq2seq" else "left")
    assert tok.padding_side == "right"


def bos_tokenizer():
    """:func:`own_tokenizer` with a BOS (``<s>``, id 3) that its own call puts first, as a Llama-3 tokenizer does."""
    from tokenizers import processors

    tok = own_tokenizer(specials=("<pad>", "</s>", "<unk>", "<s>"))
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 3)])
    tok.bos_token = "<s>"
    return tok


def test_a_decoder_only_prompt_starts_with_the_bos_the_tokenizer_itself_adds(tmp_path):
    """Where ``tokenizer(text)`` starts with BOS, a decoder-only model trains on prompts that start with it and the
    export's tokenizer gives the same ids; targets get no BOS, and an encoder-decoder's inputs none either."""
    from transformers import AutoTokenizer

    from dynabatch.data.source_spec import SourceSpec
    from dynabatch.data.sources import load_source
    from dynabatch.data.tokenize import encodes_like_training, inference_tokenizer, input_start, tokenize_dataset

    text, target = "alpha beta gamma", "gamma beta alpha"
    path = write_jsonl(tmp_path / "a.jsonl", [{"inputs": text, "targets": target}])
    ds, _ = load_source(SourceSpec(task="a", data_files=(path,)))
    tok = bos_tokenizer()
    plain = tok(text, add_special_tokens=False)["input_ids"]
    assert tok(text)["input_ids"] == [3, *plain] and input_start(tok, "causal") == [3]
    trained = tokenize_dataset(ds, tok, "causal")[0]
    assert trained["input_ids"] == tok(text)["input_ids"]
    assert trained["target_ids"] == tok(target, add_special_tokens=False)["input_ids"] + [1]
    assert tokenize_dataset(ds, tok, "seq2seq")[0]["input_ids"] == plain + [1]
    inference_tokenizer(tok, "causal").save_pretrained(tmp_path / "saved")
    saved = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert saved(text)["input_ids"] == trained["input_ids"] and encodes_like_training(saved, "causal", [3])
    assert not encodes_like_training(saved, "causal", [])  # the check sees a BOS training did not put there


def test_the_inference_tokenizer_of_one_without_a_pad_token_pads_with_eos(tmp_path):
    """A Llama-style tokenizer has no pad token: training pads with EOS, and the export's tokenizer gets EOS as its
    pad, so the documented ``tok(texts, return_tensors="pt", padding=True)`` works (it raised "Asking to pad but the
    tokenizer does not have a padding token") and pads a prompt on the left with it."""
    from transformers import AutoTokenizer

    from dynabatch.data.tokenize import inference_tokenizer, tokenizer_info

    tok = bos_tokenizer()
    tok.pad_token = None
    assert tok.pad_token_id is None and tokenizer_info(tok).pad_id == 1
    inference_tokenizer(tok, "causal").save_pretrained(tmp_path / "saved")
    saved = AutoTokenizer.from_pretrained(tmp_path / "saved")
    batch = saved(["alpha", "alpha beta gamma"], padding=True)["input_ids"]
    assert saved.pad_token_id == 1 and batch[0][0] == 1 and batch[1][0] == 3
    assert tok.pad_token is None  # the run's tokenizer is untouched


def _refusal(capsys, *argv) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("dynabatch train: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_a_tokenizer_that_does_not_fit_the_model_is_refused_at_start(tmp_path, capsys, toy_mixture_dir):
    folder = model_folder(tmp_path / "my-t5", own_tokenizer())
    common = ["--mixture", os.path.join(toy_mixture_dir, "toy.json"), *SMALL]
    line = _refusal(capsys, "train", "--model", folder, "--tokenizer", "builtin", "--output-dir",
                    str(tmp_path / "a"), *common)
    assert f"tokenizer builtin does not fit model {folder}: its vocabulary has 8192 tokens" in line
    assert "rows; pass the tokenizer the model was trained with" in line
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    # the same vocabulary size, but EOS and pad swapped: the config's ids are not the tokenizer's
    swapped = own_tokenizer(("</s>", "<pad>", "<unk>"))
    swapped.save_pretrained(tmp_path / "swapped")
    line = _refusal(capsys, "train", "--model", folder, "--tokenizer", str(tmp_path / "swapped"), "--output-dir",
                    str(tmp_path / "b"), *common)
    assert "does not match model" in line
    assert "pad_token_id 0 in the config, 1 in the tokenizer" in line and "eos_token_id 1 in the config, 0" in line


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_model_folder_trains_fp32_weights(tmp_path, dtype):
    """A folder saved in bf16/fp16 (as most hub checkpoints are) is trained with fp32 weights holding the saved
    values: ``from_pretrained`` alone would keep the half dtype, and AdamW would then update half weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from dynabatch.data.tokenize import tokenizer_info
    from dynabatch.models.presets import build_run_model

    tok = own_tokenizer()
    folder = model_folder(tmp_path / "my-llama", tok, preset="llama-tiny")
    saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(getattr(torch, dtype))
    saved.save_pretrained(folder)
    model = build_run_model(folder, "auto", tokenizer_info(tok), "causal")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    expected = saved.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name].float()), name


@pytest.mark.parametrize("preset", ["t5-tiny", "gpt2-tiny", "llama-tiny"])
def test_dropout_of_a_model_folder_is_the_runs_dropout(tmp_path, preset):
    """A folder whose config sets dropout 0.1 (T5's and GPT-2's defaults) trains with ``--dropout``, the rate the
    run prices in memory, seeds and records; it used to keep its own rate and ignore the flag. The log says so."""
    import torch

    from dynabatch.data.tokenize import tokenizer_info
    from dynabatch.model_presets import build_config, describe_dropout, model_class
    from dynabatch.models.presets import build_run_model

    tok = own_tokenizer()
    folder = str(tmp_path / "my-model")
    config = build_config(preset, vocab_size=len(tok), dropout=0.1)
    model_class(config).from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    kind = "seq2seq" if preset.startswith("t5") else "causal"
    for rate in (0.0, 0.3):
        model = build_run_model(folder, "auto", tokenizer_info(tok), kind, dropout=rate)
        rates = {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)}
        rates |= {getattr(m, "attention_dropout") for m in model.modules() if hasattr(m, "attention_dropout")}
        assert rates == {rate}, (rate, rates)
    line = describe_dropout(folder, 0.0)
    assert line is not None and line.startswith(f"model {folder}: dropout 0.0 (--dropout) in place of its config's ")
    assert "0.1" in line and describe_dropout(folder, 0.1) is None and describe_dropout(preset, 0.0) is None


# ---------------------------------------------------------------------------------------------- tasks


def _task_file(tmp_path, names=("inputs", "targets", "task")) -> str:
    rows = [r for t, n in (("qa", 30), ("sum", 20), ("cls", 10)) for r in random_rows(t, n, len(t), 8, 3)]
    rows = [{new: r[old] for old, new in zip(("inputs", "targets", "task"), names)} for r in rows]
    return write_jsonl(tmp_path / "mydata.jsonl", rows)


@pytest.mark.parametrize("columns", [[], ["--columns", "task=task"]])
def test_data_report_of_a_file_with_a_task_field_reports_its_tasks(tmp_path, capsys, columns):
    path = _task_file(tmp_path)
    code = main(["data-report", "--data", path, *columns, "--tokenizer", "byt5", "--family", "seq2seq",
                 "--max-lens", "128", "--num-batches", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "== tasks (seq2seq, 3 tasks in 1 source) ==" in out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()
            if line.split()[:1] in (["qa"], ["sum"], ["cls"])}
    assert {t: int(v[0]) for t, v in rows.items()} == {"qa": 30, "sum": 20, "cls": 10}
    assert {t: float(v[1]) for t, v in rows.items()} == {"qa": 0.5, "sum": pytest.approx(0.333, abs=1e-3),
                                                         "cls": pytest.approx(0.167, abs=1e-3)}
    assert "mydata " not in out  # no task named after the file


def test_bench_reads_data_with_columns_and_a_tokenizer_as_train_does(tmp_path, capsys):
    path = _task_file(tmp_path, names=("question", "answer", "category"))
    out = str(tmp_path / "bench.json")
    code = main(["bench", "--data", path, "--columns", "inputs=question,targets=answer,task=category",
                 "--tokenizer", "byt5", "--model", "t5-tiny", "--stages", "1", "--methods", "dynamic,padding",
                 "--timed-steps", "1", "--untimed-steps", "0", "--max-input-len", "128", "--global-batch-tokens",
                 "1024", "--calibrate", "off", "--json", out])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    with open(out) as f:
        result = json.load(f)
    assert result["config"]["data"] == path and set(result["methods"]) == {"dynamic", "padding"}
    assert f"t5-tiny on {path}:" in captured.out
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["data"] == path and min(summary["tokens_per_s"].values()) > 0
    code = main(["bench", "--data", path, "--lengths", path, "--model", "t5-tiny", "--stages", "1"])
    assert code == 2 and "give --data or --lengths, not both" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- evaluation


def test_train_evaluates_every_held_out_row_once(tmp_path, toy_mixture_dir, byt5):
    from dynabatch.training.config import TrainConfig
    from dynabatch.data.mixture import MixtureSpec
    from dynabatch.data.pipeline import MixtureData
    from dynabatch.training.evaluate import hold_out
    from dynabatch.training.trainer import train

    mixture = os.path.join(toy_mixture_dir, "toy.json")
    cfg = TrainConfig.of(model="t5-tiny", tokenizer="byt5", mixture=mixture, global_batch_tokens=1024,
                         max_input_len=128, max_target_len=32, max_steps=1, timeline=False, calibrate="off",
                         logging_steps=0, task_loss_every=0, output_dir=str(tmp_path / "o"), eval_holdout=0.1,
                         generate_every=0, generation_max_new_tokens=1)
    summary = train(cfg)
    _, held = hold_out(MixtureData.load(MixtureSpec.from_file(mixture), byt5, "seq2seq"), 0.1, seed=7)
    num_rows = sum(len(s) for s in held.sources)
    target_tokens = sum(int(np.minimum(s.target_ids.lengths, 32).sum()) for s in held.sources)
    ev = summary["runs"][0]["eval"]
    assert num_rows == 4 + 15 + 60 and ev["samples"] == num_rows
    assert ev["loss_tokens"] == target_tokens  # each held-out row's (truncated) targets once


def test_an_each_row_once_loader_evaluates_every_row_once(toy_data, tmp_path):
    from transformers import TrainingArguments

    from dynabatch.data.batching import LengthLimits
    from dynabatch.integrations.dataloader import DynaBatchDataLoader, sample_loss_tokens
    from dynabatch.integrations.trainer import DynaBatchTrainer
    from dynabatch.models.presets import build_model
    from dynabatch.training.evaluate import hold_out

    _, held = hold_out(toy_data, 0.1, seed=7)
    limits = LengthLimits(toy_data.family, max_input_len=96, max_target_len=32, max_seq_len=128)
    loader = DynaBatchDataLoader(held, limits, token_budget=600, each_row_once=True)
    steps = list(loader)
    assert len(loader) == len(steps) > 1 and len(list(loader)) == len(steps)  # finite, and the same every pass
    seen = sorted((s.source_index, s.row_index) for st in steps for mb in st.micro_batches
                  for row in mb.sample_ids for i in row for s in [st.batch.samples[i]])
    assert seen == sorted((k, r) for k, src in enumerate(held.sources) for r in range(len(src)))  # each row once
    loss_tokens = sum(sum(sample_loss_tokens(st.batch, toy_data.family)) for st in steps)
    seq2seq = toy_data.family == "seq2seq"
    model = build_model("t5-tiny" if seq2seq else "gpt2-tiny", vocab_size=toy_data.tokens.vocab_size, seed=1)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True)
    metrics = DynaBatchTrainer(model=model, args=args, eval_loader=loader).evaluate()
    assert metrics["eval_loss_tokens"] == loss_tokens
    if seq2seq:  # loss tokens are the rows' (truncated) target tokens
        assert loss_tokens == sum(int(np.minimum(s.target_ids.lengths, 32).sum()) for s in held.sources)
    capped = DynaBatchDataLoader(held, limits, token_budget=600, each_row_once=True, eval_samples=3)
    tasks = [s.task for st in capped for s in st.batch.samples]
    assert sorted(tasks) == sorted(["short"] * 3 + ["classify"] * 3 + ["summarize"] * 3)
    with pytest.raises(ValueError, match="eval_samples caps the rows of an each_row_once loader"):
        DynaBatchDataLoader(held, limits, token_budget=600, eval_samples=3)


def test_a_model_folder_without_eos_or_pad_takes_the_tokenizers_and_keeps_its_own_otherwise(tmp_path):
    """``Qwen2Config()`` leaves ``eos_token_id`` and ``pad_token_id`` unset, so an exported model's ``generate`` would
    never stop and its batched classification head would refuse: the run's model takes the tokenizer's EOS and pad
    (EOS for a tokenizer without a pad token, as training pads; config and generation config), the pad after the
    model is built, so that the EOS embedding row still trains; a start line says so. A folder's own ids stay, and a
    tokenizer without EOS is refused in one line."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, ByT5Tokenizer, Qwen2Config

    from dynabatch.data.tokenize import tokenizer_info
    from dynabatch.model_presets import build_model, describe_unset_pad

    small = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128)
    bare, own = str(tmp_path / "bare"), str(tmp_path / "own")
    AutoModelForCausalLM.from_config(Qwen2Config(**small, eos_token_id=None, pad_token_id=None)).save_pretrained(bare)
    AutoModelForCausalLM.from_config(Qwen2Config(**small, eos_token_id=7, pad_token_id=5)).save_pretrained(own)
    ids = {"pad_token_id": 1, "eos_token_id": 1, "bos_token_id": 1}  # a tokenizer without a pad token pads with EOS
    model = build_model(bare, special_ids=ids)
    assert model.config.eos_token_id == 1 and model.generation_config.eos_token_id == 1
    assert model.config.pad_token_id == 1 and model.generation_config.pad_token_id == 1
    assert model.config.bos_token_id is None
    assert model.model.embed_tokens.padding_idx is None  # built without it: the EOS (= pad) row trains
    model(input_ids=torch.tensor([[1, 3, 4]]), labels=torch.tensor([[1, 3, 4]])).loss.backward()
    assert model.model.embed_tokens.weight.grad[1].abs().sum() > 0
    line = describe_unset_pad(bare, 1)
    assert line.startswith(f"model {bare}: its config has no pad_token_id; the run pads with the tokenizer's pad 1")
    assert describe_unset_pad(own, 1) is None and describe_unset_pad("gpt2-tiny", 1) is None
    exported = str(tmp_path / "exported")
    model.save_pretrained(exported)
    classifier = AutoModelForSequenceClassification.from_pretrained(exported, num_labels=2)
    assert classifier(input_ids=torch.tensor([[3, 4, 1], [1, 3, 4]])).logits.shape == (2, 2)  # needs the pad id
    kept = build_model(own, special_ids=ids)
    assert (kept.config.eos_token_id, kept.config.pad_token_id) == (7, 5)
    with pytest.raises(ValueError, match="^tokenizer ByT5Tokenizer has no EOS token; set tokenizer.eos_token$"):
        no_eos = ByT5Tokenizer()
        no_eos.eos_token = None
        tokenizer_info(no_eos)
