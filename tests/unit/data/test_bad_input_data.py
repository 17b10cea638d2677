"""Bad input to the data layer (issue 19): each mistake is exit code 2 and one line naming what, where and the fix.

Through the CLI in-process (``cli.main``) where a user meets it: ``dynabatch train --mixture``,
``dynabatch data-report`` and ``dynabatch plan``/``simulate``; library-level checks where the promise is
about the API (``MixtureData.load``, ``GlobalBatcher``, ``DynaBatchDataLoader``).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from conftest import random_rows, write_jsonl
from dynabatch.cli import main
from dynabatch.data.batching import GlobalBatcher, LengthLimits
from dynabatch.data.mixture import MixtureSpec, mixture_rates
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.source_spec import SourceSpec
from dynabatch.data.sources import load_normalised, load_source

TRAIN = ["train", "--model", "t5-tiny", "--tokenizer", "byt5", "--global-batch-tokens", "1024",
         "--max-input-len", "128", "--max-target-len", "32", "--log-every", "0", "--no-timeline", "--steps", "1"]
REPORT = ["data-report", "--tokenizer", "byt5", "--family", "t5", "--max-lens", "64", "--num-batches", "1",
          "--token-budget", "2048"]


def _error(capsys, *argv: str) -> str:
    """The one error line of a CLI call that must exit 2 without a traceback."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if f"dynabatch {argv[0]}: error:" in line]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def _train_error(tmp_path, capsys, *args: str) -> str:
    return _error(capsys, *TRAIN, "--output-dir", str(tmp_path / "out"), *args)


def _rows(tmp_path, name: str = "rows.jsonl", n: int = 12) -> str:
    return write_jsonl(tmp_path / name, random_rows(name.split(".")[0], n, 0, 4, 2))


def _yaml(tmp_path, text: str, name: str = "mix.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- spec files: syntax, types, values


def test_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys):
    _rows(tmp_path)
    spec = _yaml(tmp_path, "sources:\n  - task: a\n    data_files: rows.jsonl\n   oops: [\n")
    msg = _train_error(tmp_path, capsys, "--mixture", spec)
    assert f"mixture spec {spec}: YAML syntax error at line 4, column 4:" in msg and "fix the file" in msg


def test_key_given_twice_in_a_spec_is_one_line(tmp_path, capsys):
    """PyYAML would keep the second ``data_files`` silently and train on that file only."""
    _rows(tmp_path)
    spec = _yaml(tmp_path, "sources:\n  - task: a\n    data_files: rows.jsonl\n    data_files: other.jsonl\n")
    msg = _train_error(tmp_path, capsys, "--mixture", spec)
    assert msg.endswith(f"mixture spec {spec}: key 'data_files' is given twice (line 4, first at line 3); keep one")
    path = tmp_path / "mix.json"
    path.write_text('{"sources": [{"task": "a", "data_files": "rows.jsonl"}],\n "sources": []}')
    msg = _error(capsys, *REPORT, "--mixture", str(path))
    assert f"mixture spec {path}: key 'sources' is given twice (line 2, first at line 1); keep one" in msg


def test_a_toml_spec_reads_as_its_yaml_twin_and_a_key_given_twice_is_one_line(tmp_path, capsys):
    _rows(tmp_path)
    toml = _yaml(tmp_path, 'rule = "fixed"\n\n[[sources]]\ntask = "a"\ndata_files = "rows.jsonl"\nrate = 1.0\n',
                 "mix.toml")
    twin = _yaml(tmp_path, "rule: fixed\nsources:\n  - task: a\n    data_files: rows.jsonl\n    rate: 1.0\n")
    assert MixtureSpec.from_file(toml) == MixtureSpec.from_file(twin)
    msg = _error(capsys, "data-report", "--lengths", toml)  # a .toml --lengths is a spec, as .yaml/.json are
    assert msg.endswith(f"--lengths {toml}: data-report's --lengths reads a lengths file (.npz/.jsonl); for a "
                        f"mixture spec's tables pass --mixture {toml}")
    twice = _yaml(tmp_path, '[[sources]]\ntask = "a"\ndata_files = "rows.jsonl"\ndata_files = "other.jsonl"\n',
                  "twice.toml")
    msg = _error(capsys, *REPORT, "--mixture", twice)
    assert msg.endswith(f"mixture spec {twice}: key 'data_files' is given twice (line 4, first at line 3); keep one")


def test_a_spec_of_another_ending_says_which_are_read(tmp_path, capsys):
    data = _rows(tmp_path)  # a data file given as a spec: not read as a JSON spec (a syntax error at line 1)
    msg = _error(capsys, *REPORT, "--mixture", data)
    assert msg.endswith(f"mixture spec {data}: unknown file type ('.jsonl'); accepted: .yaml, .yml, .json, .toml "
                        "(YAML, JSON or TOML by that ending): rename or convert the file (a mixture spec lists data "
                        "files under 'sources'; one data file alone is --data FILE)")


def test_json_syntax_error_names_file_line_and_column(tmp_path, capsys):
    path = tmp_path / "mix.json"
    path.write_text('{"sources": [\n  {"task": "a", }\n]}')
    msg = _error(capsys, *REPORT, "--mixture", str(path))
    assert f"mixture spec {path}: JSON syntax error at line 2, column 17: Expecting property name" in msg


@pytest.mark.parametrize(
    "text, expected",
    [
        ("rule: fixed\nsources:\n  - {task: a, data_files: rows.jsonl, rate: x}\n",
         "'rate' of source 'a' must be a number, got str 'x'"),
        ("cap: x\nsources:\n  - {task: a, data_files: rows.jsonl}\n", "'cap' must be a number, got str 'x'"),
        ("sources:\n  - {task: a, data_files: 5}\n",
         "'data_files' of source 'a' must be a file path or a list of file paths, got int 5"),
        ("sources:\n  - {task: a, data_files: rows.jsonl, columns: 5}\n",
         "'columns' of source 'a' must be a mapping of names to strings, got int 5"),
        ("sources:\n  - {task: a, data_files: rows.jsonl, template: {inputs: 5}}\n",
         "'template' of source 'a' must be a mapping of names to strings"),
        ("sources:\n  - {task: a, builtin: sum_keyword, num_examples: ten}\n",
         "'num_examples' of source 'a' must be an integer, got str 'ten'"),
        ("seed: 1.5\nsources:\n  - {task: a, data_files: rows.jsonl}\n", "'seed' must be an integer, got float 1.5"),
        ("- a\n- b\n", "a mixture spec is a mapping with a 'sources' list, got list"),
        ("", "a mixture spec is a mapping with a 'sources' list, got an empty file"),
        ("sources: {task: a}\n", "'sources' must be a list of sources, got dict"),
        ("sources:\n  - just-a-name\n", "each mixture source is a mapping with a 'task' name"),
        ("sources:\n  - {task: 7, data_files: rows.jsonl}\n", "each mixture source is a mapping with a 'task' name"),
    ],
)
def test_wrong_value_types_name_file_key_and_type(tmp_path, capsys, text, expected):
    _rows(tmp_path)
    spec = _yaml(tmp_path, text)
    msg = _error(capsys, *REPORT, "--mixture", spec)
    assert f"mixture spec {spec}: " in msg and expected in msg


@pytest.mark.parametrize(
    "text, expected",
    [
        ("rule: fixed\nsources:\n  - {task: a, data_files: rows.jsonl, rate: .inf}\n"
         "  - {task: b, data_files: rows.jsonl, rate: 1}\n", "source 'a': rate must be a finite number >= 0, got inf"),
        ("rule: fixed\nsources:\n  - {task: a, data_files: rows.jsonl, rate: .nan}\n",
         "source 'a': rate must be a finite number >= 0, got nan"),
        ("rule: fixed\nsources:\n  - {task: a, data_files: rows.jsonl, rate: -1}\n",
         "source 'a': rate must be a finite number >= 0, got -1"),
        ("cap: .inf\nsources:\n  - {task: a, data_files: rows.jsonl}\n", "mixture cap must be a finite number > 0, got inf"),
        ("cap: -3\nsources:\n  - {task: a, data_files: rows.jsonl}\n", "mixture cap must be a finite number > 0, got -3"),
        ("seed: -1\nsources:\n  - {task: a, data_files: rows.jsonl}\n", "mixture seed must be >= 0, got -1"),
        ("bad_rows: maybe\nsources:\n  - {task: a, data_files: rows.jsonl}\n",
         "mixture bad_rows must be one of ('error', 'skip'), got 'maybe'"),
    ],
)
def test_non_finite_or_negative_rates_and_caps_are_refused(tmp_path, capsys, text, expected):
    _rows(tmp_path)
    spec = _yaml(tmp_path, text)
    msg = _error(capsys, *REPORT, "--mixture", spec)
    assert f"mixture spec {spec}: " in msg and expected in msg


def test_huge_fixed_rates_that_overflow_are_refused():
    spec = MixtureSpec(sources=(SourceSpec(task="a", data_files=("x",), rate=1e308),
                                SourceSpec(task="b", data_files=("y",), rate=1e308)), rule="fixed")
    with pytest.raises(ValueError, match="sum to inf; use finite rates"):
        mixture_rates(spec, [10, 10])


def test_mixture_that_is_a_directory(tmp_path, capsys):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "mine.yaml").write_text("sources: []\n")
    msg = _train_error(tmp_path, capsys, "--mixture", str(tmp_path / "specs"))
    assert "is a directory (it holds mine.yaml); pass a .yaml/.yml, .json or .toml spec file" in msg


def test_hub_source_offline_names_source_and_dataset(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    spec = _yaml(tmp_path, "sources:\n  - {task: squad, hf: dynabatch-tests/never-cached}\n")
    msg = _error(capsys, *REPORT, "--mixture", spec)
    assert "source 'squad': hub dataset dynabatch-tests/never-cached cannot be loaded" in msg
    assert "needs internet access or a local Hugging Face cache" in msg and "data_files:" in msg


# ---------------------------------------------------------------- bad rows: the spec key, the override, the advice


def _with_bad_row(tmp_path) -> str:
    rows = random_rows("a", 10, 0, 4, 2)
    rows[3] = {"inputs": "no target here"}
    return write_jsonl(tmp_path / "rows.jsonl", rows)


def test_spec_bad_rows_skip_drops_and_counts_in_the_report(tmp_path, capsys):
    _with_bad_row(tmp_path)
    spec = _yaml(tmp_path, "bad_rows: skip\nsources:\n  - {task: a, data_files: rows.jsonl}\n")
    assert main([*REPORT, "--mixture", spec]) == 0
    out = capsys.readouterr().out
    assert "(1 malformed rows skipped)" in out
    # --bad-rows error on the command line overrides the spec, and the advice names what exists
    msg = _error(capsys, *REPORT, "--mixture", spec, "--bad-rows", "error")
    assert "source 'a', row 3: missing field 'targets'" in msg
    assert "set bad_rows: skip in the mixture spec (or pass --bad-rows skip) to drop and count such rows" in msg


def test_bad_rows_per_source_and_load_override(tmp_path, byt5):
    _with_bad_row(tmp_path)
    (tmp_path / "b.jsonl").write_text((tmp_path / "rows.jsonl").read_text())
    raw = {"sources": [{"task": "a", "data_files": "rows.jsonl", "bad_rows": "skip"},
                       {"task": "b", "data_files": "b.jsonl"}]}
    spec = MixtureSpec.from_dict(raw, base_dir=str(tmp_path))
    with pytest.raises(ValueError, match="source 'b', row 3: missing field 'targets'"):
        MixtureData.load(spec, byt5, "t5")  # b follows the mixture's default: error
    data = MixtureData.load(spec, byt5, "t5", bad_rows="skip")  # e.g. train --bad-rows skip
    assert [s.num_skipped for s in data.sources] == [1, 1] and [len(s) for s in data.sources] == [9, 9]
    assert data.sources[0].source_row(3) == 4  # rows after the skipped one keep their file row numbers
    with pytest.raises(ValueError, match="source 'a', row 3"):
        MixtureData.load(spec, byt5, "t5", bad_rows="error")  # the override beats the source's skip


def test_numeric_csv_columns_become_text(tmp_path, capsys):
    path = tmp_path / "labels.csv"
    path.write_text("inputs,targets\nis this good,1\nis this bad,0\nhow sure,0.5\n")
    ds, skipped = load_source(SourceSpec(task="labels", data_files=(str(path),)))
    assert skipped == 0 and ds["targets"][:] == ["1.0", "0.0", "0.5"]
    path = tmp_path / "int_labels.csv"
    path.write_text("inputs,targets\nis this good,1\nis this bad,0\n")
    ds, _ = load_source(SourceSpec(task="labels", data_files=(str(path),)))
    assert ds["targets"][:] == ["1", "0"]
    assert main([*REPORT, "--data", str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_text_in_a_json_column_that_also_holds_numbers_stays_as_written(tmp_path, suffix):
    """One number among text targets makes ``datasets`` read the column as mixed JSON, which decodes text that
    looks like JSON: "007" came back as 7, "null" as a missing target. The text must stay as written; only the
    real number and boolean are cast (and counted)."""
    rows = [{"inputs": f"q{i}", "targets": t} for i, t in enumerate(["007", "1.50", 5, "null", "[1, 2]", True, "1e3"])]
    path = tmp_path / f"mixed{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    else:
        write_jsonl(path, rows)
    out = load_normalised(SourceSpec(task="mixed", data_files=(str(path),)))
    assert out.dataset["targets"][:] == ["007", "1.50", "5", "null", "[1, 2]", "True", "1e3"]
    assert out.casts == {"targets": 2}


def test_template_naming_a_missing_column(tmp_path):
    write_jsonl(tmp_path / "q.jsonl", [{"question": "why", "targets": "because"}])
    spec = SourceSpec(task="qa", data_files=(str(tmp_path / "q.jsonl"),), template={"inputs": "Q: {questoin}"})
    with pytest.raises(ValueError, match=r"source 'qa': template for 'inputs' \('Q: \{questoin\}'\) cannot be applied: "
                                         r"no column 'questoin'; the columns are \['question', 'targets'\]"):
        load_source(spec)


# ---------------------------------------------------------------- over-long samples: drop counted, never a hang


def _long_rows(tmp_path, name: str, n: int, short: int = 0) -> str:
    rows = [{"inputs": "x" * 200, "targets": "y" * 50} for _ in range(n)] + [{"inputs": "ab", "targets": "c"}] * short
    return write_jsonl(tmp_path / name, rows)


def test_every_sample_overlong_with_drop_fails_fast_through_train(tmp_path, capsys):
    _long_rows(tmp_path, "long.jsonl", 30)
    spec = _yaml(tmp_path, "sources:\n  - {task: long, data_files: long.jsonl}\n")
    start = time.perf_counter()
    msg = _train_error(tmp_path, capsys, "--mixture", spec, "--overlong", "drop")
    assert time.perf_counter() - start < 30
    assert "every one of the 30 samples the mixture can draw is over the length limits (max_input_len=128" in msg
    assert "raise the limits or use --overlong truncate (overlong='truncate' in Python)" in msg


def test_drop_batcher_all_overlong_mostly_overlong_and_rate_zero(tmp_path, byt5):
    _long_rows(tmp_path, "long.jsonl", 40)
    _long_rows(tmp_path, "mostly.jsonl", 59, short=1)
    limits = LengthLimits("t5", max_input_len=16, max_target_len=8)

    def batcher(raw) -> GlobalBatcher:
        data = MixtureData.load(MixtureSpec.from_dict(raw, base_dir=str(tmp_path)), byt5, "t5")
        return GlobalBatcher(data, limits, token_budget=64, overlong="drop")

    with pytest.raises(ValueError, match="every one of the 40 samples"):  # at once, before any batch is drawn
        batcher({"sources": [{"task": "long", "data_files": "long.jsonl"}]})
    # one short sample in 60: slow going, but batches come and the drops are counted and kept in the state
    b = batcher({"sources": [{"task": "mostly", "data_files": "mostly.jsonl"}]})
    batches = [b.next_batch() for _ in range(3)]
    assert all(len(x) >= 1 for x in batches) and sum(x.num_dropped for x in batches) == b.num_dropped > 0
    assert b.state_dict()["num_dropped"] == b.num_dropped
    # the only short rows are in a source that is never drawn (rate 0): still nothing usable
    raw = {"rule": "fixed", "sources": [{"task": "long", "data_files": "long.jsonl", "rate": 1.0},
                                        {"task": "mostly", "data_files": "mostly.jsonl", "rate": 0.0}]}
    with pytest.raises(ValueError, match="every one of the 40 samples"):
        batcher(raw)


def test_data_report_counts_dropped_samples(tmp_path, capsys):
    _long_rows(tmp_path, "mix.jsonl", 5, short=20)
    assert main([*REPORT, "--data", str(tmp_path / "mix.jsonl"), "--overlong", "drop"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("max_len"))
    row = next(line for line in out.splitlines() if line.lstrip().startswith("64 "))
    assert header.split()[-2:] == ["truncated", "dropped"] and int(row.split()[-1]) > 0


def test_overlong_error_names_the_file_row_after_skipped_rows(tmp_path, byt5):
    rows = [{"inputs": "no target"}, {"inputs": "ab", "targets": "c"}, {"inputs": "x" * 200, "targets": "y"}]
    write_jsonl(tmp_path / "r.jsonl", rows)
    spec = MixtureSpec.from_dict({"bad_rows": "skip", "sources": [{"task": "r", "data_files": "r.jsonl"}]},
                                 base_dir=str(tmp_path))
    data = MixtureData.load(spec, byt5, "t5")
    b = GlobalBatcher(data, LengthLimits("t5", max_input_len=16, max_target_len=8), token_budget=64, overlong="error")
    with pytest.raises(ValueError, match=r"^row 2 of source 'r' has 201 input and 2 target tokens"):
        for _ in range(10):
            b.next_batch()


def test_planner_error_names_global_batch_and_row(tmp_path, byt5):
    from dynabatch.integrations.dataloader import DynaBatchDataLoader

    write_jsonl(tmp_path / "r.jsonl", [{"inputs": "ab", "targets": "c"}] * 3 + [{"inputs": "x" * 60, "targets": "y"}])
    data = MixtureData.load(MixtureSpec.from_dict({"sources": [{"task": "r", "data_files": "r.jsonl"}]},
                                                  base_dir=str(tmp_path)), byt5, "t5")
    loader = DynaBatchDataLoader(data, LengthLimits("t5", max_input_len=64, max_target_len=8), token_budget=1000,
                                 planner_options={"max_tokens": 40})
    with pytest.raises(ValueError, match=r"^sample \d+ of global batch 0, row 3 of source 'r' \(input_len=61, "):
        loader.next_step()


# ---------------------------------------------------------------- state dicts


def test_loader_load_state_dict_of_the_wrong_thing(toy_data):
    from dynabatch.integrations.dataloader import DynaBatchDataLoader

    loader = DynaBatchDataLoader(toy_data, LengthLimits(toy_data.family, 256, 64, 256), token_budget=2000,
                                 method="padding")
    with pytest.raises(ValueError, match=r"batcher state is missing \['sampler', 'pending', 'step', 'num_truncated', "
                                         r"'num_dropped'\] \(got keys \[\]\); pass the dict returned by state_dict\(\)"):
        loader.load_state_dict({})
    state = loader.state_dict()
    del state["sampler"]["rng"]
    with pytest.raises(ValueError, match=r"sampler state is missing \['rng'\]"):
        loader.load_state_dict(state)
    state = loader.state_dict()
    state["sampler"]["cursors"][0] = 10_000
    with pytest.raises(ValueError, match="the state is from another mixture"):
        loader.load_state_dict(state)


# ---------------------------------------------------------------- plan / simulate arguments and lengths files


@pytest.mark.parametrize("command", ["plan", "simulate"])
@pytest.mark.parametrize("flag", ["--num-batches", "--stages", "--global-batch-tokens"])
def test_plan_and_simulate_counts_must_be_positive(capsys, command, flag):
    msg = _error(capsys, command, flag, "0")
    assert f"{flag} must be >= 1, got 0" in msg


def test_simulate_in_flight_must_be_positive(capsys):
    assert "--in-flight must be >= 1, got 0" in _error(capsys, "simulate", "--in-flight", "0")


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("text.npz", b"input_len,target_len\n3,4\n", "not a valid .npz (zip) file; expected a .npz of integer arrays"),
        ("random.npz", os.urandom(256), "not a valid .npz (zip) file"),
        ("binary.jsonl", b"\xff\xfe\x00garbage", "not UTF-8 text"),
    ],
)
def test_lengths_file_that_is_not_one(tmp_path, capsys, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content)
    msg = _error(capsys, "plan", "--lengths", str(path))
    assert f"lengths file {path}: {expected}" in msg and "allow_pickle" not in msg


def test_lengths_npz_with_object_or_float_arrays(tmp_path, capsys):
    path = tmp_path / "obj.npz"
    np.savez(path, input_len=np.array([[1], "a"], dtype=object), target_len=np.array([1, 2]))
    msg = _error(capsys, "plan", "--lengths", str(path))
    assert "holds object (pickled) arrays, not integer ones" in msg and "allow_pickle" not in msg
    np.savez(path, input_len=np.array([1.5, 2.0]), target_len=np.array([1, 2]))
    assert "array 'input_len' has dtype float64, not integers" in _error(capsys, "plan", "--lengths", str(path))


@pytest.mark.parametrize("value", ["100.5", '"100"', "true", "100.0"])
def test_jsonl_lengths_that_are_not_whole_numbers_name_file_and_line(tmp_path, capsys, value):
    path = tmp_path / "l.jsonl"
    path.write_text('{"input_len": 10, "target_len": 5}\n\n{"input_len": %s, "target_len": 5}\n' % value)
    msg = _error(capsys, "plan", "--model", "gpt", "--lengths", str(path), "--num-batches", "1")
    assert msg.endswith(f"lengths file {path}, line 3: input_len must be a whole number of tokens, got {value}; "
                        'write it as an integer, e.g. "input_len": 100')


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_t5_lengths_with_an_empty_input_name_the_row(tmp_path, capsys, command):
    path = tmp_path / "l.jsonl"
    path.write_text('{"input_len": 4, "target_len": 5}\n' + '{"input_len": 0, "target_len": 5}\n' * 3)
    msg = _error(capsys, command, "--model", "t5", "--lengths", str(path), "--num-batches", "1")
    assert msg.endswith(f"lengths file {path}, line 2: input_len 0 is out of range (an encoder-decoder model's "
                        "input holds its EOS at least, so >= 1); 3 samples in all are; fix or drop them")
    npz = tmp_path / "l.npz"
    np.savez(npz, input_len=np.array([4, 4, 0]), target_len=np.array([5, 5, 5]))
    assert f"lengths file {npz}, row 2 (from 0): input_len 0 is out of range" in _error(
        capsys, command, "--model", "t5", "--lengths", str(npz), "--num-batches", "1")


def test_huge_lengths_are_refused_over_the_bound_and_truncated_under_it(tmp_path, capsys):
    huge = tmp_path / "huge.jsonl"
    huge.write_text('{"input_len": 1000000000000, "target_len": 10}\n')
    msg = _error(capsys, "plan", "--model", "gpt", "--lengths", str(huge), "--num-batches", "1")
    assert msg.endswith(f"lengths file {huge}, line 1: input_len 1000000000000 is out of range (over 2147483647 "
                        "tokens, the most a lengths file may give); fix or drop it")
    big = tmp_path / "big.jsonl"  # a billion tokens: truncated to the limit, never allocated
    big.write_text('{"input_len": 1000000000, "target_len": 10}\n')
    assert main(["plan", "--model", "gpt", "--lengths", str(big), "--num-batches", "1", "--methods", "padding",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["methods"]["padding"]["real_tokens"] == 1024
    assert main(["data-report", "--lengths", str(big)]) == 0
    rows = [ln.split() for ln in capsys.readouterr().out.splitlines() if ln.startswith(("input ", "total  "))]
    assert rows == [["input", *["1000000000"] * 6], ["total", *["1000000010"] * 6]]


# ---------------------------------------------------------------- tokenizer folders


def test_tokenizer_folder_without_tokenizer_files(tmp_path, capsys):
    folder = tmp_path / "model-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "t5"}))  # transformers would build an empty vocab
    msg = _train_error(tmp_path, capsys, "--tokenizer", str(folder))
    assert f"tokenizer folder '{folder}' has no tokenizer files: it needs tokenizer.json" in msg
    assert "--tokenizer builtin, gpt2 or byt5" in msg


def test_data_report_refuses_a_global_batch_smaller_than_one_sample_before_any_table(tmp_path, capsys):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "what is two plus two", "answer": "four"}\n' * 6)
    args = ["data-report", "--data", str(data), "--columns", "inputs=question,targets=answer", "--family", "t5"]
    msg = _error(capsys, *args, "--global-batch-tokens", "100")
    assert msg.endswith("--global-batch-tokens 100 cannot hold one maximal sample (max_input_len=512, "
                        "max_target_len=128, 640 tokens); raise it to at least 640 or lower the length limits")
    assert _error(capsys, "plan", "--model", "gpt", "--global-batch-tokens", "100", "--num-batches", "1").endswith(
        "--global-batch-tokens 100 cannot hold one maximal sample (max_seq_len=1024, 1024 tokens); raise it to at "
        "least 1024 or lower the length limits")  # the same check and line
    assert main([*args, "--global-batch-tokens", "2560", "--num-batches", "1"]) == 0
    assert "1 global batches of 2560 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("family, subject", [("t5", "--family t5 is"), ("both", "--family both includes")])
def test_data_report_names_its_family_for_a_decoder_only_method(capsys, family, subject):
    msg = _error(capsys, "data-report", "--methods", "packing_free_split", "--family", family)
    assert msg.endswith(f"method 'packing_free_split' cuts decoder-only sequences (split rows); {subject} "
                        "encoder-decoder (seq2seq) data: drop packing_free_split from --methods (use packing_free or "
                        "--overlong truncate)")
    assert "model" not in msg


def test_a_malformed_jsonl_line_is_our_one_line_without_the_datasets_log(tmp_path, capfd):
    """``datasets`` logs "Failed to load JSON ..." to the real stderr before it raises: silenced for our load only."""
    import logging

    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "x", "answer": "y"}\n{"question": "bad \\x", "answer": "z"}\n')
    code = main(["data-report", "--data", str(data), "--columns", "inputs=question,targets=answer", "--family", "t5"])
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert [ln for ln in err.splitlines() if "error" in ln.lower() or "fail" in ln.lower()] == [
        f"dynabatch data-report: error: source 'bad': could not read {data}, line 2: not a JSON object (Invalid "
        "\\escape at column 19); fix that line (one JSON object per line), or set bad_rows: skip in the mixture spec "
        "(or pass --bad-rows skip) to drop and count such rows"]
    assert logging.getLogger("datasets.packaged_modules.json.json").level == logging.NOTSET  # set back after the load
