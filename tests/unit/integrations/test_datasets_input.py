"""Any dataset (issue 18, item 4): ``datasets.Dataset`` / ``IterableDataset`` in memory, ``--data`` with
``--columns`` (files, saved datasets, the local Hugging Face cache) and numbers cast to text, counted.

Through ``DynaBatchDataLoader``, ``MixtureData.from_datasets``, in-process ``train`` (tiny models, few steps) and
the CLI in-process for the one-line errors and the data report.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from dynabatch.cli import main
from dynabatch.data.batching import LengthLimits
from dynabatch.data.inputs import data_spec, load_data, parse_columns
from dynabatch.data.pipeline import MixtureData
from dynabatch.integrations.dataloader import DynaBatchDataLoader

REPORT = ["data-report", "--tokenizer", "byt5", "--family", "t5", "--max-lens", "64", "--num-batches", "1",
          "--global-batch-tokens", "2048"]
TINY = dict(model="t5-tiny", tokenizer="byt5", global_batch_tokens=512, max_input_len=64, max_target_len=16,
            max_steps=2, logging_steps=0, task_loss_every=0, timeline=False, calibrate="off")


def _qa(n: int = 24, offset: int = 0):
    import datasets

    return datasets.Dataset.from_dict({
        "question": [f"what is {i} plus {i}" for i in range(offset, offset + n)],
        "answer": [2 * i for i in range(offset, offset + n)],  # ints: cast to text
        "category": ["sums" if i % 2 else "doubles" for i in range(offset, offset + n)],
    })


def _stream(n: int = 30):
    import datasets

    def rows():
        for i in range(n):
            yield {"question": f"count to {i}", "answer": f"{' '.join(map(str, range(i % 5 + 1)))}"}

    return datasets.IterableDataset.from_generator(rows)


def _error(capsys, *argv: str) -> str:
    """The one error line of a CLI call that must exit 2 without a traceback."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    lines = [line for line in err.splitlines() if f"dynabatch {argv[0]}: error:" in line]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def test_dataset_and_stream_through_the_loader_resume_exactly(byt5):
    data = {"qa": _qa(), "stream": _stream()}
    kwargs = dict(limits=LengthLimits("t5", max_input_len=64, max_target_len=16), token_budget=400, tokenizer=byt5,
                  columns={"inputs": "question", "targets": "answer"}, method="padding")
    loader = DynaBatchDataLoader(data, **kwargs)
    mixture = loader.batcher.data
    assert [s.name for s in mixture.sources] == ["qa", "stream"] and [len(s) for s in mixture.sources] == [24, 30]
    assert mixture.sources[0].casts == {"targets": 24} and mixture.sources[1].casts == {}
    first = [loader.next_step() for _ in range(2)]
    assert all(sb.micro_batches for sb in first)
    assert {s.task for sb in first for s in sb.batch.samples} <= {"qa", "stream"}
    state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint stores it
    want = [loader.next_step().batch for _ in range(2)]
    again = DynaBatchDataLoader({"qa": _qa(), "stream": _stream()}, **kwargs)  # a new process reads the stream anew
    again.load_state_dict(state)
    got = [again.next_step().batch for _ in range(2)]
    ids = lambda b: [(s.source_index, s.row_index) for s in b.samples]  # noqa: E731
    assert [ids(b) for b in got] == [ids(b) for b in want]


def test_a_stream_is_read_up_to_its_row_limit_and_a_task_column_labels_rows(byt5):
    with pytest.warns(UserWarning, match="the IterableDataset has more than 10 rows; the first 10 are used"):
        data = MixtureData.from_datasets(_stream(), byt5, "causal", max_stream_rows=10,
                                         columns={"inputs": "question", "targets": "answer"})
    assert [s.name for s in data.sources] == ["train"] and len(data.sources[0]) == 10
    labelled = MixtureData.from_datasets(_qa(), byt5, "seq2seq",
                                         columns={"inputs": "question", "targets": "answer", "task": "category"})
    assert set(labelled.sources[0].tasks) == {"sums", "doubles"}
    with pytest.raises(ValueError, match=r"column 'kind' \(for 'task'\) not found; columns are \['question', 'answer', "
                                         r"'category'\].*--columns task=<column>"):
        MixtureData.from_datasets(_qa(), byt5, "seq2seq", columns={"inputs": "question", "targets": "answer",
                                                                    "task": "kind"})


def test_none_lists_and_dicts_stay_malformed_rows(byt5):
    import datasets

    ints = datasets.Dataset.from_dict({"inputs": ["a", "b", "c"], "targets": [1, None, 3]})
    with pytest.raises(ValueError, match="source 'train', row 1: missing field 'targets'"):
        MixtureData.from_datasets(ints, byt5, "seq2seq")
    data = MixtureData.from_datasets(ints, byt5, "seq2seq", bad_rows="skip")
    assert data.sources[0].num_skipped == 1 and data.sources[0].casts == {"targets": 2}
    for value, kind in [(["x"], "list"), ({"a": "x"}, "dict")]:
        rows = datasets.Dataset.from_dict({"inputs": ["a", "b"], "targets": [value, value]})
        with pytest.raises(ValueError, match=f"row 0: field 'targets' must be text or a number, got {kind}"):
            MixtureData.from_datasets(rows, byt5, "seq2seq")
    flags = datasets.Dataset.from_dict({"inputs": ["is it", "is it not"], "targets": [True, False]})
    data = MixtureData.from_datasets(flags, byt5, "seq2seq")
    assert data.sources[0].casts == {"targets": 2}


def test_the_loader_names_its_own_options_for_bad_rows_and_can_skip_them(byt5):
    import datasets

    rows = datasets.Dataset.from_dict({"question": ["a", None, "c"], "answer": ["x", "y", ""]})
    limits = LengthLimits("seq2seq", max_input_len=16, max_target_len=16)
    options = dict(token_budget=64, tokenizer=byt5, columns={"inputs": "question", "targets": "answer"},
                   each_row_once=True)
    with pytest.raises(ValueError, match=r"row 1: missing field 'inputs'.* In DynaBatchDataLoader: .*bad_rows='skip'"):
        DynaBatchDataLoader(rows, limits, **options)
    with pytest.raises(ValueError, match=r"column 'q' \(for 'inputs'\) not found.* In DynaBatchDataLoader: columns="):
        DynaBatchDataLoader(rows, limits, **{**options, "columns": {"inputs": "q", "targets": "answer"}})
    # skipped rows are said, not only counted (a third of the data could vanish without a word)
    with pytest.warns(UserWarning, match=r"^dataset 'train': 2 of 3 rows were malformed \(a missing or empty field\) "
                                         r"and skipped \(bad_rows='skip'\); loader\.batcher\.data\.sources\[i\]\."
                                         r"num_skipped counts them$"):
        loader = DynaBatchDataLoader(rows, limits, bad_rows="skip", **options)
    assert loader.batcher.data.sources[0].num_skipped == 2
    assert [s.row_index for step in loader for s in step.batch.samples] == [0]


def test_the_loader_s_seed_orders_datasets_and_reseeds_a_mixture(byt5):
    """``seed=`` orders the rows of datasets (it was always 0) and re-seeds ``MixtureData``; a batcher's order is
    fixed, so another seed for one is refused; :meth:`reseed` gives the order of a loader built with that seed."""
    options = dict(limits=LengthLimits("t5", max_input_len=64, max_target_len=16), token_budget=400, tokenizer=byt5,
                   columns={"inputs": "question", "targets": "answer"}, method="padding")

    def rows(loader: DynaBatchDataLoader) -> list:
        return [(s.source_index, s.row_index) for _ in range(2) for s in loader.next_step().batch.samples]

    default, zero, seven = (DynaBatchDataLoader(_qa(), **options, **extra) for extra in ({}, {"seed": 0}, {"seed": 7}))
    assert (default.seed, default.data_seed, seven.data_seed) == (None, 0, 7) and default.tokenized_here
    assert rows(default) == rows(zero) and rows(seven) != rows(DynaBatchDataLoader(_qa(), **options))
    mixture = DynaBatchDataLoader(_qa(), **options).batcher.data
    del options["tokenizer"], options["columns"]
    reseeded = DynaBatchDataLoader(mixture, **options, seed=7)
    assert reseeded.data_seed == 7 and not reseeded.tokenized_here
    assert rows(reseeded) == rows(DynaBatchDataLoader(_qa(), tokenizer=byt5, seed=7, columns="inputs=question,targets=answer",
                                                      **options))
    later = DynaBatchDataLoader(mixture, **options)
    later.reseed(7)
    assert rows(later) == rows(DynaBatchDataLoader(mixture, **options, seed=7))
    with pytest.raises(ValueError, match="already drawn steps; build it with seed="):
        later.reseed(8)
    with pytest.raises(ValueError, match="seed=7 differs from the GlobalBatcher's 0; leave it unset"):
        DynaBatchDataLoader(DynaBatchDataLoader(mixture, **options).batcher, seed=7)


def test_an_empty_dataset_is_named_as_the_loader_s_input(byt5):
    import datasets

    empty = datasets.Dataset.from_dict({"question": [], "answer": []})
    options = dict(token_budget=64, tokenizer=byt5, columns={"inputs": "question", "targets": "answer"})
    with pytest.raises(ValueError, match=r"^dataset 'none' passed in memory \(DynaBatchDataLoader data= or datasets=\) "
                                         r"has no rows; pass a dataset with rows, or leave this one out$"):
        DynaBatchDataLoader({"qa": _qa(), "none": empty}, LengthLimits("seq2seq", max_input_len=16, max_target_len=16),
                            **options)


def test_a_dataset_dict_of_splits_is_refused_not_trained_on_split_by_split(byt5):
    """``load_dataset(...)`` without ``split=`` gives a ``DatasetDict``, a dict of splits: taken as tasks, its test
    split was silently trained on as a second task. It is one line; ``dict(dataset)`` says the splits are tasks."""
    import datasets

    splits = datasets.DatasetDict({"train": _qa(8), "test": _qa(4, offset=8)})
    options = dict(token_budget=256, tokenizer=byt5, columns={"inputs": "question", "targets": "answer"})
    limits = LengthLimits("seq2seq", max_input_len=32, max_target_len=16)
    with pytest.raises(ValueError, match=r"^the data is a DatasetDict of the splits \['test', 'train'\], each of which "
                                         r"would be trained on as a task; pass one split \(dataset\['train'\]\), or "
                                         r"dict\(dataset\) to train on every split as a task$"):
        DynaBatchDataLoader(splits, limits, **options)
    assert len(DynaBatchDataLoader(splits["train"], limits, **options).batcher.data.sources) == 1
    assert [s.name for s in DynaBatchDataLoader(dict(splits), limits, **options).batcher.data.sources] == [
        "train", "test"]


def test_columns_text_and_unknown_columns_are_one_line(tmp_path, capsys):
    assert parse_columns("inputs=question, targets=answer,task=category") == {
        "inputs": "question", "targets": "answer", "task": "category"}
    for text, message in [("inputs", "'inputs' is not FIELD=COLUMN"), ("input=question", "unknown field 'input'"),
                          ("inputs=a,inputs=b", "field 'inputs' is mapped twice")]:
        with pytest.raises(ValueError, match=message):
            parse_columns(text)
    path = tmp_path / "qa.csv"
    path.write_text("question,answer\nwhat,1\nwho,2\n")
    line = _error(capsys, *REPORT, "--data", str(path), "--columns", "inputs:question,targets=answer")
    assert "--columns: 'inputs:question' is not FIELD=COLUMN; write e.g. --columns inputs=question,targets=answer" in line
    line = _error(capsys, *REPORT, "--data", str(path), "--columns", "inputs=questoin,targets=answer")
    assert "column 'questoin' (for 'inputs') not found; columns are ['question', 'answer']" in line
    line = _error(capsys, "train", "--data", str(path), "--columns", "targets", "--max-steps", "1")
    assert "--columns: 'targets' is not FIELD=COLUMN" in line


def test_csv_with_a_numeric_target_reports_its_casts(tmp_path, capsys):
    path = tmp_path / "labels.csv"
    path.write_text("question,answer\n" + "".join(f"is {i} even,{int(i % 2 == 0)}\n" for i in range(12)))
    assert main([*REPORT, "--data", str(path), "--columns", "inputs=question,targets=answer"]) == 0
    out = capsys.readouterr().out
    assert "source 'labels': 12 numbers/bools cast to text (targets 12)" in out


def test_data_names_a_saved_dataset_or_one_in_the_local_hub_cache(tmp_path, monkeypatch, byt5):
    import datasets
    from datasets.packaged_modules.json.json import Json

    _qa(8).save_to_disk(str(tmp_path / "saved"))
    data = load_data(byt5, "seq2seq", data=str(tmp_path / "saved"), columns="inputs=question,targets=answer")
    assert data.sources[0].name == "saved" and len(data.sources[0]) == 8
    # A hub dataset as a download leaves it in the datasets cache (<cache>/org___qa/default/0.0.0/<hash>):
    # datasets reads it offline (HF_HUB_OFFLINE=1 in conftest); nothing is downloaded.
    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    _qa(6).to_json(str(tmp_path / "train.jsonl"))
    builder = Json(data_files={"train": str(tmp_path / "train.jsonl")}, dataset_name="qa", hash="0123abcd",
                   cache_dir=str(tmp_path / "build"))
    builder.download_and_prepare()
    os.makedirs(cache / "org___qa")
    shutil.move(os.path.dirname(os.path.dirname(builder.cache_dir)), str(cache / "org___qa" / "default"))
    data = load_data(byt5, "seq2seq", data="org/qa", columns="inputs=question,targets=answer")
    assert data.sources[0].name == "qa" and len(data.sources[0]) == 6 and data.sources[0].casts == {"targets": 6}
    with pytest.raises(ValueError, match="hub dataset org/missing cannot be loaded: it needs internet access or a "
                                         "local Hugging Face cache of it"):
        load_data(byt5, "seq2seq", data="org/missing")
    with pytest.raises(FileNotFoundError, match="--data: file 'nope.csv' not found"):
        data_spec("nope.csv")
    # a DatasetDict without a train split: --data has no split option, so the line names the folder to pass
    folder = str(tmp_path / "dict")
    datasets.DatasetDict({"validation": _qa(4)}).save_to_disk(folder)
    with pytest.raises(ValueError, match=r"saved dataset .*dict has no split 'train'; its splits are \['validation'\]: "
                                         r"pass a split's folder \(--data .*dict/validation\), or set split: in the "
                                         r"mixture spec's source"):
        load_data(byt5, "seq2seq", data=folder, columns="inputs=question,targets=answer")
    data = load_data(byt5, "seq2seq", data=os.path.join(folder, "validation"), columns="inputs=question,targets=answer")
    assert len(data.sources[0]) == 4


def test_train_on_datasets_in_memory_and_on_a_csv_with_columns(tmp_path, capsys):
    from dynabatch.training.config import TrainConfig
    from dynabatch.training.trainer import train

    cfg = TrainConfig(**TINY, columns="inputs=question,targets=answer", output_dir=str(tmp_path / "mem"))
    summary = train(cfg, datasets={"qa": _qa(), "stream": _stream()})
    assert summary["runs"][0]["steps"] == 2
    with open(tmp_path / "mem" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 2 and all(r["loss"] > 0 for r in records)
    path = tmp_path / "qa.csv"
    path.write_text("question,answer\n" + "".join(f"what is {i} squared,{i * i}\n" for i in range(20)))
    cfg = TrainConfig(**TINY, data=str(path), columns="inputs=question,targets=answer", output_dir=str(tmp_path / "csv"))
    assert train(cfg)["runs"][0]["steps"] == 2
    assert "data: source 'qa': 20 numbers/bools cast to text (targets 20)" in capsys.readouterr().err  # the run's log


def test_the_tokenizer_may_be_a_name_and_another_object_is_one_line(byt5):
    """``tokenizer="byt5"`` (a name, as ``--tokenizer`` takes) was an ``AttributeError`` from deep inside the
    tokenization ('str' object has no attribute 'eos_token_id'); it is loaded as ``load_tokenizer`` loads it."""
    options = dict(token_budget=256, columns={"inputs": "question", "targets": "answer"})
    limits = LengthLimits("seq2seq", max_input_len=32, max_target_len=16)
    by_name = DynaBatchDataLoader(_qa(8), limits, tokenizer="byt5", **options)
    by_object = DynaBatchDataLoader(_qa(8), limits, tokenizer=byt5, **options)
    assert by_name.batcher.data.tokens == by_object.batcher.data.tokens
    assert [mb.sample_ids for mb in next(iter(by_name)).micro_batches] == [
        mb.sample_ids for mb in next(iter(by_object)).micro_batches]
    with pytest.raises(ValueError, match=r"^tokenizer= must be a Hugging Face tokenizer or a name load_tokenizer "
                                         r"takes .*, got int$"):
        DynaBatchDataLoader(_qa(8), limits, tokenizer=3, **options)


def test_wrapping_the_loader_in_a_torch_dataloader_is_one_line_saying_to_iterate_it(byt5):
    """``torch.utils.data.DataLoader(loader)`` indexed it as a dataset: "'DynaBatchDataLoader' object is not
    subscriptable" from inside torch. It now says that the loader is iterated directly."""
    import torch

    loader = DynaBatchDataLoader(_qa(8), LengthLimits("seq2seq", max_input_len=32, max_target_len=16),
                                 token_budget=256, tokenizer=byt5, columns={"inputs": "question", "targets": "answer"},
                                 max_steps=2)
    with pytest.raises(TypeError, match=r"^DynaBatchDataLoader is itself the data loader, .*iterate it directly"):
        next(iter(torch.utils.data.DataLoader(loader, batch_size=None)))
    assert len(list(loader)) == 2


def test_the_loader_takes_max_stream_rows_as_the_stream_warning_says(byt5):
    """A stream longer than the row limit warned "raise max_stream_rows / max_examples", which a DynaBatchDataLoader
    did not take: a loader user could not read more of an IterableDataset. The loader takes ``max_stream_rows``."""
    import warnings

    options = dict(token_budget=256, tokenizer=byt5, columns={"inputs": "question", "targets": "answer"})
    limits = LengthLimits("causal", max_seq_len=64)
    with pytest.warns(UserWarning, match=r"the first 10 are used \(raise max_stream_rows= of DynaBatchDataLoader"):
        short = DynaBatchDataLoader({"s": _stream(30)}, limits, max_stream_rows=10, **options)
    assert len(short.batcher.data.sources[0]) == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        whole = DynaBatchDataLoader({"s": _stream(30)}, limits, max_stream_rows=30, **options)
    assert len(whole.batcher.data.sources[0]) == 30


def test_dataset_options_given_with_tokenized_data_are_a_warning_not_silently_dropped(byt5):
    """``tokenizer=`` / ``columns=`` / ``bad_rows=`` with a ``MixtureData`` (already tokenized) were ignored without a
    word, e.g. a tokenizer other than the mixture's; a warning names them."""
    data = MixtureData.from_datasets(_qa(8), byt5, "seq2seq", columns={"inputs": "question", "targets": "answer"})
    limits = LengthLimits("seq2seq", max_input_len=32, max_target_len=16)
    with pytest.warns(UserWarning, match=r"^\['bad_rows', 'columns', 'tokenizer'\] apply to datasets given as data, "
                                         r"which this loader tokenizes; its data is a MixtureData, already tokenized"):
        DynaBatchDataLoader(data, limits, token_budget=256, tokenizer="gpt2", columns={"inputs": "q"}, bad_rows="skip")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        DynaBatchDataLoader(data, limits, token_budget=256)
        DynaBatchDataLoader(_qa(8), limits, token_budget=256, tokenizer=byt5, bad_rows="skip",
                            columns={"inputs": "question", "targets": "answer"})


def test_loss_on_inputs_with_encoder_decoder_data_is_one_line(byt5):
    """``loss_on_inputs=True`` on seq2seq data was ignored without a word (the encoder's inputs have no loss)."""
    options = dict(token_budget=256, tokenizer=byt5, columns={"inputs": "question", "targets": "answer"})
    with pytest.raises(ValueError, match=r"^loss_on_inputs=True takes loss on a decoder-only model's input tokens, but "
                                         r"the data is tokenized for 'seq2seq' models"):
        DynaBatchDataLoader(_qa(8), LengthLimits("seq2seq", max_input_len=32, max_target_len=16), loss_on_inputs=True,
                            **options)
    causal = DynaBatchDataLoader(_qa(8), LengthLimits("causal", max_seq_len=48), loss_on_inputs=True, **options)
    plain = DynaBatchDataLoader(_qa(8), LengthLimits("causal", max_seq_len=48), **options)
    assert next(iter(causal)).num_loss_tokens > next(iter(plain)).num_loss_tokens
