"""Loading sources through `datasets`: column mapping, templates, malformed rows."""

from __future__ import annotations

import pytest

from conftest import write_jsonl
from dynabatch.data.source_spec import BadRowError, SourceSpec
from dynabatch.data.sources import load_source


def test_column_mapping_and_template(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "why?", "answer": "because", "ctx": "c1"}])
    spec = SourceSpec(
        task="qa",
        data_files=(path,),
        columns={"targets": "answer"},
        template={"inputs": "Context: {ctx}\nQuestion: {question}"},
    )
    ds, skipped = load_source(spec)
    assert skipped == 0
    assert ds[0] == {"task": "qa", "inputs": "Context: c1\nQuestion: why?", "targets": "because"}


def test_parquet_source(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"inputs": ["a", "b"], "targets": ["x", "y"]}).to_parquet(str(tmp_path / "d.parquet"))
    ds, _ = load_source(SourceSpec(task="p", data_files=(str(tmp_path / "d.parquet"),)))
    assert ds["targets"][:] == ["x", "y"] and ds["task"][:] == ["p", "p"]


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"inputs": "a"}, "missing field 'targets'"),
        ({"inputs": "a", "targets": "   "}, "empty 'targets'"),
        ({"inputs": ["a", "b"], "targets": "x"}, "must be text or a number, got list"),
    ],
)
def test_malformed_rows_error_names_row(tmp_path, row, problem):
    good = {"inputs": "fine", "targets": "ok"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, row, good])
    with pytest.raises(BadRowError) as info:
        load_source(SourceSpec(task="bad", data_files=(path,)))
    message = str(info.value)
    assert "'bad'" in message and "row 2" in message and problem in message and "bad_rows: skip" in message


def test_malformed_rows_skipped_and_counted(tmp_path):
    good = {"inputs": "fine", "targets": "ok"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, {"inputs": "a", "targets": ""}, good])
    ds, skipped = load_source(SourceSpec(task="bad", data_files=(path,)), bad_rows="skip")
    assert skipped == 1 and len(ds) == 2


def test_missing_column_and_file(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "a", "targets": "b"}])
    with pytest.raises(BadRowError, match="column 'inputs'.*columns are"):
        load_source(SourceSpec(task="q", data_files=(path,)))
    with pytest.raises(FileNotFoundError, match="not found"):
        load_source(SourceSpec(task="q", data_files=(str(tmp_path / "nope.jsonl"),)))


def test_invalid_file_gives_clear_error(tmp_path):
    p = tmp_path / "broken.jsonl"
    p.write_bytes(b'{"inputs": "a", "targets": "b"}\n{"inputs": "\xff\xfe broken\n')
    with pytest.raises(BadRowError, match="could not read"):
        load_source(SourceSpec(task="broken", data_files=(str(p),)))


def test_a_line_that_is_not_json_is_named_and_skipped_with_skip(tmp_path):
    """A .jsonl line that is not a JSON object (cut short, a list, not UTF-8): the error names the file and its
    line (from 1); ``bad_rows="skip"`` drops such lines and counts them with the malformed rows."""
    good = '{"inputs": "fine", "targets": "ok"}\n'
    p = tmp_path / "cut.jsonl"
    p.write_bytes((good * 3 + '{"inputs": "x", "targets": \n' + good + "\n" + "[1, 2]\n" + good).encode())
    with pytest.raises(BadRowError, match=r"cut.jsonl, line 4: not a JSON object \(Expecting value at column") as info:
        load_source(SourceSpec(task="cut", data_files=(str(p),)))
    assert "bad_rows: skip" in str(info.value)
    with pytest.warns(UserWarning, match="2 line"):
        ds, skipped = load_source(SourceSpec(task="cut", data_files=(str(p),)), bad_rows="skip")
    assert skipped == 2 and len(ds) == 5 and set(ds["targets"]) == {"ok"}


def test_a_saved_dataset_folder_gets_no_cache_files(tmp_path):
    """A ``save_to_disk`` folder is the user's: loading, normalising and tokenizing it twice writes nothing into it
    (``datasets`` would put every map's ``cache-*.arrow`` next to its files), and the second load reuses the cache."""
    import datasets

    from dynabatch.data.tokenize import load_tokenizer, tokenize_dataset

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"q": ["a b", "c", "d e f"], "a": ["x", "", "z"]}).save_to_disk(str(folder))
    before = sorted(p.name for p in folder.iterdir())
    spec = SourceSpec(task="s", hf=str(folder), columns={"inputs": "q", "targets": "a"})
    for _ in range(2):
        ds, skipped = load_source(spec, bad_rows="skip")  # the skip's filter is a second map
        tokenize_dataset(ds, load_tokenizer("byt5"), "t5")
        assert skipped == 1 and ds["inputs"][:] == ["a b", "d e f"] and ds["source_row"][:] == [0, 2]
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_folder_of_data_files_in_two_formats_is_refused(tmp_path):
    """``datasets`` reads a folder of data files in its most common format and skips the rest without a word: a
    folder with a .jsonl and a .csv file is one line naming both, not a source with half its rows."""
    folder = tmp_path / "mixed"
    (folder / "more").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", [{"inputs": "a", "targets": "x"}])
    (folder / "more" / "b.csv").write_text("inputs,targets\nb,y\n")
    with pytest.raises(ValueError, match=r"source 'm': folder .*mixed holds data files of 2 formats \(csv: more/b.csv; "
                                         r"json: a.jsonl\); .* put each format in a folder of its own"):
        load_source(SourceSpec(task="m", hf=str(folder)))
    (folder / "more" / "b.csv").unlink()
    write_jsonl(folder / "more" / "b.json", [{"inputs": "b", "targets": "y"}])  # .json and .jsonl: one format
    assert load_source(SourceSpec(task="m", hf=str(folder)))[0]["inputs"][:] == ["a", "b"]


def test_a_folder_whose_file_names_name_other_splits_says_so(tmp_path, caplog):
    """``datasets`` sorts a folder's files into splits by their names and reads the source's split alone: the files of
    other splits are named in the log, and a folder with none in the split read is one line, not datasets' own
    ``Unknown split "train"``."""
    import logging

    folder = tmp_path / "split"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"inputs": "a", "targets": "x"}])
    write_jsonl(folder / "test.jsonl", [{"inputs": "b", "targets": "y"}])
    with caplog.at_level(logging.INFO, logger="dynabatch.data.sources"):
        ds, _ = load_source(SourceSpec(task="s", hf=str(folder)))
    assert ds["inputs"][:] == ["a"]
    assert "reads split 'train'; datasets sorts its other files into other splits by their names, and they are not " \
           "read (test: test.jsonl)" in caplog.text
    (folder / "train.jsonl").rename(folder / "a.jsonl")
    with pytest.raises(ValueError, match=r"source 's': datasets sorts the files of folder .*split into splits by their "
                                         r"names \(test: test.jsonl\) and none into split 'train', the one read"):
        load_source(SourceSpec(task="s", hf=str(folder)))
