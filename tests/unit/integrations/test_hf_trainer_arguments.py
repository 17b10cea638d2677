"""DynaBatchTrainer and the TrainingArguments a stock Trainer acts on in evaluation and across train() calls:
``batch_eval_metrics`` (compute_metrics per eval step with ``compute_result``), ``bf16_full_eval`` (the model cast
before evaluating), ``Seq2SeqTrainingArguments(generation_config=...)`` and ``gen_kwargs`` (used by generation),
``eval_accumulation_steps`` (accepted: nothing piles up on the device), and a second ``train()`` without a checkpoint
(the data starts over, as the stock Trainer's new dataloader does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import write_jsonl

from dynabatch.data.batching import LengthLimits
from dynabatch.data.mixture import MixtureSpec
from dynabatch.data.pipeline import MixtureData
from dynabatch.integrations.dataloader import DynaBatchDataLoader
from dynabatch.models.presets import build_model
from dynabatch.plan.costs import PolynomialCostModel

WORDS = "red green blue cyan black white gold pink".split()
ROWS = 12

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def copy_data(tmp_path_factory, byt5) -> MixtureData:
    """ROWS rows of a copy task (1-8 words), tokenized for T5."""
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(ROWS):
        words = " ".join(rng.choice(WORDS, int(rng.integers(1, 9))))
        rows.append({"task": "copy", "inputs": f"copy: {words}", "targets": words})
    folder = tmp_path_factory.mktemp("copy")
    write_jsonl(folder / "copy.jsonl", rows)
    spec = MixtureSpec.from_dict({"name": "copy", "seed": 3, "sources": [{"task": "copy", "data_files": "copy.jsonl"}]},
                                 str(folder))
    return MixtureData.load(spec, byt5, "t5")


LIMITS = LengthLimits("t5", max_input_len=64, max_target_len=48, max_seq_len=112)


def eval_loader(data: MixtureData) -> DynaBatchDataLoader:
    """Every row once, in 3 or more steps."""
    return DynaBatchDataLoader(data, LIMITS, token_budget=150, each_row_once=True)


def settings(tmp_path, **extra) -> dict:
    return dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, disable_tqdm=True, **extra)


def test_batch_eval_metrics_calls_compute_metrics_per_step_with_compute_result(copy_data, byt5, tmp_path):
    """As Trainer's evaluation loop: one call per eval step, ``compute_result`` True on the last only, the metrics
    those of the last call; together the steps hand over exactly the predictions of one whole-set call."""
    from transformers import Seq2SeqTrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    model = build_model("t5-tiny", vocab_size=len(byt5), seed=1)
    loader = eval_loader(copy_data)
    calls, whole = [], []

    def per_step(p, compute_result: bool = False):
        calls.append((p.predictions, p.label_ids, compute_result))
        if compute_result:
            return {"rows": sum(len(c[0]) for c in calls)}
        return {"ignored": -1.0}

    def at_once(p, compute_result: bool = False):
        whole.append(p)
        return {"rows": len(p.predictions)}

    common = dict(predict_with_generate=True, generation_max_length=4)
    batched = DynaBatchTrainer(model=model, eval_loader=loader, compute_metrics=per_step,
                               args=Seq2SeqTrainingArguments(**settings(tmp_path, batch_eval_metrics=True, **common)))
    metrics = batched.evaluate()
    assert len(calls) == len(loader) >= 3
    assert [c[2] for c in calls] == [False] * (len(calls) - 1) + [True]
    assert metrics["eval_rows"] == ROWS and "eval_ignored" not in metrics
    plain = DynaBatchTrainer(model=model, eval_loader=loader, compute_metrics=at_once,
                             args=Seq2SeqTrainingArguments(**settings(tmp_path, **common)))
    assert plain.evaluate()["eval_loss"] == pytest.approx(metrics["eval_loss"])
    rows = lambda arrays, fill: sorted(tuple(int(t) for t in r if t != fill) for a in arrays for r in a)  # noqa: E731
    assert rows([c[0] for c in calls], 0) == rows([whole[0].predictions], 0)
    assert rows([c[1] for c in calls], -100) == rows([whole[0].label_ids], -100)
    # predict() keeps every prediction, and computes its metrics per step too
    calls.clear()
    out = batched.predict(loader)
    assert out.predictions.shape[0] == ROWS and out.metrics["test_rows"] == ROWS


def test_bf16_full_eval_evaluates_the_model_in_bf16(copy_data, byt5, tmp_path):
    """As Trainer: outside train() the model is cast to bf16 before evaluating (and stays so)."""
    from transformers import TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    model = build_model("t5-tiny", vocab_size=len(byt5), seed=1)
    loader = eval_loader(copy_data)
    fp32 = DynaBatchTrainer(model=model, eval_loader=loader, args=TrainingArguments(**settings(tmp_path))).evaluate()
    assert next(model.parameters()).dtype == torch.float32
    trainer = DynaBatchTrainer(model=model, eval_loader=loader,
                               args=TrainingArguments(**settings(tmp_path, bf16_full_eval=True)))
    bf16 = trainer.evaluate()
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert bf16["eval_loss"] == pytest.approx(fp32["eval_loss"], rel=0.05) and bf16["eval_loss"] != fp32["eval_loss"]


def test_generation_config_and_gen_kwargs_shape_generation(copy_data, byt5, tmp_path):
    """``Seq2SeqTrainingArguments(generation_config=...)`` is the model's generation config, as Seq2SeqTrainer makes
    it: its ``max_new_tokens`` bounds the predictions where nothing else does; ``gen_kwargs`` beyond the lengths and
    ``num_beams`` reach ``generate`` (``min_new_tokens`` holds EOS back)."""
    from transformers import GenerationConfig, Seq2SeqTrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    model = build_model("t5-tiny", vocab_size=len(byt5), seed=1)
    loader = DynaBatchDataLoader(copy_data, LIMITS, token_budget=300, each_row_once=True, eval_samples=6)
    default = DynaBatchTrainer(model=model, args=Seq2SeqTrainingArguments(**settings(tmp_path)))
    assert default.predict(loader).predictions.shape[1] < 3  # this untrained model ends (EOS) at once
    # min_new_tokens holds EOS back, suppress_tokens the pad, so each row has max_new_tokens ids
    config = GenerationConfig(max_new_tokens=3, min_new_tokens=3, suppress_tokens=[0], decoder_start_token_id=0,
                              eos_token_id=1, pad_token_id=0)
    given = DynaBatchTrainer(model=model, args=Seq2SeqTrainingArguments(**settings(tmp_path, generation_config=config)))
    assert given.model.generation_config.max_new_tokens == 3
    eos = byt5.eos_token_id
    predicted = given.predict(loader).predictions
    assert predicted.shape == (6, 3) and not (predicted == eos).any() and (predicted != 0).all()
    model.generation_config = GenerationConfig()  # as before: the gen_kwargs alone
    forced = default.predict(loader, max_new_tokens=5, min_new_tokens=5, suppress_tokens=[0]).predictions
    assert forced.shape == (6, 5) and not (forced == eos).any() and (forced != 0).all()


def test_eval_accumulation_steps_is_accepted_and_changes_nothing(copy_data, byt5, tmp_path):
    """``eval_accumulation_steps`` bounds how many steps of outputs ``Trainer`` keeps on the device; a
    DynaBatchTrainer keeps none there (generated ids go to the host as ``generate`` makes them), so any value holds:
    no warning, and ``evaluate()`` / ``predict()`` give what they give without it."""
    import warnings

    from transformers import Seq2SeqTrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    model = build_model("t5-tiny", vocab_size=len(byt5), seed=1)
    loader = eval_loader(copy_data)
    common = dict(predict_with_generate=True, generation_max_length=4)
    rows = lambda p: {"rows": len(p.predictions)}  # noqa: E731
    plain = DynaBatchTrainer(model=model, eval_loader=loader, compute_metrics=rows,
                             args=Seq2SeqTrainingArguments(**settings(tmp_path, **common)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accumulating = DynaBatchTrainer(model=model, eval_loader=loader, compute_metrics=rows,
                                        args=Seq2SeqTrainingArguments(**settings(tmp_path, eval_accumulation_steps=1,
                                                                                 **common)))
        metrics = accumulating.evaluate()
        out = accumulating.predict(loader)
    assert len(loader) >= 3 and metrics["eval_rows"] == ROWS == out.predictions.shape[0]
    assert metrics["eval_loss"] == plain.evaluate()["eval_loss"]
    expected = plain.predict(loader)
    assert np.array_equal(out.predictions, expected.predictions) and np.array_equal(out.label_ids, expected.label_ids)


def test_a_second_train_starts_the_data_over_as_trainer_does(copy_data, byt5, tmp_path):
    """A second ``train()`` without a checkpoint trains on the same steps as the first (HF's Trainer builds a new
    dataloader and counts from step 0); the model keeps what it learned."""
    from transformers import TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    model = build_model("t5-tiny", vocab_size=len(byt5), seed=1)
    train = DynaBatchDataLoader(copy_data, LIMITS, token_budget=300,
                                cost_model=PolynomialCostModel(memory_budget_bytes=64 * 2**20))
    trainer = DynaBatchTrainer(model=model, train_loader=train, args=TrainingArguments(**settings(
        tmp_path, max_steps=3, learning_rate=1e-3, save_strategy="no", seed=0)))
    seen: list[list] = []
    step = trainer.training_step

    def recorded(model, inputs, num_items_in_batch=None):
        seen[-1].append(sorted((s.source_index, s.row_index) for s in inputs.batch.samples))
        return step(model, inputs, num_items_in_batch)

    trainer.training_step = recorded
    seen.append([])
    trainer.train()
    weights = next(model.parameters()).detach().clone()
    seen.append([])
    trainer.train()
    assert len(seen[0]) == 3 and seen[1] == seen[0] and trainer.state.global_step == 3
    assert not torch.equal(weights, next(model.parameters()))  # trained on, not reset


def test_metrics_settings_it_does_not_act_on_are_one_warning_each(copy_data, byt5, tmp_path):
    """``compute_metrics`` without ``predict_with_generate`` (evaluate() would never call it) and
    ``include_for_metrics`` are a one-line warning each; with ``predict_with_generate`` compute_metrics is none."""
    import warnings

    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    model = build_model("t5-tiny", vocab_size=len(byt5), seed=1)
    loader = eval_loader(copy_data)
    with pytest.warns(UserWarning) as caught:
        DynaBatchTrainer(model=model, eval_loader=loader, compute_metrics=lambda p: {},
                         args=TrainingArguments(**settings(tmp_path, include_for_metrics=["loss"])))
    said = [str(w.message) for w in caught]
    assert sum(s.startswith("compute_metrics gets generated ids, so a DynaBatchTrainer's evaluate() calls it only "
                            "with Seq2SeqTrainingArguments(predict_with_generate=True)") for s in said) == 1
    assert sum(s.startswith("TrainingArguments(include_for_metrics=['loss']) has no effect") for s in said) == 1
    assert all("\n" not in s for s in said)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DynaBatchTrainer(model=model, eval_loader=loader, compute_metrics=lambda p: {},
                         args=Seq2SeqTrainingArguments(**settings(tmp_path, predict_with_generate=True)))
