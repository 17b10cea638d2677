"""Built-in mixture generators and the shipped offline tokenizer."""

from __future__ import annotations

import re

import numpy as np
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dynabatch.data.builtin import (
    BUILTIN_TASKS,
    DEFAULT_TOKENIZER_DIR,
    TaskFamily,
    generate_examples,
    stable_task_hash,
)

NUM_PROFILE_EXAMPLES = 200


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER_DIR))


@pytest.fixture(scope="module")
def lengths(tokenizer) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per task: token lengths of inputs and of targets over a few hundred examples (no EOS)."""
    backend = tokenizer.backend_tokenizer
    out = {}
    for task in BUILTIN_TASKS:
        rows = list(generate_examples(task, NUM_PROFILE_EXAMPLES, 0))
        inp = backend.encode_batch([r["inputs"] for r in rows], add_special_tokens=False)
        tgt = backend.encode_batch([r["targets"] for r in rows], add_special_tokens=False)
        out[task] = (np.array([len(e.ids) for e in inp]), np.array([len(e.ids) for e in tgt]))
    return out


def test_registry_covers_three_families():
    assert len(BUILTIN_TASKS) >= 8
    families = {spec.family for spec in BUILTIN_TASKS.values()}
    assert families == set(TaskFamily)
    for name, spec in BUILTIN_TASKS.items():
        assert spec.name == name and spec.description


@pytest.mark.parametrize("task", list(BUILTIN_TASKS))
def test_deterministic_and_seed_dependent(task):
    a = list(generate_examples(task, 5, seed=7))
    assert a == list(generate_examples(task, 5, seed=7))
    assert a[:3] == list(generate_examples(task, 3, seed=7))  # prefix does not depend on the count
    assert a != list(generate_examples(task, 5, seed=8))
    for row in a:
        assert set(row) == {"task", "inputs", "targets"} and row["task"] == task
        assert isinstance(row["inputs"], str) and row["inputs"].strip()
        assert isinstance(row["targets"], str) and row["targets"].strip()


def test_stable_task_hash_is_pinned():
    # sha256-based, so identical in every process whatever PYTHONHASHSEED is (unlike hash()).
    assert stable_task_hash("arith_add") == 0x8A3FEFE4414BCED8
    assert len({stable_task_hash(t) for t in BUILTIN_TASKS}) == len(BUILTIN_TASKS)


def test_bad_arguments():
    with pytest.raises(ValueError, match="ni_topic"):  # lists the valid names
        list(generate_examples("nope", 1, 0))
    with pytest.raises(ValueError, match="num_examples"):
        list(generate_examples("ni_topic", -1, 0))
    with pytest.raises(ValueError, match="seed"):
        list(generate_examples("ni_topic", 1, -3))
    assert list(generate_examples("ni_topic", 0, 0)) == []


def test_targets_are_functions_of_inputs():
    for row in generate_examples("arith_add", 50, 0):
        a, b = map(int, re.findall(r"\d+", row["inputs"]))
        assert row["targets"] == str(a + b)
    for row in generate_examples("sort_numbers", 50, 0):
        values = [int(v) for v in row["inputs"].split(": ")[1].split(", ")]
        assert row["targets"] == ", ".join(map(str, sorted(values)))
    for row in generate_examples("reverse_words", 50, 0):
        assert row["targets"].split() == row["inputs"].split(": ")[1].split()[::-1]
    for row in generate_examples("ni_word_count", 50, 0):
        word = re.search(r'word "(\w+)"', row["inputs"]).group(1)
        passage = row["inputs"].split("Input: ")[1].split("\nQuestion:")[0]
        count = len(re.findall(rf"\b{word}\b", passage))
        assert row["targets"] == f"It appears {count} times."
    for row in generate_examples("translate_cipher", 20, 0):
        source = row["inputs"].split("English: ")[1].split("\n\n")[0]
        assert len(source.split(" ")) == len(row["targets"].split(" "))
    for row in generate_examples("ni_residence_qa", 20, 0):
        name = re.search(r"Where does (\w+) live\?", row["inputs"]).group(1)
        place = row["targets"].removeprefix(f"{name} lives in ").rstrip(".")
        assert f"{name} lives in {place}." in row["inputs"]


def test_ni_length_profile(lengths):
    ni = [t for t, s in BUILTIN_TASKS.items() if s.family is TaskFamily.NI]
    inputs = np.concatenate([lengths[t][0] for t in ni])
    targets = np.concatenate([lengths[t][1] for t in ni])
    assert 200 <= np.median(inputs) <= 420, np.median(inputs)
    assert 500 <= np.percentile(inputs, 95) <= 1200, np.percentile(inputs, 95)
    assert 2 <= np.median(targets) <= 10, np.median(targets)


def test_generation_length_profile(lengths):
    for task in ("sum_keyword", "sum_lead"):
        inputs, targets = lengths[task]
        assert inputs.min() < 150 and inputs.max() > 1500, (task, inputs.min(), inputs.max())
        assert 150 <= np.median(inputs) <= 1000, (task, np.median(inputs))
        assert 20 <= np.median(targets) <= 200 and np.percentile(targets, 95) >= 100, (task, np.median(targets))


def test_registry_profiles_match_measurement(lengths):
    for task, spec in BUILTIN_TASKS.items():
        inputs, targets = lengths[task]
        assert 0.7 * spec.profile.input_p50 <= np.median(inputs) <= 1.4 * spec.profile.input_p50 + 2, task
        assert 0.6 * spec.profile.target_p50 <= np.median(targets) <= 1.5 * spec.profile.target_p50 + 2, task


def test_tokenizer_asset(tokenizer):
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert len(tokenizer) == 8192
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.unk_token) == ("<pad>", "</s>", "<unk>")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    assert sum(p.stat().st_size for p in DEFAULT_TOKENIZER_DIR.iterdir()) < 1_000_000


def test_tokenizer_round_trip_and_no_specials(tokenizer):
    texts = [r[k] for t in BUILTIN_TASKS for r in generate_examples(t, 2, 3) for k in ("inputs", "targets")]
    texts += ["  leading spaces,\ttabs\nand newlines  ", "Ünïcödé ✓ 😀 €5", "", "x"]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids == tokenizer.encode(text, add_special_tokens=True)
        assert ids == tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert not {0, 1, 2} & set(ids)
        assert tokenizer.decode(ids) == text
