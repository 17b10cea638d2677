"""``dynabatch export``: a run's checkpoints export without the ``--model`` folder they came from, and a bad
destination is one line before anything is loaded."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dynabatch.cli import main


def _saved_t5(folder) -> str:
    """A t5-tiny model folder with the built-in tokenizer, as a user's own model is."""
    from dynabatch.data.tokenize import load_tokenizer
    from dynabatch.models.presets import build_model

    build_model("t5-tiny", seed=0).save_pretrained(folder)
    load_tokenizer("builtin").save_pretrained(folder)
    return str(folder)


def _train_one_step(capsys, toy_mixture_dir, model: str, out) -> None:
    code = main(["train", "--model", model, "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
                 "--global-batch-tokens", "1024", "--max-input-len", "128", "--max-target-len", "32", "--max-steps", "1",
                 "--calibrate", "off", "--no-timeline", "--task-loss-every", "0", "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err[-2000:]
    capsys.readouterr()  # the run's log: not what the tests read


@pytest.fixture
def moved_model_run(tmp_path, toy_mixture_dir, capsys):
    """A 1-step run of a model folder that was moved away after training: (run folder, moved model folder)."""
    model = _saved_t5(tmp_path / "my-t5")
    _train_one_step(capsys, toy_mixture_dir, model, tmp_path / "r1")
    moved = tmp_path / "my-t5-moved"
    shutil.move(model, moved)
    return tmp_path / "r1", moved


def test_export_needs_no_model_folder_after_training(tmp_path, moved_model_run, capsys):
    from transformers import AutoTokenizer, T5ForConditionalGeneration

    run, moved = moved_model_run
    assert main(["export", str(run / "checkpoints"), str(tmp_path / "hf")]) == 0, capsys.readouterr().err[-2000:]
    model = T5ForConditionalGeneration.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    original = T5ForConditionalGeneration.from_pretrained(moved)
    assert model.config.vocab_size == original.config.vocab_size and len(tok) == len(AutoTokenizer.from_pretrained(moved))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), original.parameters()))  # the trained weights
    out = model.generate(**tok(["Add 12 and 30."], return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and 1 < out.shape[1] <= 5


def test_an_older_checkpoint_without_model_files_names_the_missing_folder(tmp_path, moved_model_run, capsys):
    run, moved = moved_model_run
    step = run / "checkpoints" / "step-000001"
    shutil.rmtree(step / "model")  # as a checkpoint of an older dynabatch, which kept only the paths
    assert main(["export", str(step), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert f"the --model folder its run read, '{tmp_path / 'my-t5'}', is gone" in err, err
    assert not (tmp_path / "hf").exists()  # the folder the export created for its output is removed again
    shutil.move(moved, tmp_path / "my-t5")  # put back: the recorded paths work again
    assert main(["export", str(step), str(tmp_path / "hf")]) == 0, capsys.readouterr().err[-2000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("out", ["/proc/dynabatch-export-test", "/proc/self/no/such/folder"])
def test_an_unwritable_destination_is_one_line_before_loading(tmp_path, out, capsys):
    missing = tmp_path / "no-checkpoint-here"  # the destination is checked before the checkpoint is even looked at
    assert main(["export", str(missing), out]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"dynabatch export: error: output folder {out!r} cannot be created (No such file or directory); "
                   "pass a folder you can write to"), err
    assert not os.path.exists(out)


def test_a_failed_export_removes_only_the_folders_it_created(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    assert main(["export", str(tmp_path / "no-checkpoint-here"), str(tmp_path / "mine" / "a" / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dynabatch export: error: ") and "no-checkpoint-here" in err and "\n" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["mine"] and os.listdir(tmp_path / "mine") == []


def test_the_export_check_compares_with_the_training_tokenizer_not_with_itself(tmp_path, caplog):
    """A Qwen2 folder's config makes ``AutoTokenizer`` load an empty ``Qwen2Tokenizer`` beside a saved ByT5 tokenizer
    (it encodes every text to nothing): the check compares the reloaded tokenizer's ids with the training tokenizer's,
    so it says so and records how to load it (the training class), under which the ids are training's again."""
    from transformers import AutoTokenizer, Qwen2Config

    from dynabatch.data.tokenize import inference_tokenizer, load_tokenizer
    from dynabatch.training.export import _check_encoding

    folder = str(tmp_path / "qwen2")
    Qwen2Config(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128).save_pretrained(folder)
    trained = load_tokenizer("byt5")
    inference_tokenizer(trained, "causal").save_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder)("Add 12")["input_ids"] == []  # the trap itself
    with caplog.at_level("WARNING"):
        how = _check_encoding(folder, "causal", [], trained)
    assert how.startswith("ByT5Tokenizer.from_pretrained, then ") and "loads a Qwen2Tokenizer" in caplog.text
    reloaded = type(trained).from_pretrained(folder)
    assert reloaded("Add 12", add_special_tokens=False)["input_ids"] == trained("Add 12", add_special_tokens=False)[
        "input_ids"] != []


@pytest.mark.parametrize("tokenizer", ["builtin", "byt5"])
def test_a_checkpoint_of_a_qwen2_model_reloads_the_tokenizer_training_used(tmp_path, tokenizer):
    """The export reads the run's tokenizer back from the checkpoint's ``model/``, beside the qwen2 ``config.json``:
    ``AutoTokenizer`` would load a ``Qwen2Tokenizer`` there (it split "12" into digits with the builtin tokenizer's
    files, and encoded nothing with ByT5's), and the export's check, comparing it with itself, passed it unwarned."""
    from transformers import Qwen2Config

    from dynabatch.data.tokenize import PROBE_TEXT, load_tokenizer
    from dynabatch.training.model_files import ModelFiles, read_model_files

    trained = load_tokenizer(tokenizer)
    config = Qwen2Config(vocab_size=8192, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
    ModelFiles(config, None, trained).write(str(tmp_path))
    reloaded = read_model_files(str(tmp_path)).tokenizer
    assert type(reloaded) is type(trained)
    ids = trained(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    assert reloaded(PROBE_TEXT, add_special_tokens=False)["input_ids"] == ids != []


@pytest.mark.parametrize("into", ["step", "checkpoints", "step/hf"])
def test_an_export_into_the_checkpoints_it_reads_is_refused_even_with_force(tmp_path, into, capsys):
    step = tmp_path / "run" / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    out = {"step": step, "checkpoints": step.parent, "step/hf": step / "hf"}[into]
    assert main(["export", str(step), str(out), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"dynabatch export: error: output folder {str(out)!r} is inside the checkpoints being exported "
                   f"({step.parent}); files written there would make those checkpoints unreadable: pass a folder "
                   "outside it"), err
    assert sorted(os.listdir(step)) == ["manifest.json"] and sorted(os.listdir(step.parent)) == ["step-000002"]


def test_a_byt5_qwen2_folder_without_pad_trains_with_its_own_tokenizer_and_exports_the_pad(
        tmp_path, toy_mixture_dir, capsys):
    """A model folder holding a ``ByT5Tokenizer`` (no vocabulary file: ``tokenizer_config.json`` names the class) is
    its own tokenizer under ``--tokenizer auto``; its config has no ``pad_token_id``, which the run takes from the
    tokenizer with one start line, and the exported config and generation config hold it."""
    from transformers import AutoConfig, AutoModelForCausalLM, ByT5Tokenizer, GenerationConfig, Qwen2Config

    from dynabatch.data.tokenize import load_tokenizer

    folder = str(tmp_path / "qwen2-byt5")
    config = Qwen2Config(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, pad_token_id=None, eos_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    ByT5Tokenizer().save_pretrained(folder)
    # bytes: a decoder-only sample of the toy mixture takes up to ~700 tokens
    code = main(["train", "--model", folder, "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
                 "--global-batch-tokens", "2048", "--max-input-len", "1024", "--max-steps", "1", "--calibrate",
                 "off", "--no-timeline", "--task-loss-every", "0", "--output-dir", str(tmp_path / "run")])
    said = "".join(capsys.readouterr())
    assert code == 0, said[-2000:]
    assert f"tokenizer: {folder} (the --model folder's own (--tokenizer auto)" in said
    assert f"model {folder}: its config has no pad_token_id; the run pads with the tokenizer's pad 0" in said
    assert main(["export", str(tmp_path / "run" / "checkpoints"), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    exported = AutoConfig.from_pretrained(tmp_path / "hf")
    assert (exported.pad_token_id, exported.eos_token_id) == (0, 1)
    assert GenerationConfig.from_pretrained(tmp_path / "hf").pad_token_id == 0
    assert type(load_tokenizer(str(tmp_path / "hf"))).__name__ == "ByT5Tokenizer"
