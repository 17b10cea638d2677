"""Tokenizers, tokenization of sources, built-in sources and the data-report command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import random_rows, write_jsonl
from dynabatch.cli import main
from dynabatch.data.mixture import MixtureSpec
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.source_spec import SourceSpec
from dynabatch.data.sources import load_source
from dynabatch.data.tokenize import load_tokenizer, tokenize_dataset, tokenizer_info


def test_gpt2_tokenizer_is_real_and_offline():
    tok = load_tokenizer("gpt2")
    assert len(tok) == 50257
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]
    assert tokenizer_info(tok).eos_id == 50256


def test_builtin_tokenizer_info():
    info = tokenizer_info(load_tokenizer("builtin"))
    assert (info.pad_id, info.eos_id, info.decoder_start_id, info.vocab_size) == (0, 1, 0, 8192)


def test_tokenizer_auto_finds_a_byt5_tokenizer_saved_in_the_model_folder(tmp_path):
    """``ByT5Tokenizer.save_pretrained`` writes no vocabulary file, only ``tokenizer_config.json`` (naming the class)
    and ``added_tokens.json``: ``--tokenizer auto`` takes it as the folder's own, loaded as that class. A
    ``tokenizer_config.json`` naming a tokenizer that needs files it lacks, or one that is not a JSON object, is no
    tokenizer (``builtin``)."""
    from transformers import ByT5Tokenizer, Qwen2Config

    from dynabatch.data.tokenize import describe_tokenizer, has_tokenizer_files, resolve_tokenizer

    folder = str(tmp_path / "byt5-model")
    ByT5Tokenizer().save_pretrained(folder)
    # a model's config.json beside it would make AutoTokenizer load an empty Qwen2Tokenizer: the named class loads
    Qwen2Config(vocab_size=384, hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(folder)
    assert not any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "vocab.json", "spiece.model"))
    assert resolve_tokenizer("auto", folder) == folder
    tok = load_tokenizer("auto", folder)
    assert type(tok).__name__ == "ByT5Tokenizer"
    ids = lambda t: t("héllo", add_special_tokens=False)["input_ids"]  # noqa: E731
    assert ids(tok) == ids(load_tokenizer("byt5"))
    info = tokenizer_info(tok)
    assert "the --model folder's own (--tokenizer auto)" in describe_tokenizer("auto", folder, info)
    other = tmp_path / "llama-config-only"
    other.mkdir()
    (other / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    assert not has_tokenizer_files(str(other)) and resolve_tokenizer("auto", str(other)) == "builtin"
    (other / "tokenizer_config.json").write_text("[1, 2]")
    assert not has_tokenizer_files(str(other))


def test_unknown_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither one of"):
        load_tokenizer(str(tmp_path / "missing"))


def test_a_tokenizer_name_shadowing_a_folder_here_is_a_warning(tmp_path, monkeypatch):
    """``load_tokenizer("byt5")`` (or ``gpt2``, ``builtin``) is the named tokenizer even with a folder of that name
    in the working directory, which a model saved as ``save_pretrained("gpt2")`` makes; the folder's tokenizer was
    silently not the one loaded. A warning says how to load the folder."""
    import warnings

    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        load_tokenizer("byt5")
    assert not [w for w in quiet if "not the folder" in str(w.message)]
    os.mkdir("byt5")
    with pytest.warns(UserWarning, match=r"^tokenizer 'byt5' is dynabatch's byt5 tokenizer, not the folder 'byt5' "
                                         r"here; pass '\./byt5' to load the folder's$"):
        assert type(load_tokenizer("byt5")).__name__ == "ByT5Tokenizer"


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_tokenize_appends_eos_per_family(tmp_path, family):
    path = write_jsonl(tmp_path / "a.jsonl", [{"inputs": "ab", "targets": "c"}])
    ds, _ = load_source(SourceSpec(task="a", data_files=(path,)))
    tok = load_tokenizer("byt5")  # bytes + 3: a=100, b=101, c=102; eos=1
    row = tokenize_dataset(ds, tok, family)[0]
    assert row["target_ids"] == [102, 1]
    assert row["input_ids"] == ([100, 101, 1] if family == "t5" else [100, 101])


def test_builtin_source_loads_and_is_cached():
    spec = MixtureSpec(sources=(SourceSpec(task="add", builtin="arith_add", num_examples=50),
                                SourceSpec(task="rev", builtin="reverse_words", num_examples=30)))
    tok = load_tokenizer("builtin")
    a = MixtureData.load(spec, tok, "gpt2")
    b = MixtureData.load(spec, tok, "gpt2")
    assert [len(s) for s in a.sources] == [50, 30]
    np.testing.assert_array_equal(a.sources[1].input_ids.values, b.sources[1].input_ids.values)
    np.testing.assert_allclose(a.rates, [50 / 80, 30 / 80])
    with pytest.raises(ValueError, match="unknown built-in task 'nope'; valid: ni_word_count"):
        load_source(SourceSpec(task="x", builtin="nope"))


def test_data_report_on_a_file(tmp_path, capsys):
    path = write_jsonl(tmp_path / "mytask.jsonl", random_rows("mytask", 60, 5, 40, 5))
    code = main(["data-report", "--data", path, "--tokenizer", "byt5", "--family", "gpt2",
                 "--max-lens", "128,256", "--token-budget", "4096", "--num-batches", "2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "mytask" in out and "padding efficiency" in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("128", "256"))]
    assert len(rows) == 2
    for row in rows:
        eff = [float(x) for x in row[1:5]]
        assert all(0 < e <= 1 for e in eff)
        assert eff[1] >= eff[0]  # length grouping never loses to plain padding here


def test_data_report_names_the_mixture_once_and_counts_its_sources(tmp_path, capsys):
    """A mixture without a name of its own is "mixture", not "mixture 'mixture'"; one source is "1 source"."""
    path = write_jsonl(tmp_path / "one.jsonl", random_rows("one", 20, 5, 20, 5))
    assert main(["data-report", "--data", path, "--family", "gpt2", "--max-lens", "128", "--num-batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "mixture: 1 source, rule examples_proportional, cap None, seed 0" in out.splitlines()
    other = write_jsonl(tmp_path / "two.jsonl", random_rows("two", 20, 5, 20, 5))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"name": "pair", "sources": [{"task": "one", "data_files": [path]},
                                                            {"task": "two", "data_files": [other]}]}))
    assert main(["data-report", "--mixture", str(spec), "--family", "gpt2", "--max-lens", "128",
                 "--num-batches", "1"]) == 0
    assert "mixture 'pair': 2 sources, rule examples_proportional, cap None, seed 0" in capsys.readouterr().out


def test_data_report_says_casts_once_for_both_families(tmp_path, capsys):
    """Casting numbers to text happens when the file is read, the same for either family: one line, not one per
    family's table."""
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps([{"q": i if i % 3 == 0 else f"text {i}", "a": f"ans {i}"} for i in range(30)]))
    code = main(["data-report", "--data", str(path), "--columns", "inputs=q,targets=a", "--max-lens", "128",
                 "--num-batches", "1"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("== tasks (") == 2
    assert out.count("numbers/bools cast to text") == 1
    assert "source 'mixed': 10 numbers/bools cast to text (inputs 10)" in out


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "dynabatch", "--help"], capture_output=True, text=True, check=True)
    assert "data-report" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "dynabatch", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2


def test_task_table_percentiles_are_rounded_as_the_tail_prints_them():
    """data-report's per-task p50/p90/p95/p99 were truncated (``int``): a p99 of 9.9 read 9 where ``--lengths``'
    tail of the same lengths reads 10."""
    from dynabatch.commands.data_report import _pct

    assert _pct(np.array([0, 10])).split() == ["5", "9", "10", "10", "10"]  # p50 5.0, p90 9.0, p95 9.5, p99 9.9
