"""Evaluation (``dynabatch.training.evaluate``): forward-only plans, generation metrics on real tiny models,
held-out rows, and ``dynabatch train`` with evaluation in one process (rows, resume, training unchanged).
The 2-stage pipeline against the unsplit model: tests/dist/test_eval_pipeline.py."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from dynabatch.training.config import TrainConfig
from dynabatch.data.sample import TokenizedSample
from dynabatch.data.tokenize import tokenizer_info
from dynabatch.models.presets import build_model
from dynabatch.training.evaluate import (
    decode,
    format_eval,
    generate_ids,
    generation_scores,
    hold_out,
    reference_text,
    select_samples,
)
from dynabatch.schedule.step import forward_only_plan, lower_step as plan_step
from dynabatch.schedule.ir import Op, PipelineSpec


@pytest.mark.parametrize("policy", ["gpipe", "1f1b"])
def test_forward_only_plan_keeps_each_forward_and_frees_after_the_last_use(policy):
    spec = PipelineSpec.gpt(3, 16, "float32")
    plans = plan_step([[(2, 5, 0), (1, 9, 0), (3, 4, 0), (2, 6, 0)]], spec, policy=policy)
    for plan in plans.values():
        ev = forward_only_plan(plan)
        ops = [i.op for i in ev.instructions]
        assert not {Op.BACKWARD, Op.SEND_GRAD, Op.RECV_GRAD, Op.REDUCE_GRADS, Op.OPTIMIZER_STEP} & set(ops)
        assert [i.micro_batch for i in ev.instructions if i.op is Op.FORWARD] == [0, 1, 2, 3]
        for m in range(4):
            mine = [k for k, i in enumerate(ev.instructions) if i.micro_batch == m]
            assert ev.instructions[mine[-1]].op is Op.FREE and ops.count(Op.FREE) == 4
        sends = [(i.op, i.micro_batch) for i in plan.instructions if i.op is Op.SEND_ACT]
        assert [(i.op, i.micro_batch) for i in ev.instructions if i.op is Op.SEND_ACT] == sends  # link order kept
        waits = [i for i in ev.instructions if i.op is Op.WAIT]
        assert all(w.waits_on in (Op.SEND_ACT, Op.RECV_ACT) for w in waits)
        assert len(waits) == ops.count(Op.SEND_ACT) + ops.count(Op.RECV_ACT)


def test_rouge_l_and_exact_match_of_known_strings():
    scores = generation_scores(
        ["the cat sat on the mat", "  a   b ", "x", "12 7"],
        ["the cat on the mat", "a b", "y", "12 7"],
        ["t1", "t2", "t2", "t1"])
    # LCS of 5 words: precision 5/6, recall 1, F = 2 * (5/6) / (5/6 + 1) = 10/11
    assert scores["rouge_l"]["t1"] == pytest.approx((10 / 11 + 1.0) / 2)
    assert scores["rouge_l"]["t2"] == pytest.approx(0.5)  # whitespace normalised; "x" vs "y" shares nothing
    assert scores["exact_match"] == {"t1": 0.5, "t2": 0.5}
    assert scores["exact_match_all"] == 0.5


def _prompts(rng, n: int, vocab: int, eos: int, seq2seq: bool) -> list[np.ndarray]:
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, int(rng.integers(2, 14)))
        out.append((np.append(ids, eos) if seq2seq else ids).astype(np.int32))
    return out


@pytest.mark.parametrize("model_name", ["t5-tiny", "gpt2-tiny"])
def test_exact_match_is_one_on_the_models_own_greedy_output(model_name, byt5):
    """Targets = what the model generates for each prompt alone (batch of one, no padding); the batched,
    padded generation of the evaluation reproduces them all, and a changed target lowers exact match."""
    tokens = tokenizer_info(byt5)
    model = build_model(model_name, vocab_size=tokens.vocab_size, seed=3).eval()
    seq2seq = model.config.is_encoder_decoder
    prompts = _prompts(np.random.default_rng(0), 7, tokens.vocab_size, tokens.eos_id, seq2seq)
    samples = []
    for p in prompts:
        x = torch.as_tensor(p[None].astype(np.int64))
        extra = {"decoder_start_token_id": tokens.decoder_start_id} if seq2seq else {}
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                                 pad_token_id=tokens.pad_id, eos_token_id=tokens.eos_id, **extra)[0]
        new = out[1:] if seq2seq else out[len(p):]
        target = [t for t in new.tolist() if t not in (tokens.pad_id, tokens.eos_id)][:6]
        samples.append(TokenizedSample(f"task{len(samples) % 2}", p, np.array(target + [tokens.eos_id], np.int32)))
    ids = generate_ids(model, samples, tokens, 6, batch_rows=4)  # two batches, each padded
    predictions = [decode(byt5, x) for x in ids]
    references = [reference_text(byt5, s, tokens) for s in samples]
    assert generation_scores(predictions, references, [s.task for s in samples])["exact_match"] == {
        "task0": 1.0, "task1": 1.0}
    references[0] = references[0] + " extra"
    scores = generation_scores(predictions, references, [s.task for s in samples])
    assert scores["exact_match"]["task0"] < 1.0 and scores["exact_match"]["task1"] == 1.0
    assert 0.0 < scores["rouge_l"]["task0"] < 1.0 or references[0].strip() == "extra"


def test_hold_out_splits_every_task_and_select_is_deterministic(toy_data):
    train, held = hold_out(toy_data, 0.1, seed=7)
    for full, a, b in zip(toy_data.sources, train.sources, held.sources):
        assert len(a) + len(b) == len(full) and len(b) == round(0.1 * len(full))
        kept = {a.source_row(i) for i in range(len(a))}
        out = {b.source_row(i) for i in range(len(b))}
        assert not kept & out and len(kept | out) == len(full)
        i = len(b) // 2  # a held-out row keeps its tokens and the row it came from
        np.testing.assert_array_equal(b.input_ids[i], full.input_ids[b.source_row(i)])
        np.testing.assert_array_equal(b.target_ids[i], full.target_ids[b.source_row(i)])
    assert np.isclose(train.rates.sum(), 1.0)
    first, again = select_samples(held, 5, 7), select_samples(held, 5, 7)
    assert [(s.source_index, s.row_index) for s in first] == [(s.source_index, s.row_index) for s in again]
    assert {s.task: sum(x.task == s.task for x in first) for s in first} == {"short": 4, "classify": 5,
                                                                                "summarize": 5}


# ---------------------------------------------------------------------------------------------- dynabatch train


def _config(toy_mixture_dir, out, **kw) -> TrainConfig:
    base = dict(model="t5-tiny", tokenizer="byt5", mixture=os.path.join(toy_mixture_dir, "toy.json"),
                global_batch_tokens=1024, max_input_len=128, max_target_len=32, max_steps=3, learning_rate=3e-3,
                logging_steps=0, timeline=False, calibrate="off", task_loss_every=0, output_dir=str(out),
                report_to="none")
    return TrainConfig.of(**{**base, **kw})


def _rows(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_train_with_evaluation_writes_task_rows_and_leaves_training_unchanged(tmp_path, toy_mixture_dir):
    from dynabatch.training.trainer import train

    plain = train(_config(toy_mixture_dir, tmp_path / "plain"))
    cfg = _config(toy_mixture_dir, tmp_path / "eval", eval_mixture=os.path.join(toy_mixture_dir, "toy.json"),
                  eval_steps=2, eval_samples=6, generate_every=0, generation_max_new_tokens=4)
    summary = train(cfg)
    rows = _rows(tmp_path / "eval")
    steps, evals = [r for r in rows if "kind" not in r], [r for r in rows if r.get("kind") == "eval"]
    assert [r["loss"] for r in steps] == [r["loss"] for r in _rows(tmp_path / "plain")]  # bitwise equal
    assert [r["samples_digest"] for r in steps] == [r["samples_digest"] for r in _rows(tmp_path / "plain")]
    assert [r["step"] for r in evals] == [1, 2]  # every 2 steps and at the end
    assert "exact_match" not in evals[0]["eval"]  # generate_every 0: generation only at the end
    for r in evals:
        ev = r["eval"]
        assert sorted(ev["task_loss"]) == ["classify", "short", "summarize"] and ev["samples"] == 18
        assert min(ev["task_loss"].values()) <= ev["loss"] <= max(ev["task_loss"].values())
    final = evals[-1]["eval"]
    assert sorted(final["exact_match"]) == sorted(final["rouge_l"]) == ["classify", "short", "summarize"]
    assert all(0.0 <= v <= 1.0 for v in [*final["exact_match"].values(), *final["rouge_l"].values()])
    assert evals[0]["eval"]["loss"] != final["loss"]  # the model trained in between
    assert summary["runs"][0]["eval"]["loss"] == final["loss"]
    assert summary["runs"][0]["steps"] == plain["runs"][0]["steps"] == 3  # eval rows are not steps

    # a resume at step 2 drops what the first run logged after it, evaluation rows included, and redoes it
    from dynabatch.engine.outputs import truncate_metrics

    truncate_metrics(os.path.join(tmp_path / "eval", "metrics.jsonl"), 2)
    assert [(r["step"], r.get("kind")) for r in _rows(tmp_path / "eval")] == [(0, None), (1, None), (1, "eval")]


def test_eval_holdout_trains_on_the_other_rows(tmp_path, toy_mixture_dir):
    from dynabatch.training.trainer import train

    cfg = _config(toy_mixture_dir, tmp_path / "ho", eval_holdout=0.2, eval_samples=4, max_steps=1, generate_every=0,
                  generation_max_new_tokens=2)
    train(cfg)
    rows = _rows(tmp_path / "ho")
    assert [r.get("kind") for r in rows] == [None, "eval"]
    assert sorted(rows[1]["eval"]["exact_match"]) == ["classify", "short", "summarize"]
    # no evaluation data then, so no eval_samples either (refused without data)
    cfg2 = dataclasses.replace(cfg, eval_holdout=0.0, eval_samples=None, output_dir=str(tmp_path / "plain"))
    train(cfg2)
    assert _rows(tmp_path / "plain")[0]["samples_digest"] != rows[0]["samples_digest"]  # other training rows


# ---------------------------------------------------------------------------------------------- DynaBatchTrainer


def test_dynabatch_trainer_predict_and_evaluate_with_generate(toy_data, byt5, tmp_path):
    """``predict`` and ``evaluate(predict_with_generate)`` hand generated ids and labels to ``compute_metrics``
    as Seq2SeqTrainer does: labels are the samples' targets, predictions what the model generates alone; callbacks'
    ``on_predict`` gets ``predict``'s metrics; with ``prediction_loss_only`` ``evaluate`` reports the loss alone."""
    from transformers import Seq2SeqTrainingArguments, TrainerCallback

    from dynabatch.data.batching import LengthLimits
    from dynabatch.integrations.dataloader import DynaBatchDataLoader
    from dynabatch.integrations.trainer import DynaBatchTrainer

    seq2seq = toy_data.family == "seq2seq"
    tokens = toy_data.tokens
    model = build_model("t5-tiny" if seq2seq else "gpt2-tiny", vocab_size=tokens.vocab_size, seed=1)
    limits = LengthLimits(toy_data.family, max_input_len=96, max_target_len=32, max_seq_len=128)
    loader = DynaBatchDataLoader(toy_data, limits, token_budget=600, method="token_budget",
                                 method_options={"max_tokens": 400}, max_steps=1, restart_on_iter=True)
    seen = []

    def compute_metrics(p):
        seen.append(p)
        texts = [byt5.decode([t for t in row if t >= 0], skip_special_tokens=True) for row in p.predictions]
        refs = [byt5.decode([t for t in row if t >= 0], skip_special_tokens=True) for row in p.label_ids]
        return {"exact_match": float(np.mean([a == b for a, b in zip(texts, refs)])), "num": len(texts)}

    class Predicted(TrainerCallback):  # as after Trainer.predict, callbacks hear of it (on_predict was never called)
        def on_predict(self, args, state, control, metrics=None, **kwargs):
            heard.append(metrics)

    heard = []
    settings = dict(output_dir=str(tmp_path), predict_with_generate=True, generation_max_length=5, report_to=[],
                    use_cpu=True, disable_tqdm=True)
    args = Seq2SeqTrainingArguments(**settings)
    trainer = DynaBatchTrainer(model=model, args=args, eval_loader=loader, compute_metrics=compute_metrics,
                               callbacks=[Predicted()])
    out = trainer.predict(loader)
    assert heard == [out.metrics]
    step = next(iter(loader))
    samples = [step.batch.samples[i] for mb in step.micro_batches for row in mb.sample_ids for i in row]
    assert out.metrics["test_num"] == len(samples) == out.predictions.shape[0] == out.label_ids.shape[0]
    assert 0.0 <= out.metrics["test_exact_match"] <= 1.0 and out.metrics["test_loss"] > 0
    np.testing.assert_array_equal(out.label_ids[0, : samples[0].target_len], samples[0].target_ids)
    assert (out.label_ids[0, samples[0].target_len:] == -100).all() and out.predictions.shape[1] <= 5
    x = torch.as_tensor(samples[-1].input_ids[None].astype(np.int64))  # the longest prompt, generated alone
    extra = {"decoder_start_token_id": tokens.decoder_start_id} if seq2seq else {}
    with torch.no_grad():
        alone = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=5, do_sample=False,
                               pad_token_id=tokens.pad_id, eos_token_id=tokens.eos_id, **extra)[0]
    alone = [t for t in (alone[1:] if seq2seq else alone[x.shape[1]:]).tolist() if t != tokens.pad_id]
    alone = alone[: alone.index(tokens.eos_id)] if tokens.eos_id in alone else alone
    got = out.predictions[-1]
    assert got[: len(alone)].tolist() == alone and (got[len(alone):] == tokens.pad_id).all()
    metrics = trainer.evaluate()
    assert set(metrics) >= {"eval_loss", "eval_exact_match", "eval_num"} and len(seen) == 2
    assert metrics["eval_loss"] == pytest.approx(out.metrics["test_loss"])
    # prediction_loss_only: the loss alone, as Seq2SeqTrainer evaluates it (it generated all the same); Seq2Seq's
    # sortish_sampler, which the loader's order decides, is a warning
    with pytest.warns(UserWarning, match=r"^TrainingArguments\(sortish_sampler=True\) has no effect"):
        loss_only_args = Seq2SeqTrainingArguments(**settings, prediction_loss_only=True, sortish_sampler=True)
        loss_only = DynaBatchTrainer(model=model, args=loss_only_args, eval_loader=loader, compute_metrics=compute_metrics)
    metrics = loss_only.evaluate()
    assert "eval_exact_match" not in metrics and len(seen) == 2
    assert metrics["eval_loss"] == pytest.approx(out.metrics["test_loss"])


def test_the_eval_line_names_the_worst_task_only_among_several():
    """It counts steps as the progress bar and step-000005 do: with --eval-steps 5 it said "eval after step 4"."""
    one = {"step": 4, "eval": {"loss": 6.95, "samples": 20, "task_loss": {"train": 6.95}, "time_s": 0.7}}
    assert format_eval(one) == "eval after 5 steps: loss 6.9500 over 20 samples of 1 task (0.7 s)"  # not "highest train"
    many = {"step": 9, "eval": {"loss": 8.45, "samples": 384, "task_loss": {"a": 8.0, "b": 9.19}, "time_s": 10.7,
                                "exact_match": {}, "exact_match_all": 0.0, "rouge_l_all": 0.25}}
    assert format_eval(many) == ("eval after 10 steps: loss 8.4500 over 384 samples of 2 tasks (highest task loss: "
                                 "b 9.1900), exact match 0.000, ROUGE-L 0.250 (10.7 s)")
