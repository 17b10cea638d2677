"""Token slices (TeraPipe) outside the process group: chains, schedules, plans, masks, one stage, planner.

The multi-process equality with the unsliced model is tests/dist/test_token_slicing.py; here the
pieces it rests on are checked one by one and fast: slice links and their errors, every policy's
schedules respect chains (and lower to plans the validator accepts), the validator catches a plan that
runs a chain out of order, plans keep their links through text and binary, the context mask equals
the unsliced mask's rows, one GPT-2 stage fed slices reproduces the unsliced gradients (sdpa and eager;
dropping the carried key/value gradient does not), and the trainer's planner turns planned slices into
micro-batches that put the sample back together.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dynabatch.data.collate import collate_causal
from dynabatch.data.microbatch import token_slices
from dynabatch.data.sample import TokenizedSample
from dynabatch.models.forward import causal_segment_mask, forward_loss
from dynabatch.models.presets import PAD_ID, build_model
from dynabatch.models.slice_kv import SliceRecord
from dynabatch.models.split import build_stage, layout_for, micro_batch_inputs, pipeline_spec_for
from dynabatch.schedule.step import lower_step as plan_step, token_costs
from dynabatch.schedule.chains import backward_order, chain_order, chains, check_links, check_schedule, links_for
from dynabatch.schedule.ir import ExecutionPlan, PipelineSpec
from dynabatch.schedule.lower import lower
from dynabatch.schedule.policies import adaptive, choose_schedule, gpipe, one_f_one_b
from dynabatch.schedule.simulate import simulate
from dynabatch.schedule.validate import validate


# ------------------------------------------------------------------------------------------ links


def test_links_for_and_chains():
    links = links_for([1, 3, 1, 2])
    assert links == (-1, -1, 1, 2, -1, -1, 5)
    assert chains(links) == [[1, 2, 3], [5, 6]]
    assert chain_order([4, 3, 0, 6, 2, 5, 1], links) == [4, 1, 2, 3, 0, 5, 6]
    assert backward_order([0, 1, 2, 3, 4, 5, 6], links) == [0, 3, 2, 1, 4, 6, 5]


@pytest.mark.parametrize(
    "links, message",
    [
        ((-1, 0), "one entry per micro-batch"),
        ((-1, 5, -1), "must be -1 or another micro-batch"),
        ((-1, 1, -1), "must be -1 or another micro-batch"),
        ((-1, 0, 0), "both extend slice 0"),
        ((1, 2, 0), "cycle"),
    ],
)
def test_bad_links_are_clear_errors(links, message):
    with pytest.raises(ValueError, match=message):
        check_links(links, 3)


def _random_links(rng, num_mb: int) -> tuple[int, ...]:
    links, perm, i = [-1] * num_mb, rng.permutation(num_mb).tolist(), 0
    while i < num_mb:
        chain = perm[i : i + int(rng.integers(1, 6))]
        for a, b in zip(chain, chain[1:]):
            links[b] = a
        i += len(chain)
    return tuple(links)


def test_every_policy_respects_chains_and_lowers_to_valid_plans():
    rng = np.random.default_rng(0)
    for _ in range(40):
        num_mb, num_stages = int(rng.integers(1, 12)), int(rng.integers(1, 5))
        links = _random_links(rng, num_mb)
        shapes = np.column_stack([np.ones(num_mb, int), rng.integers(1, 200, num_mb), np.zeros(num_mb, int)])
        costs = token_costs(shapes, num_stages)
        spec = PipelineSpec.gpt(num_stages, 8, "float32")
        for schedule in (
            gpipe(num_mb, num_stages, links=links),
            one_f_one_b(num_mb, num_stages, links=links),
            adaptive(costs, links=links),
            adaptive(costs, 3e5, links=links, in_flight_slack=0, lookahead=3),
            choose_schedule(costs, 3e5, links=links)[0],
        ):
            check_schedule(schedule, links)
            assert simulate(schedule, costs).makespan_s > 0
            plans = lower(schedule, shapes, spec, fwd_s=costs.fwd_s, bwd_s=costs.bwd_s, links=links)
            assert all(p.slice_links == links for p in plans.values())


def test_one_f_one_b_without_slices_is_unchanged():
    assert str(one_f_one_b(3, 2)) == "F0 F1 B0 F2 B1 B2\nF0 B0 F1 B1 F2 B2"
    assert str(one_f_one_b(3, 2, links=(-1, 0, -1))) != str(one_f_one_b(3, 2))


def test_a_schedule_that_breaks_a_chain_is_rejected():
    with pytest.raises(ValueError, match="B0 runs before B1"):
        check_schedule(gpipe(2, 2), (-1, 0))  # plain GPipe runs B0 first
    with pytest.raises(ValueError, match="F1 runs before F0"):
        check_schedule(gpipe(2, 2, order=[1, 0]), (-1, 0))
    assert str(gpipe(2, 2, order=[1, 0], links=(-1, 0))).split("\n")[0] == "F0 F1 B1 B0"


def test_validator_catches_a_plan_that_runs_a_chain_out_of_order():
    spec = PipelineSpec.gpt(2, 8, "float32")
    plans = lower(gpipe(3, 2), [[1, 4, 0]] * 3, spec)  # B0 B1 B2: fine for ordinary micro-batches
    assert validate(plans).ok
    sliced = {r: dataclasses.replace(p, slice_links=(-1, 0, -1)) for r, p in plans.items()}
    report = validate(sliced)
    assert not report.ok and "token slice backward before B1" in str(report)


def test_plans_keep_their_links_through_text_and_bytes():
    links = (-1, 0, 1, -1)
    plans = plan_step([[(1, 5, 0), (1, 3, 0), (1, 2, 0), (2, 4, 0)]], PipelineSpec.gpt(2, 8, "float32"),
                      policy="1f1b", slice_links=[links])
    for plan in plans.values():
        assert plan.slice_links == links
        assert ExecutionPlan.from_text(plan.to_text()) == plan
        assert ExecutionPlan.from_bytes(plan.to_bytes()) == plan


# ------------------------------------------------------------------------------------------ model


def test_context_mask_is_the_unsliced_masks_rows():
    seg = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0, 0]])
    full = causal_segment_mask(seg)
    for lo, hi in ((0, 4), (4, 5), (5, 9), (2, 7)):
        part = causal_segment_mask(seg[:, lo:hi], context_segment_ids=seg[:, :lo])
        real = (seg[:, lo:hi] > 0)[:, None, :, None]  # pad queries see other keys in each; unused
        torch.testing.assert_close(torch.where(real, part, 0.0), torch.where(real, full[:, :, lo:hi, :hi], 0.0))


def test_token_slices_cut_columns_and_reject_bad_bounds():
    rng = np.random.default_rng(0)
    samples = [TokenizedSample("t", rng.integers(3, 99, n).astype(np.int32), rng.integers(3, 99, 3).astype(np.int32))
               for n in (9, 4)]
    mb = collate_causal(samples, [[0], [1]], pad_id=PAD_ID)
    parts = token_slices(mb, [0, 1, 7, mb.shape[1]])
    assert [p.shape for p in parts] == [(2, 1), (2, 6), (2, mb.shape[1] - 7)]
    assert torch.equal(torch.cat([p.position_ids for p in parts], 1), mb.position_ids)
    assert sum(p.num_loss_tokens for p in parts) == mb.num_loss_tokens
    for bounds in ([0, 5], [1, mb.shape[1]], [0, 3, 3, mb.shape[1]]):
        with pytest.raises(ValueError, match="slice bounds"):
            token_slices(mb, bounds)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_stage_fed_slices_reproduces_the_unsliced_gradients(attention):
    rng = np.random.default_rng(1)
    samples = [TokenizedSample("t", rng.integers(3, 500, n).astype(np.int32), rng.integers(3, 500, m).astype(np.int32))
               for n, m in ((20, 7), (9, 4), (13, 3))]
    model = build_model("gpt2-tiny", vocab_size=512, dropout=0.0, seed=0).train()
    model.config._attn_implementation = attention
    mb = collate_causal(samples, [[0], [1, 2]], pad_id=PAD_ID)  # a padded row and a packed row
    want_loss = forward_loss(model, mb).loss_sum
    want_loss.backward()
    layout = layout_for(model, 1)
    spec, stage = pipeline_spec_for(model, layout), build_stage(model, layout, 0)
    names = stage.original_names()
    want = {names[n]: dict(model.named_parameters())[names[n]].grad for n, _ in stage.named_parameters()}

    def run(drop: bool) -> tuple[float, float]:
        stage.zero_grad(set_to_none=True)
        outs, context = [], None
        for piece in token_slices(mb, [0, 1, 5, 6, 17, mb.shape[1]]):
            out = stage({}, micro_batch_inputs(piece, spec, 0), context, sliced=True)
            context = out.slice_record.extend()
            outs.append(out)
        carried = None
        for out in reversed(outs):
            extra, grads = out.slice_record.backward_roots(None if drop else carried)
            torch.autograd.backward([out.loss_sum, *extra], [None, *grads])
            carried = out.slice_record.context_grads(carried)
        loss = sum(float(o.loss_sum.detach()) for o in outs)
        err = max(float((p.grad - want[names[n]]).abs().max()) for n, p in stage.named_parameters())
        return loss, err

    loss, err = run(drop=False)
    assert loss == pytest.approx(float(want_loss.detach()), rel=1e-5) and err < 1e-5
    _, dropped_err = run(drop=True)
    assert dropped_err > 1e-2


def test_a_slice_record_rejects_a_carried_gradient_of_the_wrong_size():
    model = build_model("gpt2-tiny", vocab_size=64, dropout=0.0, seed=0)
    layout = layout_for(model, 1)
    stage, spec = build_stage(model, layout, 0), pipeline_spec_for(model, layout)
    mb = collate_causal([TokenizedSample("t", np.arange(3, 9, dtype=np.int32), np.arange(3, 5, dtype=np.int32))],
                        [[0]], pad_id=PAD_ID)
    first, second = token_slices(mb, [0, 3, mb.shape[1]])
    out = stage({}, micro_batch_inputs(first, spec, 0), None, sliced=True)
    later = stage({}, micro_batch_inputs(second, spec, 0), out.slice_record.extend(), sliced=True)
    later_grads = later.slice_record.context_grads(None)
    assert later_grads is not None and later_grads.keys[0].shape[2] == 3
    wrong = dataclasses.replace(later_grads, keys=[k[:, :, :2] for k in later_grads.keys])
    with pytest.raises(ValueError, match="does not match"):
        out.slice_record.backward_roots(wrong)
    assert isinstance(out.slice_record, SliceRecord)


# ------------------------------------------------------------------------------------------ planner


def _slicing_planner(toy_data, preset: str, memory_gib: float, placement: str = "linear"):
    """The trainer's planner with ``--slice-long`` on 2 devices over the toy data (2,048-token batches, inputs up to
    512 tokens), and the chunk layout it plans for."""
    from dynabatch.training.config import TrainConfig
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model
    from dynabatch.schedule.placement import Placement

    cfg = TrainConfig(model=preset, stages=2, global_batch_tokens=2048, max_input_len=512, slice_long=True,
                      memory_gib=memory_gib, placement=placement)
    model = build_model(preset, vocab_size=toy_data.tokens.vocab_size)
    chunks = Placement.parse(placement, 2)
    layout = layout_for(model, chunks.num_stages, chunks)
    limits = LengthLimits("gpt2", max_input_len=512, max_target_len=128, max_seq_len=512)
    planner = StepPlanner(GlobalBatcher(toy_data, limits, token_budget=2048), cfg,
                          planner_cost_model(cfg, model.config, layout), toy_data.tokens)
    return planner, pipeline_spec_for(model, layout, "float32"), chunks


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
def test_the_trainers_planner_turns_planned_slices_into_chains(toy_data):
    planner, _, _ = _slicing_planner(toy_data, "gpt2-tiny", 0.012)  # the longest samples do not fit whole, recomputed or not
    sliced = 0
    for _ in range(6):
        step = planner()
        sliced += step.num_sliced_samples
        links = step.slice_links[0]
        mbs = step.replica_micro_batches[0]
        check_schedule(step.schedules[0], links)
        for chain in chains(links):
            (i,), = mbs[chain[0]].sample_ids
            sample = step.batch.samples[i]
            whole = collate_causal(step.batch.samples, [[i]], toy_data.tokens.pad_id)
            assert torch.equal(torch.cat([mbs[m].input_ids for m in chain], 1), whole.input_ids)
            assert sum(mbs[m].shape[1] for m in chain) == sample.num_tokens
            later = chain[-1]  # attends to its context too: priced above an unsliced sample of its length
            unsliced = planner.cost_model.per_stage(np.ones(1), np.array([float(mbs[later].shape[1])]), np.zeros(1))
            assert np.all(step.costs[0].fwd_s[:, later] > unsliced.fwd_s[:, 0])
        seen = sorted(i for mb in mbs for row in mb.sample_ids for i in row)
        assert sorted(set(seen)) == list(range(len(step.batch)))
    assert sliced > 0


@pytest.mark.parametrize("toy_data", ["gpt2"], indirect=True)
def test_the_planner_orders_slices_on_virtual_stages_and_the_plans_validate(toy_data):
    """``--slice-long`` with ``--placement interleaved:2``: each step's device orders keep every chain on every chunk
    (a slice's forward after its previous slice's, its backward before it), and the step lowers onto the two
    devices' four chunks into plans that validate, the chains checked on the instructions."""
    from dynabatch.engine.step import micro_batch_shape

    planner, spec, placement = _slicing_planner(toy_data, "gpt2-mini", 0.03, "interleaved:2")
    sliced = 0
    for _ in range(4):
        step = planner()
        sliced += step.num_sliced_samples
        (links,), (schedule,) = step.slice_links, step.schedules
        check_schedule(schedule, links)
        assert schedule.device_orders and len(schedule.device_orders) == 2
        shapes = [[micro_batch_shape(mb) for mb in step.replica_micro_batches[0]]]
        plans = plan_step(shapes, spec, step=step.step, costs=step.costs, schedules=step.schedules,
                          slice_links=step.slice_links, placement=placement)
        assert sorted(plans) == [0, 1] and validate(plans).ok
    assert sliced > 0


def test_training_with_slices_takes_the_same_steps_as_without(tmp_path, toy_mixture_dir, capsys):
    """`dynabatch train --slice-long --recompute none`: with 0.015 GiB the longest samples must run sliced, with
    0.03 GiB none is; the batches are the same, so the losses of every step must be too (Adam steps included).
    (Under `--recompute auto` or `full` these samples fit whole, recomputed, at every budget where the run can
    go, since attention memory is priced as the fused kernels keep it; slices under `full` are checked against
    the unsliced model in test_recompute.py. At 0.0135-0.0145 GiB the slicing DP's bound, which omits the
    key/value gradients later slices hand back, plans a step over the device once model states count, and the
    training validator refuses it.)"""
    import json
    import os

    from dynabatch.cli import main

    def train(memory: str, *extra: str) -> list[dict]:  # in-process (a world of one): no subprocess imports
        out = tmp_path / (memory + "".join(extra))
        code = main(["train", "--model", "gpt2-tiny", "--tokenizer", "byt5",
                     "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--global-batch-tokens", "2048",
                     "--max-input-len", "512", "--steps", "3", "--slice-long", "--memory-gib", memory,
                     "--output-dir", str(out), "--log-every", "0", "--no-timeline", *extra])
        assert code == 0, capsys.readouterr().err[-2000:]
        return [json.loads(line) for line in open(out / "metrics.jsonl")]

    sliced, whole = train("0.015", "--recompute", "none"), train("0.03")
    assert sum(r["sliced_samples"] for r in sliced) > 0 and sum(r["sliced_samples"] for r in whole) == 0
    np.testing.assert_allclose([r["loss"] for r in sliced], [r["loss"] for r in whole], rtol=1e-6)


def test_bubble_slicing_is_kept_only_when_the_simulated_step_is_faster():
    """GPT-1.3B on 8 A100-80GB stages: two 4,000-token samples among short ones. In a small global batch
    they dominate the bubble and slicing them shortens the simulated step; among 600 short samples the
    bubble is amortised, so the planner keeps them whole. Slices are priced as their causal share of the whole
    sample (``attention="causal"``), so slicing saves no compute and only the bubble decides (with ``dense``
    pricing an eager kernel's slices skip part of the square, and the planner rightly keeps them for that)."""
    from dynabatch.cost.analytic import AnalyticCostModel
    from dynabatch.cost.hardware import hardware_spec
    from dynabatch.cost.model_specs import model_spec
    from dynabatch.cost.stages import StageCostModel
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.plan.slice_costs import AnalyticSliceCostModel
    from dynabatch.plan.step import plan_step as plan_batch
    from dynabatch.training.step_score import simulated_step_time

    model = AnalyticCostModel(model_spec("gpt-1.3b"), hardware_spec("a100-80gb"))
    stages = StageCostModel(model, balanced_layout(model, 8, ref_shape=(1, 4096, 0)), model.hardware.memory_bytes)
    slicer = AnalyticSliceCostModel.from_stage_model(stages, ref_length=4096, attention="causal")
    score = simulated_step_time(stages, slicer, model.hardware.memory_bytes)
    rng = np.random.default_rng(0)
    for num_short, expect_sliced in ((30, True), (600, False)):
        lens = np.concatenate([[4000, 3900], rng.integers(100, 300, num_short)])
        e, d = lens - lens // 8, lens // 8
        whole = plan_batch(e, d, stages, 8, family="gpt2")
        sliced = plan_batch(e, d, stages, 8, family="gpt2", slice_cost_model=slicer, score=score)
        assert bool(sliced.sliced_samples) == expect_sliced
        assert score(sliced) <= score(whole)
        if expect_sliced:
            assert set(sliced.sliced_samples) == {0, 1} and score(sliced) < 0.95 * score(whole)


def test_slice_long_config_errors_are_clear():
    from dynabatch.training.config import TrainConfig

    with pytest.raises(ValueError, match="slice_long plans token slices with the dynamic planner"):
        TrainConfig(model="gpt2-tiny", slice_long=True, method="packing")
    with pytest.raises(ValueError, match="drop cost_profile or slice_long"):
        TrainConfig(model="gpt2-tiny", slice_long=True, cost_profile="profile.json")
