"""Hugging Face integration: DynaBatchDataLoader coverage, weights, replicas and resumption;
DynaBatchTrainer training tiny T5 / GPT-2 with the logged loss equal to the manual token-normalised loss,
evaluation, checkpoints and resuming at the same data position."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from conftest import write_jsonl

from dynabatch.data.batching import GlobalBatcher, LengthLimits
from dynabatch.data.mixture import MixtureSpec
from dynabatch.data.pipeline import MixtureData
from dynabatch.integrations.dataloader import DynaBatchDataLoader, StepBatch, sample_loss_tokens
from dynabatch.models.forward import forward_loss
from dynabatch.models.presets import build_config, build_model
from dynabatch.plan.costs import PolynomialCostModel

LOADER_METHODS = {
    "dynamic": {},
    "padding": {"samples_per_micro_batch": 4},
    "token_budget": {"max_tokens": 1024},
    "packing": {"rows_per_micro_batch": 2},
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def limits_for(family: str) -> LengthLimits:
    return LengthLimits(family, max_input_len=128, max_target_len=64, max_seq_len=192)


def make_loader(data, method="dynamic", **kwargs) -> DynaBatchDataLoader:
    options = dict(token_budget=3000, method=method, method_options=LOADER_METHODS[method])
    if method == "dynamic":
        options.update(hardware="cpu", model_config=build_config("t5-tiny" if data.family == "seq2seq" else "gpt2-tiny"))
    options.update(kwargs)
    return DynaBatchDataLoader(data, limits_for(data.family), **options)


def sample_keys(batch, ids) -> list[tuple[int, int]]:
    return [(batch.samples[i].source_index, batch.samples[i].row_index) for i in ids]


def step_sample_ids(step: StepBatch) -> list[int]:
    return [i for mb in step.micro_batches for row in mb.sample_ids for i in row]


# ---------------------------------------------------------------------------------------------- loader


@pytest.mark.parametrize("method", list(LOADER_METHODS))
def test_micro_batches_cover_each_global_batch_exactly_once(toy_data, method):
    loader = make_loader(toy_data, method, max_steps=3)
    steps = list(loader)
    assert len(steps) == len(loader) == 3
    for k, step in enumerate(steps):
        assert step.step == k
        assert sorted(step_sample_ids(step)) == list(range(len(step.batch)))
        assert step.num_loss_tokens == sum(sample_loss_tokens(step.batch, toy_data.family))
        assert sum(mb.num_loss_tokens for mb in step.micro_batches) == step.num_loss_tokens
        assert sum(step.weights) == pytest.approx(1.0)
        assert step.stats.real_tokens == step.batch.num_tokens
        assert step.stats.num_micro_batches == len(step.micro_batches)
        assert 0 < step.stats.efficiency <= 1
        if method != "packing":  # each micro-batch padded to its own longest sample only
            for mb in step.micro_batches:
                ids = [row[0] for row in mb.sample_ids]
                e, d = step.batch.input_lens[ids], step.batch.target_lens[ids]
                if toy_data.family == "seq2seq":
                    assert mb.shape[1:] == (e.max(), d.max())
                else:
                    assert mb.shape[1] == (e + d).max()
    if method == "dynamic":
        assert max(s.stats.num_micro_batches for s in steps) > 1  # the cpu preset's budget splits these batches


@pytest.mark.parametrize("method", ["dynamic", "padding"])
def test_replicas_are_disjoint_and_cover_the_batch(toy_data, method):
    loaders = [make_loader(toy_data, method, num_replicas=2, replica_index=r, max_steps=2) for r in range(2)]
    for s0, s1 in zip(*loaders):
        assert sample_keys(s0.batch, range(len(s0.batch))) == sample_keys(s1.batch, range(len(s1.batch)))
        ids0, ids1 = step_sample_ids(s0), step_sample_ids(s1)
        assert ids0 and ids1 and not set(ids0) & set(ids1)
        assert sorted(ids0 + ids1) == list(range(len(s0.batch)))
        assert s0.num_loss_tokens == s1.num_loss_tokens
        assert sum(s0.weights) + sum(s1.weights) == pytest.approx(1.0)
        assert (s0.replica_index, s1.replica_index, s0.num_replicas) == (0, 1, 2)


def test_deterministic_and_resumable(toy_data):
    a, b = make_loader(toy_data), make_loader(toy_data)
    first_a, first_b = a.next_step(), b.next_step()
    for x, y in zip(first_a.micro_batches, first_b.micro_batches, strict=True):
        assert x.sample_ids == y.sample_ids and torch.equal(x.input_ids, y.input_ids)
    state = a.state_dict()
    expected = [a.next_step() for _ in range(2)]
    c = make_loader(toy_data)
    c.load_state_dict(state)
    for want, got in zip(expected, [c.next_step() for _ in range(2)]):
        assert got.step == want.step
        assert sample_keys(got.batch, range(len(got.batch))) == sample_keys(want.batch, range(len(want.batch)))
        assert [mb.sample_ids for mb in got.micro_batches] == [mb.sample_ids for mb in want.micro_batches]


def test_a_position_saved_with_other_stream_settings_is_refused_naming_them(toy_data):
    """A position loaded into a loader of another token budget, length limits or seed silently cut other global
    batches than the saved run's (the batcher's state does not hold them); it is one ``ValueError`` naming each,
    while another method (which cuts the same global batches differently) still resumes."""
    state = make_loader(toy_data).state_dict()
    family = toy_data.family
    other_limits = LengthLimits(family, max_input_len=96, max_target_len=64, max_seq_len=96)
    for kwargs, said in ((dict(token_budget=4000), "token_budget=3000 then, 4000 now"),
                         (dict(limits=other_limits), "limits="),
                         (dict(seed=5), "seed=")):
        options = dict(token_budget=3000, hardware="cpu", model_config=build_config(
            "t5-tiny" if family == "seq2seq" else "gpt2-tiny"))
        options.update(kwargs)
        limits = options.pop("limits", limits_for(family))
        loader = DynaBatchDataLoader(toy_data, limits, **options)
        with pytest.raises(ValueError, match=r"^this position was saved by a loader with other stream settings "
                                             rf"\({said}"):
            loader.load_state_dict(state)
    padding = make_loader(toy_data, "padding")
    padding.load_state_dict(state)
    assert padding.next_step().step == 0


def test_length_restart_and_shared_batcher(toy_data):
    endless = make_loader(toy_data)
    with pytest.raises(TypeError, match="max_steps"):
        len(endless)
    evaluation = make_loader(toy_data, max_steps=2, restart_on_iter=True)
    first = [sample_keys(s.batch, range(len(s.batch))) for s in evaluation]
    assert first == [sample_keys(s.batch, range(len(s.batch))) for s in evaluation]
    batcher = GlobalBatcher(toy_data, limits_for(toy_data.family), token_budget=3000)
    loader = DynaBatchDataLoader(batcher)
    loader.next_step()
    assert batcher.step == 1  # the loader advances the batcher it was given


def test_a_position_saved_inside_an_iteration_finishes_that_iteration(toy_data):
    """A restarting loader resumed at step 2 of 3 yields the third batch of its pass, then restarts, as the
    uninterrupted loader does (it used to restart at once and replay the first batch)."""
    def keys(steps) -> list:
        return [sample_keys(s.batch, range(len(s.batch))) for s in steps]

    for restart in (True, False):
        loader = make_loader(toy_data, max_steps=3, restart_on_iter=restart)
        passes = iter(loader)
        first = [next(passes), next(passes)]
        state = loader.state_dict()  # saved while the second step trains, as a Trainer checkpoint is
        uninterrupted = keys(first) + keys(passes) + keys(loader)
        resumed = make_loader(toy_data, max_steps=3, restart_on_iter=restart)
        resumed.load_state_dict(state)
        rest = keys(resumed)
        assert len(rest) == 1
        assert keys(first) + rest + keys(resumed) == uninterrupted
    assert uninterrupted[3] != uninterrupted[0]  # the stream loader goes on
    restarting = make_loader(toy_data, max_steps=3, restart_on_iter=True)
    assert keys(restarting)[0] == keys(restarting)[0]


def test_smaller_memory_gives_more_micro_batches(toy_data):
    counts = []
    for memory in (2**36, 2**26):
        loader = make_loader(toy_data, hardware="a100-80gb", device_memory_bytes=memory, max_steps=2)
        counts.append(sum(s.stats.num_micro_batches for s in loader))
    assert counts[1] > counts[0]


@pytest.mark.parametrize("model_name", ["t5-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_default_cost_model_prices_memory_as_the_trainer(model_name, dtype):
    """The loader's analytic model is the trainer's planner model of the same run (one stage, CPU): the same
    activation bytes per micro-batch, the half-precision weight copy, fused-attention memory but for T5 on CPU, and
    the dense path's masks when the loop runs it."""
    from dynabatch.training.config import TrainConfig
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.integrations.dataloader import default_cost_model
    from dynabatch.training.trainer import planner_cost_model

    config = build_config(model_name)
    loader_model = default_cost_model(config, "cpu", 2**30, dtype=dtype)
    layer_model = loader_model.model
    assert layer_model.fused_memory == (model_name == "gpt2-tiny")
    assert layer_model.cast_copy_bytes == (2 if dtype == "bf16" else 0)
    cfg = TrainConfig(model=model_name, stages=1, dtype=dtype, dropout=0.1, memory_gib=1.0, recompute="none")
    trainer_model = planner_cost_model(cfg, config, balanced_layout(layer_model, 1))
    b, E, D = np.array([4.0, 16.0]), np.array([96.0, 24.0]), np.array([32.0, 8.0])
    np.testing.assert_allclose(loader_model.evaluate(b, E, D), trainer_model.evaluate(b, E, D), rtol=1e-12)
    dense = default_cost_model(config, "cpu", 2**30, attention="dense").model
    assert dense.dense_masks and not loader_model.model.dense_masks


def test_baseline_options_take_the_batcher_s_or_the_train_flag_s_name(toy_data):
    """``method_options`` of a baseline: its batcher's field names or ``dynabatch train``'s (the TrainConfig field);
    the same micro-batches either way; another name, or both names at once, is one line listing the valid ones."""
    limits = limits_for(toy_data.family)

    def cuts(method: str, options: dict) -> list[list[int]]:
        loader = DynaBatchDataLoader(toy_data, limits, token_budget=3000, method=method, method_options=options,
                                     max_steps=2)
        return [[len(mb.sample_ids) for mb in step.micro_batches] for step in loader]

    assert cuts("packing_free", {"packing_free_rows": 2}) == cuts("packing_free", {"rows_per_micro_batch": 2})
    assert cuts("packing_free", {"packing_free_rows": 1}) != cuts("packing_free", {"packing_free_rows": 4})
    # train raises a token budget below one maximal sample to one; so does its name here
    assert cuts("token_budget", {"token_budget_tokens": 1}) == cuts("token_budget", {"max_tokens": limits.max_tokens})
    with pytest.raises(ValueError, match=r"^method_options 'packing_rows' not taken by baseline 'packing_free'; "
                                         r"valid: rows_per_micro_batch, packing_free_rows$"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, method="packing_free",
                            method_options={"packing_rows": 2})
    with pytest.raises(ValueError, match="micro-batch size twice"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, method="packing_free",
                            method_options={"packing_free_rows": 2, "rows_per_micro_batch": 2})
    with pytest.raises(ValueError, match="'loss_on_inputs' not taken by baseline 'padding'; valid: samples_per_micro"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, method="padding",
                            method_options={"loss_on_inputs": True})


def test_loader_rejects_bad_settings(toy_data):
    limits = limits_for(toy_data.family)
    with pytest.raises(ValueError, match="valid: dynamic"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, method="bucket")
    with pytest.raises(ValueError, match="replica_index=2, num_replicas=2"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, num_replicas=2, replica_index=2)
    with pytest.raises(ValueError, match="token_budget"):
        DynaBatchDataLoader(toy_data, limits)
    other = "gpt2-tiny" if toy_data.family == "seq2seq" else "t5-tiny"
    with pytest.raises(ValueError, match="tokenized for"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, model_config=build_config(other))
    with pytest.raises(ValueError, match="restart_on_iter"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, restart_on_iter=True)
    with pytest.raises(ValueError, match="baselines"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, method_options={"samples_per_micro_batch": 2})
    with pytest.warns(UserWarning, match="no effect"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, method="padding", hardware="cpu")
    with pytest.raises(ValueError, match="unknown dtype 'fp64'; valid: fp32, bf16, fp16"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, dtype="fp64")
    with pytest.raises(ValueError, match="unknown attention 'flash'"):
        DynaBatchDataLoader(toy_data, limits, token_budget=3000, attention="flash")


# ---------------------------------------------------------------------------------------------- trainer

WORDS = "red green blue cyan black white gold pink".split()


@pytest.fixture(scope="module")
def copy_spec(tmp_path_factory) -> MixtureSpec:
    """A small learnable task (copy 1-12 words) so that the loss falls within a few steps."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(48):
        words = " ".join(rng.choice(WORDS, int(rng.integers(1, 13))))
        rows.append({"task": "copy", "inputs": f"copy: {words}", "targets": words})
    folder = tmp_path_factory.mktemp("copy")
    write_jsonl(folder / "copy.jsonl", rows)
    return MixtureSpec.from_dict({"name": "copy", "seed": 3, "sources": [{"task": "copy", "data_files": "copy.jsonl"}]}, str(folder))


def trainer_setup(copy_spec, byt5, family: str, tmp_path, model_name: str | None = None, **arg_overrides):
    from transformers import TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    data = MixtureData.load(copy_spec, byt5, family)
    model = build_model(model_name or ("t5-tiny" if family == "t5" else "gpt2-tiny"), vocab_size=len(byt5))
    # A small activation budget cuts each ~800-token batch into 3-4 micro-batches of varying count.
    options = dict(token_budget=800, cost_model=PolynomialCostModel(memory_budget_bytes=64 * 2**20))
    train = DynaBatchDataLoader(data, limits_for(family), **options)
    twin = DynaBatchDataLoader(data, limits_for(family), **options)  # the same StepBatches, for manual checks
    evaluation = DynaBatchDataLoader(data, limits_for(family), max_steps=2, restart_on_iter=True, **options)
    settings = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    settings.update(arg_overrides)
    trainer = DynaBatchTrainer(model=model, args=TrainingArguments(**settings), train_loader=train, eval_loader=evaluation)
    return trainer, twin, evaluation


def manual_loss(model, step: StepBatch) -> float:
    with torch.no_grad():
        return sum(forward_loss(model, mb).loss_sum.item() for mb in step.micro_batches) / step.num_loss_tokens


@pytest.mark.parametrize("family,model_name", [("t5", "t5-tiny"), ("gpt2", "gpt2-tiny"), ("causal", "llama-tiny")])
def test_trainer_loss_falls_and_equals_manual_token_normalised_loss(copy_spec, byt5, family, model_name, tmp_path):
    from transformers import TrainerCallback

    trainer, twin, _ = trainer_setup(copy_spec, byt5, family, tmp_path, model_name)
    manual, num_micro_batches = [], []
    twin_steps = iter(twin)

    class Manual(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            step = next(twin_steps)  # the batch the trainer is about to train on
            manual.append(manual_loss(copy.deepcopy(model), step))  # with the weights before the update
            num_micro_batches.append(len(step.micro_batches))

    trainer.add_callback(Manual())
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == len(manual) == 8
    np.testing.assert_allclose(logged, manual, rtol=1e-5)
    assert max(num_micro_batches) > 1 and len(set(num_micro_batches)) > 1  # variable micro-batch counts
    assert np.mean(logged[-2:]) < 0.8 * logged[0]
    first = next(h for h in trainer.state.log_history if "loss" in h)
    assert 0 < first["padding_efficiency"] <= 1 and first["micro_batches_per_step"] >= 1


def test_trainer_evaluates_saves_and_resumes_at_the_same_data(copy_spec, byt5, tmp_path):
    settings = dict(max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, ignore_data_skip=True)
    trainer, _, evaluation = trainer_setup(copy_spec, byt5, "t5", tmp_path, **settings)
    trainer.train()
    history = trainer.state.log_history
    evals = [h["eval_loss"] for h in history if "eval_loss" in h]
    assert len(evals) == 2
    steps = list(evaluation)
    with torch.no_grad():
        loss_sum = sum(forward_loss(trainer.model, mb).loss_sum.item() for s in steps for mb in s.micro_batches)
    expected = loss_sum / sum(s.num_loss_tokens for s in steps)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert evals[-1] == pytest.approx(expected, rel=1e-5)  # the last evaluation saw the final weights
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "dynabatch_loader.json").exists() and (checkpoint / "model.safetensors").exists()

    resumed, _, _ = trainer_setup(copy_spec, byt5, "t5", tmp_path, **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    train_losses = {h["step"]: h["loss"] for h in history if "loss" in h}
    resumed_losses = {h["step"]: h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 2}
    assert sorted(resumed_losses) == [3, 4]
    for k, loss in resumed_losses.items():
        assert loss == pytest.approx(train_losses[k], rel=1e-5)


@pytest.mark.parametrize("ignore_data_skip", [True, False])
@pytest.mark.parametrize("loader_steps", [3, None])
def test_trainer_resumed_inside_an_epoch_trains_on_the_same_batches_at_the_same_epoch(
    copy_spec, byt5, tmp_path, ignore_data_skip, loader_steps
):
    """Epochs over a ``restart_on_iter`` loader (the same batches each epoch; ``None``: an endless loader, one epoch
    of ``max_steps``), resumed at step 2: the resumed steps see the batches, and so the losses, of the
    uninterrupted run, and log its ``epoch`` (the Trainer counted the resumed epoch from its first step, so step 3
    logged epoch 0.33 of an epoch of 3 steps, 0.2 of an endless one, with ``ignore_data_skip=True``; the default
    ``False`` was refused)."""
    from transformers import TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    data = MixtureData.load(copy_spec, byt5, "gpt2")

    def run(resume: str | None = None) -> dict[int, tuple[float, float]]:
        model = build_model("gpt2-tiny", vocab_size=len(byt5))
        loader = DynaBatchDataLoader(data, limits_for("gpt2"), token_budget=400, cost_model=PolynomialCostModel(),
                                     max_steps=loader_steps, restart_on_iter=loader_steps is not None)
        length = dict(num_train_epochs=2) if loader_steps else dict(max_steps=5)
        args = TrainingArguments(output_dir=str(tmp_path / "out"), save_steps=2, logging_steps=1, **length,
                                 learning_rate=3e-3, lr_scheduler_type="constant", ignore_data_skip=ignore_data_skip,
                                 report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
        trainer = DynaBatchTrainer(model=model, args=args, train_loader=loader)
        trainer.train(resume_from_checkpoint=resume)
        assert args.ignore_data_skip is ignore_data_skip  # as given, after train()
        return {h["step"]: (h["loss"], h["epoch"]) for h in trainer.state.log_history if "loss" in h}

    uninterrupted = run()
    resumed = run(str(tmp_path / "out" / "checkpoint-2"))
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, 7 if loader_steps else 6))
    for step in range(3, len(resumed) + 1):
        assert resumed[step][0] == pytest.approx(uninterrupted[step][0], rel=1e-5)
        assert resumed[step][1] == pytest.approx(uninterrupted[step][1])


def test_evaluate_takes_the_name_of_one_eval_loader_as_trainer_evaluate_does(copy_spec, byt5, tmp_path):
    from dynabatch.integrations.trainer import DynaBatchTrainer

    trainer, _, evaluation = trainer_setup(copy_spec, byt5, "t5", tmp_path)
    named = DynaBatchTrainer(model=trainer.model, args=trainer.args, eval_loader={"qa": evaluation})
    by_name = named.evaluate("qa")
    assert by_name["eval_loss"] == pytest.approx(named.evaluate()["eval_qa_loss"], rel=1e-6)
    with pytest.raises(ValueError, match=r"evaluate\('nope'\) names an eval loader, but eval_loader has \['qa'\]"):
        named.evaluate("nope")
    with pytest.raises(ValueError, match="not a dict"):
        trainer.evaluate("qa")
    # an endless train loader, or the data itself, was refused with a repr (over lines for a Dataset) and no advice
    with pytest.raises(ValueError, match=r"^evaluate\(\) / predict\(\) got an endless DynaBatchDataLoader \(a training "
                                         r"stream, which draws rows with repetition and never ends\); build it with "
                                         r"each_row_once=True \(every row once\)$"):
        trainer.predict(trainer.train_loader)
    with pytest.raises(ValueError, match=r"^evaluate\(\) / predict\(\) take a DynaBatchDataLoader, got a MixtureData; "
                                         r"build one on the data with each_row_once=True \(every row once\)$"):
        trainer.evaluate(evaluation.batcher.data)


def test_trainer_keeps_freed_memory_as_train_decides_it(copy_spec, byt5, tmp_path, monkeypatch):
    """``cpu_allocator="auto"`` is decided by the resolver's rule, as ``dynabatch train`` decides it: ``keep`` for an
    encoder-decoder on CPU (its eager attention scores; the loader's budget twice over fits the host), ``system``
    for a decoder-only model; ``train()`` runs inside ``freed_tensors_kept`` as decided (in effect on glibc) and
    says why in ``resolved``. A value given stays; an unknown one is refused."""
    import platform
    import sys

    from conftest import spy_freed_tensors_kept
    from dynabatch.integrations import trainer as module

    seen = spy_freed_tensors_kept(monkeypatch, module)
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    for family, expected in (("t5", "keep"), ("gpt2", "system")):
        trainer, _, _ = trainer_setup(copy_spec, byt5, family, tmp_path, max_steps=1)
        trainer.train()
        value, why = trainer.resolved["cpu_allocator"]
        assert value == expected and ("encoder-decoder" if family == "t5" else "decoder-only") in why
        assert seen.pop() == (expected == "keep", glibc and expected == "keep")
    given, _, _ = trainer_setup(copy_spec, byt5, "t5", tmp_path, max_steps=1)
    given.cpu_allocator = "system"
    given.train()
    assert seen.pop() == (False, False) and "cpu_allocator" not in given.resolved
    with pytest.raises(ValueError, match="unknown cpu_allocator 'fast'; valid: auto, keep, system"):
        module.DynaBatchTrainer(model=given.model, args=given.args, train_loader=given.train_loader,
                                cpu_allocator="fast")


def test_trainer_rejects_gradient_accumulation_and_wrong_replica(copy_spec, byt5, tmp_path):
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
        trainer_setup(copy_spec, byt5, "t5", tmp_path, gradient_accumulation_steps=2)
    trainer, _, _ = trainer_setup(copy_spec, byt5, "t5", tmp_path, save_strategy="steps", save_steps=2)
    from dynabatch.integrations.trainer import DynaBatchTrainer

    loader = DynaBatchDataLoader(
        trainer.train_loader.batcher, num_replicas=2, replica_index=1
    )
    with pytest.raises(ValueError, match="replica 1 of 2 but this process is 0 of 1"):
        DynaBatchTrainer(model=trainer.model, args=trainer.args, train_loader=loader)
    # a loader given to evaluate() / predict() was not checked: its share, another rank's, was evaluated as this one's
    other = DynaBatchDataLoader(trainer.train_loader.batcher.data, each_row_once=True, eval_samples=4,
                                limits=trainer.train_loader.limits, token_budget=800,
                                cost_model=PolynomialCostModel(), num_replicas=2, replica_index=1)
    for call in (trainer.evaluate, trainer.predict):
        with pytest.raises(ValueError, match=r"^the loader of evaluate\(\) / predict\(\) is replica 1 of 2 but this "
                                             r"process is 0 of 1; build it with num_replicas=args.world_size"):
            call(other)
    from transformers import TrainingArguments

    evaluating = TrainingArguments(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=2, report_to=[],
                                   use_cpu=True)
    with pytest.raises(ValueError, match=r"^TrainingArguments\(eval_strategy='steps'\) evaluates during training, but "
                                         r"no eval_loader was given: pass eval_loader=DynaBatchDataLoader\(\.\.\., "
                                         r"each_row_once=True\), or set eval_strategy='no'$"):
        DynaBatchTrainer(model=trainer.model, args=evaluating, train_loader=trainer.train_loader)


def test_training_arguments_seed_orders_a_loader_built_on_datasets(byt5, tmp_path):
    """As the stock Trainer's sampler: ``TrainingArguments``' ``data_seed`` (else ``seed``) orders a train loader that
    tokenized datasets without ``seed=`` (it always used 0); a seed given to the loader stays, with a warning."""
    import datasets
    from transformers import TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    rows = datasets.Dataset.from_dict({"inputs": [f"copy: {w}" for w in WORDS * 4], "targets": WORDS * 4})
    model = build_model("gpt2-tiny", vocab_size=len(byt5))

    def loader(**kwargs) -> DynaBatchDataLoader:
        return DynaBatchDataLoader(rows, limits_for("gpt2"), token_budget=200, tokenizer=byt5,
                                   cost_model=PolynomialCostModel(), **kwargs)

    def trainer(train: DynaBatchDataLoader, **settings) -> DynaBatchTrainer:
        args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **settings)
        return DynaBatchTrainer(model=model, args=args, train_loader=train)

    def order(train: DynaBatchDataLoader) -> list[int]:
        return [s.row_index for _ in range(2) for s in train.next_step().batch.samples]

    followed = loader()
    assert trainer(followed, seed=5).resolved["data_seed"] == (5, "TrainingArguments.seed; the train loader was "
                                                                  "built without seed=")
    assert order(followed) == order(loader(seed=5)) != order(loader())
    by_data_seed = loader()
    trainer(by_data_seed, seed=5, data_seed=6)
    assert by_data_seed.data_seed == 6
    own = loader(seed=3)
    with pytest.warns(UserWarning, match=r"^train_loader was built with seed=3, which orders its data instead of "
                                         r"TrainingArguments.seed=5; build it with seed=args.seed"):
        trainer(own, seed=5)
    assert own.data_seed == 3


def test_trainer_logs_and_warns_of_truncated_samples(copy_spec, byt5, tmp_path):
    """Samples cut to the loader's limits are counted as ``dynabatch train`` counts them: ``truncated`` in each
    training log, one warning with the total after ``train()``, ``eval_truncated`` in the evaluation metrics."""
    import re

    from transformers import TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    data = MixtureData.load(copy_spec, byt5, "gpt2")
    limits = LengthLimits("gpt2", max_seq_len=48)  # some copy samples are longer
    train = DynaBatchDataLoader(data, limits, token_budget=300, cost_model=PolynomialCostModel())
    evaluation = DynaBatchDataLoader(data, limits, token_budget=300, cost_model=PolynomialCostModel(),
                                     each_row_once=True)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = DynaBatchTrainer(model=build_model("gpt2-tiny", vocab_size=len(byt5)), args=args, train_loader=train)
    with pytest.warns(UserWarning) as caught:
        trainer.train()
    logged = [h["truncated"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and sum(logged) == train.batcher.num_truncated > 0
    found = [re.match(r"(\d+) of the (\d+) samples trained were truncated to the train loader's limits "
                      r"\(max_seq_len=48\); the logs count them as 'truncated'", str(w.message)) for w in caught]
    (match,) = [m for m in found if m]
    assert int(match[1]) == train.batcher.num_truncated < int(match[2])
    metrics = trainer.evaluate(evaluation)
    assert metrics["eval_truncated"] == sum(b.num_truncated for b in evaluation.batcher.batches) > 0


def test_trainer_warns_of_arguments_the_loader_decides_and_counts_samples_trained(copy_spec, byt5, tmp_path):
    """``per_device_train_batch_size``, ``dataloader_num_workers`` and ``dataloader_drop_last`` do nothing here: each
    set is one warning naming what decides instead; ``train_samples_per_second`` counts the samples the steps held,
    not ``per_device_train_batch_size`` per step."""
    import warnings

    with warnings.catch_warnings(record=True) as defaults:
        warnings.simplefilter("always")
        trainer_setup(copy_spec, byt5, "gpt2", tmp_path, max_steps=2)
    assert not [w for w in defaults if "has no effect on a DynaBatchTrainer" in str(w.message)]
    with pytest.warns(UserWarning) as caught:
        trainer, twin, _ = trainer_setup(copy_spec, byt5, "gpt2", tmp_path, max_steps=2, per_device_train_batch_size=64,
                                         dataloader_num_workers=2)
    messages = [str(w.message) for w in caught]
    assert ("TrainingArguments(per_device_train_batch_size=64) has no effect on a DynaBatchTrainer: the train "
            "loader's token_budget decides the samples of each step") in messages
    assert ("TrainingArguments(dataloader_num_workers=2) has no effect on a DynaBatchTrainer: the loader plans and "
            "collates in the training process") in messages
    with pytest.warns(UserWarning, match=r"^TrainingArguments\(dataloader_drop_last=True\) has no effect on a "
                                         r"DynaBatchTrainer: every training step is a whole token-budget global batch"):
        trainer_setup(copy_spec, byt5, "gpt2", tmp_path, max_steps=2, dataloader_drop_last=True)  # was silent
    metrics = trainer.train().metrics
    samples = sum(len(twin.next_step().batch) for _ in range(2))
    assert metrics["train_samples_per_second"] == pytest.approx(samples / metrics["train_runtime"], rel=1e-2)
    assert trainer.state.log_history[-1]["train_samples_per_second"] == metrics["train_samples_per_second"]


def test_data_parallel_trainer_logs_the_single_process_losses(tmp_path, monkeypatch):
    """torchrun, 2 CPU processes (gloo): each rank trains its share of every global batch, gradients are
    summed after a different number of micro-batches per rank, and the logged losses equal one process's.
    The one process is this one (the script run as ``__main__`` with its arguments; no process group, as when
    started alone), which spares a fresh interpreter's 7-8 s of importing torch, transformers and the Trainer."""
    import json
    import runpy
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "hf_trainer.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    single, parallel = tmp_path / "single", tmp_path / "parallel"
    common = [script, "--steps", "4"]
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [*common, "--output-dir", str(single)])
    # the script ends a process group it finds with os._exit: none may be left over from an earlier test
    assert not torch.distributed.is_initialized()
    runpy.run_path(script, run_name="__main__")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*torchrun, *common, "--output-dir", str(parallel)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    def losses(folder):
        with open(folder / "checkpoint-4" / "trainer_state.json") as f:
            history = json.load(f)["log_history"]
        train = [h for h in history if "loss" in h]
        evals = [h["eval_loss"] for h in history if "eval_loss" in h]
        return [h["loss"] for h in train], evals, sum(h["micro_batches_per_step"] for h in train)

    (train_1, eval_1, micro_1), (train_2, eval_2, micro_2) = losses(single), losses(parallel)
    assert len(train_1) == 4 and len(eval_1) == 2
    assert micro_2 < micro_1  # rank 0 really ran only its share (a non-distributed run would match trivially)
    np.testing.assert_allclose(train_2, train_1, rtol=1e-5)
    np.testing.assert_allclose(eval_2, eval_1, rtol=1e-5)


def test_loader_plans_for_a_llama_config_and_checks_the_sequence_kind(copy_spec, byt5):
    data = MixtureData.load(copy_spec, byt5, "causal")
    loader = DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, hardware="cpu",
                                 model_config=build_config("llama-tiny"), max_steps=1)
    (step,) = list(loader)
    assert step.micro_batches and sorted(step_sample_ids(step)) == list(range(len(step.batch)))
    with pytest.raises(ValueError, match=r"'t5' model \(seq2seq\) but the data is tokenized for 'causal'"):
        DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, model_config=build_config("t5-tiny"))
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="model type 'bart' is not supported"):
        DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, model_config=AutoConfig.for_model("bart"))


def test_loader_and_trainer_refuse_data_the_model_cannot_embed(copy_spec, byt5, tmp_path):
    """Token ids past the model's embedding, or causal samples longer than GPT-2's position table, used to fail
    mid-run inside torch (``IndexError: index out of range in self``); the loader given ``model_config``, and the
    trainer for every loader, say so in one line when they are built, as ``dynabatch train`` does at start."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    data = MixtureData.load(copy_spec, byt5, "causal")
    small = dict(n_embd=32, n_layer=1, n_head=2)
    with pytest.raises(ValueError, match=rf"^the loader's data is tokenized with a vocabulary of {len(byt5)} tokens "
                                         r"but the 'gpt2' model's embedding has 300 rows; tokenize with the model's "
                                         r"own tokenizer \(load_tokenizer\(<model folder>\)\)$"):
        DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, hardware="cpu",
                            model_config=GPT2Config(vocab_size=300, **small))
    short = GPT2Config(vocab_size=len(byt5), n_positions=64, **small)
    with pytest.raises(ValueError, match=r"^the loader's LengthLimits max_seq_len is 192 tokens but this gpt2 model "
                                         r"has only 64 positions \(n_positions\); lower the limit to at most 64$"):
        DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, hardware="cpu", model_config=short)
    fits = LengthLimits("causal", max_seq_len=64)
    assert DynaBatchDataLoader(data, fits, token_budget=800, hardware="cpu", model_config=short).limits == fits
    # Without model_config (a cost model of its own) the loader cannot know the model: the trainer checks it.
    train = DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, cost_model=PolynomialCostModel())
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match=r"^train_loader's LengthLimits max_seq_len is 192 tokens but this gpt2 "
                                         r"model has only 64 positions"):
        DynaBatchTrainer(model=GPT2LMHeadModel(short), args=args, train_loader=train)
    fitting = DynaBatchDataLoader(data, fits, token_budget=800, cost_model=PolynomialCostModel())
    evaluation = DynaBatchDataLoader(data, fits, token_budget=800, cost_model=PolynomialCostModel(), each_row_once=True)
    with pytest.raises(ValueError, match=rf"^eval_loader\['qa'\]'s data is tokenized with a vocabulary of {len(byt5)} "
                                         r"tokens but the 'gpt2' model's embedding has 300 rows"):
        DynaBatchTrainer(model=GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, **small)), args=args,
                         train_loader=None, eval_loader={"qa": evaluation})
    DynaBatchTrainer(model=GPT2LMHeadModel(short), args=args, train_loader=fitting, eval_loader={"qa": evaluation})


def test_loader_and_trainer_warn_when_the_model_config_has_other_special_ids(copy_spec, byt5, tmp_path):
    """Training pads and ends samples with the tokenizer's ids; an HF model config built without them (GPT-2's
    defaults say EOS 50256) would then ``generate`` past the EOS it learnt. ``dynabatch train`` refuses such a pair;
    the loader given ``model_config``, and the trainer for every loader, warn once, naming the ids and the fix."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from dynabatch.data.tokenize import tokenizer_info
    from dynabatch.integrations.trainer import DynaBatchTrainer

    data = MixtureData.load(copy_spec, byt5, "causal")
    eos = tokenizer_info(byt5).eos_id
    other = GPT2Config(vocab_size=len(byt5), n_positions=256, n_embd=32, n_layer=1, n_head=2, eos_token_id=eos + 7)
    said = (rf"^the loader's data and the 'gpt2' model disagree on special ids \(eos_token_id {eos + 7} in the config, "
            rf"{eos} in the tokenizer\): training uses the tokenizer's, the model's generate\(\) the config's; set "
            rf"config\.eos_token_id = {eos}, or tokenize with the model's own tokenizer$")
    with pytest.warns(UserWarning, match=said):
        DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, hardware="cpu", model_config=other)
    train = DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, cost_model=PolynomialCostModel())
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True)
    with pytest.warns(UserWarning, match=r"^train_loader's data and the 'gpt2' model disagree on special ids"):
        DynaBatchTrainer(model=GPT2LMHeadModel(other), args=args, train_loader=train)
    agreeing = GPT2Config(**{**other.to_dict(), "eos_token_id": eos})
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, hardware="cpu", model_config=agreeing)
    assert not [w for w in caught if "special ids" in str(w.message)]


def test_trainer_refuses_label_smoothing_warns_of_sampling_arguments_and_names_a_missing_checkpoint(
        copy_spec, byt5, tmp_path):
    """``label_smoothing_factor`` was silently not applied (the loss is forward_loss's, not the Trainer's label
    smoother): one line refuses it. ``train_sampling_strategy`` and ``auto_find_batch_size`` did nothing without a
    word: a warning names what decides instead. Resuming from a path that is no folder said first that it had no
    loader position, then failed in Trainer: one line names the path."""
    with pytest.raises(ValueError, match=r"^label_smoothing_factor=0\.1: a DynaBatchTrainer trains on forward_loss's "
                                         r"summed token cross-entropy, without label smoothing; set "
                                         r"label_smoothing_factor=0$"):
        trainer_setup(copy_spec, byt5, "gpt2", tmp_path, label_smoothing_factor=0.1)
    with pytest.warns(UserWarning) as caught:
        trainer, _, _ = trainer_setup(copy_spec, byt5, "gpt2", tmp_path, max_steps=1, ignore_data_skip=True,
                                      train_sampling_strategy="group_by_length", auto_find_batch_size=True)
    messages = [str(w.message) for w in caught]
    assert ("TrainingArguments(train_sampling_strategy='group_by_length') has no effect on a DynaBatchTrainer: the "
            "loader's seed orders the rows and its method groups them into micro-batches (method='length_grouped' "
            "groups by length)") in messages
    assert any(m.startswith("TrainingArguments(auto_find_batch_size=True) has no effect on a DynaBatchTrainer: the "
                            "train loader's token_budget sizes each step") for m in messages)
    import warnings

    missing = str(tmp_path / "checkpoint-9")
    with warnings.catch_warnings(record=True) as said, pytest.raises(
            ValueError, match=rf"^resume_from_checkpoint='{missing}' is not a folder; pass a checkpoint-N folder or True"):
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=missing)
    assert not [w for w in said if "dynabatch_loader.json" in str(w.message)]


def test_trainer_warns_when_the_loader_prices_another_precision_or_attention_than_it_runs(copy_spec, byt5, tmp_path):
    """The loader's default cost model sizes micro-batches for its ``dtype`` and ``attention``; a trainer running
    ``bf16`` or ``attention="dense"`` against a loader priced for ``fp32`` / ``segments`` said nothing. One warning
    names both sides; a loader built to match, or one with a cost model of its own, is quiet."""
    import warnings

    from transformers import TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    data = MixtureData.load(copy_spec, byt5, "causal")
    model = build_model("gpt2-tiny", vocab_size=len(byt5))

    def said(args: dict, runs: str = "segments", **loader) -> list[str]:
        train = DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, **loader)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            DynaBatchTrainer(model=model, train_loader=train, attention=runs,
                             args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **args))
        return [str(w.message) for w in caught if "prices micro-batch memory" in str(w.message)]

    priced = dict(hardware="cpu", model_config=model.config)
    assert said({"bf16": True}, "dense", **priced) == [
        "train_loader prices micro-batch memory for dtype='fp32', attention='segments' but this trainer runs "
        "dtype='bf16', attention='dense' (TrainingArguments bf16/fp16, DynaBatchTrainer attention); build it with "
        "dtype='bf16', attention='dense'"]
    assert said({}, "dense", **priced) == [
        "train_loader prices micro-batch memory for attention='segments' but this trainer runs attention='dense' "
        "(TrainingArguments bf16/fp16, DynaBatchTrainer attention); build it with attention='dense'"]
    assert said({"bf16": True}, "dense", dtype="bf16", attention="dense", **priced) == []
    assert said({"bf16": True}, cost_model=PolynomialCostModel()) == []


def test_the_hf_trainer_example_says_in_one_line_what_it_cannot_run(tmp_path, monkeypatch, capsys):
    """examples/hf_trainer.py: ``--resume`` on a checkpoint of another ``--model`` ended in a traceback blaming
    changed data (or weights of other shapes), ``--steps 0`` and a ``--token-budget`` below one sample in
    tracebacks; each is now one line naming it, exit 2, before any data loads. The same model resumes."""
    import runpy

    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "hf_trainer.py")
    build_config("gpt2-tiny").save_pretrained(tmp_path / "checkpoint-3")
    checkpoint = tmp_path / "checkpoint-3"
    cases = {
        ("--model", "t5-tiny", "--output-dir", str(tmp_path), "--resume"):
            f"--resume: {checkpoint} holds another model than --model t5-tiny (a gpt2 model there, t5 for t5-tiny); "
            "pass the --model the run trained, or another --output-dir",
        ("--model", "gpt2-mini", "--output-dir", str(tmp_path), "--resume"):
            f"--resume: {checkpoint} holds another model than --model gpt2-mini (n_embd 64 there, 128 for gpt2-mini; "
            "n_layer 2 there, 4 for gpt2-mini; n_inner 256 there, 512 for gpt2-mini); pass the --model the run "
            "trained, or another --output-dir",
        ("--steps", "0"): "argument --steps: must be at least 1, got 0",
        ("--lr", "0"): "argument --lr: must be a finite number > 0, got 0",
        ("--token-budget", "100"): "--token-budget 100 cannot hold one maximal sample (320 tokens); pass at least 320",
    }
    _assert_one_line_errors(script, cases, monkeypatch, capsys)
    assert runpy.run_path(script)["check_resumable"](str(tmp_path), "gpt2-tiny") is None


def _assert_one_line_errors(script: str, cases: dict, monkeypatch, capsys) -> None:
    """Each ``argv -> expected`` of ``cases`` ends ``script`` (run as ``__main__``) in exit 2, without a traceback,
    with ``expected`` its only ``error:`` line."""
    import runpy
    import sys

    for argv, expected in cases.items():
        monkeypatch.setattr(sys, "argv", [script, *argv])
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(script, run_name="__main__")
        err = capsys.readouterr().err
        assert exited.value.code == 2 and "Traceback" not in err, err[-2000:]
        assert [line for line in err.splitlines() if "error:" in line] == [
            f"{os.path.basename(script)}: error: {expected}"]


def test_the_train_loop_example_says_in_one_line_what_it_cannot_run(monkeypatch, capsys):
    """examples/train_loop.py: ``--steps 0`` (or negative), ``--threads 0``, an ``--lr`` not above 0 (AdamW's
    ``Invalid learning rate``) and a ``--token-budget`` below one maximal sample ended in tracebacks (the loader's ``ValueError``, torch's ``set_num_threads``) after the data had loaded;
    it now checks them as examples/hf_trainer.py does (``dynabatch.integrations.example_args``)."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "train_loop.py")
    cases = {
        ("--steps", "0"): "argument --steps: must be at least 1, got 0",
        ("--steps", "-3"): "argument --steps: must be at least 1, got -3",
        ("--threads", "0"): "argument --threads: must be at least 1, got 0",
        ("--lr", "-0.003"): "argument --lr: must be a finite number > 0, got -0.003",
        ("--lr", "nan"): "argument --lr: must be a finite number > 0, got nan",
        ("--model", "gpt2-tiny", "--token-budget", "100"):
            "--token-budget 100 cannot hold one maximal sample (320 tokens); pass at least 320",
    }
    _assert_one_line_errors(script, cases, monkeypatch, capsys)


def test_the_engine_only_example_refuses_arguments_instead_of_ignoring_them():
    """examples/engine_only.py takes no arguments and ran its step ignoring any it was given: now one line, exit 2."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "engine_only.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, script, "--steps", "0"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert [line for line in done.stderr.splitlines() if "error:" in line] == [
        "engine_only.py: error: unrecognized arguments: --steps 0"]
    assert "rank 0" not in done.stdout  # no step ran


def test_trainer_warns_that_epoch_strategies_act_once_on_an_endless_loader(copy_spec, byt5, tmp_path):
    """With an endless train loader the Trainer runs one epoch of ``max_steps`` steps, so ``eval_strategy="epoch"``
    (or ``save_strategy``) evaluated only after the last step, without a word; a warning says so."""
    import warnings

    with pytest.warns(UserWarning) as caught:
        trainer, _, _ = trainer_setup(copy_spec, byt5, "gpt2", tmp_path, max_steps=2, eval_strategy="epoch")
    assert ("TrainingArguments(eval_strategy='epoch') with an endless train_loader: the run is one epoch, so it acts "
            "only after the last step; use eval_strategy='steps', or build the loader with max_steps=N (an epoch of "
            "N steps)") in [str(w.message) for w in caught]
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2]  # after the last step alone
    from dynabatch.integrations.trainer import DynaBatchTrainer

    epochs = DynaBatchDataLoader(trainer.train_loader.batcher.data, trainer.train_loader.limits, token_budget=800,
                                 cost_model=PolynomialCostModel(), max_steps=1)
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        DynaBatchTrainer(model=trainer.model, args=trainer.args, train_loader=epochs,
                         eval_loader=trainer.eval_dataset)
    assert not [w for w in quiet if "endless train_loader" in str(w.message)]


def test_an_endless_train_loader_without_max_steps_is_one_line_naming_both_ways(copy_spec, byt5, tmp_path):
    """TrainingArguments without ``max_steps`` on an endless train loader was Trainer's own "args.max_steps must be
    set to a positive value if dataloader does not have a length, was -1" from inside ``Trainer.train``; it is one
    line naming both fixes, before any step."""
    trainer, _, _ = trainer_setup(copy_spec, byt5, "gpt2", tmp_path, max_steps=-1)
    with pytest.raises(ValueError, match=r"^the train_loader is endless \(no max_steps\), so the run's length is "
                                         r"yours to set: pass TrainingArguments\(max_steps=N\), or build the loader "
                                         r"with max_steps=N"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_a_rotary_model_s_trained_positions_are_said_once_for_a_loader_and_its_trainer(copy_spec, byt5, tmp_path):
    """Above a rotary model's ``max_position_embeddings`` the loader built with the model's config warns; the trainer
    given that loader does not say it again (it checks loaders built without the model's config)."""
    import warnings

    from transformers import TrainingArguments

    from dynabatch.integrations.trainer import DynaBatchTrainer

    data = MixtureData.load(copy_spec, byt5, "causal")
    model = build_model("llama-tiny", vocab_size=len(byt5))
    model.config.max_position_embeddings = 64
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train = DynaBatchDataLoader(data, limits_for("causal"), token_budget=800, hardware="cpu",
                                    model_config=model.config)
        DynaBatchTrainer(model=model, train_loader=train,
                         args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    assert [str(w.message) for w in caught if "max_position_embeddings" in str(w.message)] == [
        "the loader's LengthLimits max_seq_len is 192 tokens but this llama model was trained for 64 positions "
        "(max_position_embeddings); longer samples use untrained rotary positions"]


def test_replicas_each_get_a_sample_of_every_global_batch_or_the_loader_says_so_at_build(byt5):
    """With replicas, a token budget under one maximal sample per replica is refused at build, as ``dynabatch train``
    refuses ``--global-batch-tokens`` (a global batch of long samples failed mid-run in the planner: "need 1 <=
    num_replicas <= number of samples"); an ``each_row_once`` loader's last global batch takes rows from the one
    before it so that every replica gets one (an eval set of 4 rows of 3 a batch failed on its last, lone row),
    and data with fewer rows than replicas is refused at build."""
    import datasets

    limits = LengthLimits("causal", max_seq_len=16)
    rows = datasets.Dataset.from_dict({"q": ["abcd"] * 4, "a": ["efgh"] * 4})  # 10 tokens each: 3 to a batch of 32
    options = dict(tokenizer=byt5, columns={"inputs": "q", "targets": "a"}, cost_model=PolynomialCostModel(),
                   num_replicas=2)
    with pytest.raises(ValueError, match=r"^token_budget 31 holds less than one maximal sample \(max_seq_len=16, 16 "
                                         r"tokens\) per replica \(2\): .* raise it to at least 32"):
        DynaBatchDataLoader(rows, limits, token_budget=31, **options)
    alone = DynaBatchDataLoader(rows, limits, token_budget=32, each_row_once=True, cost_model=PolynomialCostModel(),
                                tokenizer=byt5, columns=options["columns"])
    assert [len(s.batch) for s in alone] == [3, 1]
    loaders = [DynaBatchDataLoader(rows, limits, token_budget=32, each_row_once=True, replica_index=r, **options)
               for r in range(2)]
    for s0, s1 in zip(*loaders):
        assert len(s0.batch) == 2 and s0.batch.num_tokens <= 32
        assert sorted(step_sample_ids(s0) + step_sample_ids(s1)) == [0, 1] and step_sample_ids(s0)
    with pytest.raises(ValueError, match=r"^the evaluation data has 1 rows, fewer than the 2 data-parallel replicas"):
        DynaBatchDataLoader(rows.select([0]), limits, token_budget=32, each_row_once=True, **options)
