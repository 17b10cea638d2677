"""Evaluation through a gloo pipeline (T5 2 stages; GPT-2 2 stages x 2 replicas) equals the unsplit model.

One launch of 4 processes. Each scenario evaluates (forward-only plans, :mod:`dynabatch.training.evaluate`)
before training, trains a step, evaluates again, gathers the model on rank 0 and trains another step; a
twin run trains the same two steps without evaluating. The parent checks: per-task and overall eval loss
equal the unsplit HF model's on the same samples (1e-5), the gathered weights equal the initial model's,
the gathered model's loss after a step equals the pipeline's eval loss then, and the training losses with
evaluation are bitwise those without.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import pipeline_harness as H

SCENARIOS = [H.Scenario("eval-t5", "t5", "t5-tiny", 2), H.Scenario("eval-gpt2", "gpt2", "gpt2-tiny", 2, 2)]


def eval_samples(family: str):
    rng = np.random.default_rng(11)
    samples = [H._sample(rng) for _ in range(14)]
    import dataclasses

    return [dataclasses.replace(s, task=f"task{k % 3}") for k, s in enumerate(samples)]


def eval_set(sc: H.Scenario):
    from dynabatch.data.batching import LengthLimits
    from dynabatch.data.tokenize import TokenizerInfo
    from dynabatch.models.presets import EOS_ID, PAD_ID
    from dynabatch.training.evaluate import build_eval_set

    limits = LengthLimits(sc.family, max_input_len=32, max_target_len=16, max_seq_len=48)
    tokens = TokenizerInfo(pad_id=PAD_ID, eos_id=EOS_ID, decoder_start_id=PAD_ID, vocab_size=H.VOCAB)
    return build_eval_set(eval_samples(sc.family), limits, tokens, max_tokens=60, num_replicas=sc.num_replicas)


def run(rank: int, sc: H.Scenario, workdir: str, evaluate: bool) -> None:
    from dynabatch.models.split import build_stage, layout_for, pipeline_spec_for
    from dynabatch.engine.dist import init_distributed, shutdown
    from dynabatch.training.evaluate import gather_weights
    from dynabatch.engine.executor import Executor
    from dynabatch.engine.step import train_step
    from dynabatch.training.trainer import gather_task_losses

    if rank >= sc.world_size:
        return
    tag = "eval" if evaluate else "plain"
    ctx = init_distributed(sc.num_stages, sc.num_replicas, rank=rank, world_size=sc.world_size,
                           init_method=f"file://{workdir}/{sc.name}-{tag}.init", timeout_s=sc.timeout_s)
    model = H.make_model(sc)
    layout = layout_for(model, sc.num_stages)
    spec = pipeline_spec_for(model, layout, "float32")
    stage = build_stage(model, layout, ctx.stage_index)
    opt, sched = H.make_optimizer(stage.parameters(), 2)
    ex = Executor(stage, ctx, opt, scheduler=sched, dropout_seed=0)
    es = eval_set(sc) if ctx.is_planner else None
    record: dict = {"train_loss": [], "eval": []}

    def evaluation():
        result = train_step(ex, ctx, 100, es.replica_micro_batches if es else None, spec=spec, policy="gpipe",
                            forward_only=True)
        record["eval"].append({"loss": result.loss, "task_loss": gather_task_losses(ctx, result, es)})
        assert stage.training  # the executor restored the stage's mode

    for step in range(2):
        if evaluate:
            evaluation()
        mbs = H.plain_step(sc, step)[0] if ctx.is_planner else None
        record["train_loss"].append(train_step(ex, ctx, step, mbs, spec=spec, policy=sc.policy).loss)
        if evaluate and step == 0:
            record["gathered"] = gather_weights(ctx, stage)
    if ctx.is_planner:
        torch.save(record, os.path.join(workdir, f"{sc.name}-{tag}.pt"))
    shutdown()


def worker(rank: int, workdir: str) -> None:
    H._setup_worker()
    try:
        for sc in SCENARIOS:
            for evaluate in (True, False):
                run(rank, sc, workdir, evaluate)
    except BaseException as e:  # noqa: BLE001
        H._report_failure(workdir, rank, e)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("eval"))
    codes, elapsed = H.launch(4, worker, (workdir,), deadline_s=300)
    assert codes == [0] * 4, f"exit codes {codes} after {elapsed:.0f} s\n{H.failures(workdir, 4)}"
    return {(sc.name, tag): torch.load(os.path.join(workdir, f"{sc.name}-{tag}.pt"), weights_only=False)
            for sc in SCENARIOS for tag in ("eval", "plain")}


def unsplit_loss(model, es) -> dict:
    """Per task and overall summed token loss / loss tokens of the unsplit model over the eval micro-batches."""
    from dynabatch.models.forward import forward_loss
    from dynabatch.models.stage import segment_losses

    sums: dict[str, list[float]] = {}
    model.eval()
    with torch.no_grad():
        for mbs in es.replica_micro_batches:
            for mb in mbs:
                out = forward_loss(model, mb)
                causal = hasattr(mb, "target_ids")
                seg = segment_losses(out.token_losses, mb.target_ids if causal else mb.labels,
                                     mb.segment_ids if causal else mb.decoder_segment_ids)
                for r, ids in enumerate(mb.sample_ids):
                    for k, i in enumerate(ids):
                        acc = sums.setdefault(es.batch.samples[i].task, [0.0, 0.0])
                        acc[0] += float(seg[r, k, 0])
                        acc[1] += float(seg[r, k, 1])
    total = [sum(v[0] for v in sums.values()), sum(v[1] for v in sums.values())]
    return {"loss": total[0] / total[1], "task_loss": {t: s / n for t, (s, n) in sorted(sums.items())}}


def _close(got: dict, want: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["task_loss"].keys() == want["task_loss"].keys() == {"task0", "task1", "task2"}
    for t in want["task_loss"]:
        assert got["task_loss"][t] == pytest.approx(want["task_loss"][t], rel=1e-5), t


@pytest.mark.parametrize("sc", SCENARIOS, ids=[sc.name for sc in SCENARIOS])
def test_pipeline_eval_loss_equals_the_unsplit_model(results, sc):
    got = results[(sc.name, "eval")]
    model = H.make_model(sc)
    _close(got["eval"][0], unsplit_loss(model, eval_set(sc)))
    params = dict(model.named_parameters())
    assert got["gathered"].keys() == params.keys()


@pytest.mark.parametrize("sc", SCENARIOS, ids=[sc.name for sc in SCENARIOS])
def test_gathered_model_after_a_step_gives_the_pipeline_eval_loss(results, sc):
    from dynabatch.training.evaluate import load_weights

    got = results[(sc.name, "eval")]
    model = H.make_model(sc)
    load_weights(model, got["gathered"])
    _close(got["eval"][1], unsplit_loss(model, eval_set(sc)))
    assert got["eval"][1]["loss"] != got["eval"][0]["loss"]


@pytest.mark.parametrize("sc", SCENARIOS, ids=[sc.name for sc in SCENARIOS])
def test_evaluation_does_not_change_training(results, sc):
    assert results[(sc.name, "eval")]["train_loss"] == results[(sc.name, "plain")]["train_loss"]
