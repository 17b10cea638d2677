"""Runtime pieces that need at most a one-rank world: world-size checks, plan delivery packing,
the executor's opcode table and error wrapping, and a whole step on a one-stage pipeline."""

from __future__ import annotations

import pytest
import torch

import pipeline_harness as H
from dynabatch.engine import executor as executor_module
from dynabatch.engine.delivery import StepInputs, pack, unpack
from dynabatch.engine.dist import PipelineError, check_world, init_distributed, shutdown
from dynabatch.engine.executor import HANDLERS, Executor
from dynabatch.engine.step import layout_payloads, micro_batch_shape, own_inputs, step_payloads, train_step
from dynabatch.schedule.step import lower_step as plan_step
from dynabatch.schedule.ir import Op, PipelineSpec


def test_world_size_must_factor():
    assert check_world(8, 4, None) == 2
    assert check_world(8, 4, 2) == 2
    with pytest.raises(ValueError, match=r"world size 6 != num_stages 4 x num_replicas 2 \(= 8\)"):
        check_world(6, 4, 2)
    with pytest.raises(ValueError, match="world size 6 is not a multiple of num_stages 4"):
        check_world(6, 4, None)
    with pytest.raises(ValueError, match="world size 3 != num_stages 2 x num_replicas 2"):
        init_distributed(2, 2, rank=0, world_size=3, init_method="file:///nonexistent/never-used")


def test_every_opcode_has_a_handler():
    assert set(HANDLERS) == set(Op)


@pytest.mark.parametrize("family, num_stages", [("gpt2", 2), ("t5", 4)])
def test_delivery_packs_only_the_stage_inputs(family, num_stages):
    _, mbs = H.step_batch(family, seed=0, step=0)
    spec = (PipelineSpec.gpt(num_stages, 64, "float32") if family == "gpt2"
            else PipelineSpec.t5(2, num_stages - 2, 64, "float32"))
    replicas = H.split_replicas(mbs, 2)
    plans = plan_step([[micro_batch_shape(mb) for mb in r] for r in replicas], spec, policy="1f1b", step=7)
    payloads = step_payloads(plans, replicas, spec)
    tokens = sum(mb.num_loss_tokens for mb in mbs)
    for rank, inputs in payloads.items():
        header, message = pack(inputs)
        got = unpack(header, message)
        assert got.plan == inputs.plan and got.global_loss_tokens == tokens
        assert got.loaded.keys() == inputs.loaded.keys()
        for m, tensors in inputs.loaded.items():
            stage = inputs.plan.stage
            b, e, d = micro_batch_shape(replicas[inputs.plan.replica_index][m])
            assert sorted(got.loaded[m]) == sorted(t.name for t in spec.load_tensors(stage, b, e, d))
            for name, t in tensors.items():
                assert torch.equal(got.loaded[m][name], t)
    # a middle GPT stage gets segment ids only, the last no token ids
    if family == "gpt2":
        assert sorted(payloads[1].loaded[0]) == ["labels", "segment_ids"]
        assert sorted(payloads[0].loaded[0]) == ["input_ids", "position_ids", "segment_ids"]


def test_a_layout_travels_instead_of_tensors_and_each_rank_collates_its_own():
    """With layouts, a rank's message is its plan and its replica's layout, no tensor; the rank's own collate makes
    exactly the tensors rank 0 would have delivered; a rank given no collate says so."""
    _, mbs = H.step_batch("gpt2", seed=0, step=0)
    spec = PipelineSpec.gpt(2, 64, "float32")
    replicas = H.split_replicas(mbs, 2)
    plans = plan_step([[micro_batch_shape(mb) for mb in r] for r in replicas], spec, policy="1f1b", step=3)
    tokens = sum(mb.num_loss_tokens for mb in mbs)
    delivered = step_payloads(plans, replicas, spec)
    layouts = [b"replica 0", b"replica one"]
    collated = []
    for rank, inputs in layout_payloads(plans, layouts, tokens).items():
        header, message = pack(inputs)
        plan_bytes = len(inputs.plan.to_bytes())
        assert len(message) < plan_bytes + len(inputs.layout) + 16  # the plan, the layout, alignment: no tensor
        assert len(pack(delivered[rank])[1]) > len(message) + 64  # what the tensors weighed
        got = unpack(header, message)
        assert got.plan == inputs.plan and got.layout == layouts[inputs.plan.replica_index] and got.loaded == {}
        own = own_inputs(got, spec, lambda layout: collated.append(layout) or replicas[layouts.index(layout)])
        assert own.global_loss_tokens == tokens and own.loaded.keys() == delivered[rank].loaded.keys()
        for m, tensors in delivered[rank].loaded.items():
            assert own.loaded[m].keys() == tensors.keys()
            assert all(torch.equal(own.loaded[m][k], t) for k, t in tensors.items())
        with pytest.raises(PipelineError, match="sent a layout of the micro-batches, but this rank was given no"):
            own_inputs(got, spec, None)
    assert sorted(collated) == sorted(layouts * 2)  # each rank collated its replica's, once
    assert own_inputs(delivered[0], spec, None) is delivered[0]  # tensors delivered: nothing to collate


def test_delivery_rejects_a_wrong_shape():
    _, mbs = H.step_batch("gpt2", seed=0, step=0)
    spec = PipelineSpec.gpt(2, 64, "float32")
    plans = plan_step([[micro_batch_shape(mb) for mb in mbs]], spec, policy="gpipe")
    inputs = step_payloads(plans, [mbs], spec)[0]
    bad = dict(inputs.loaded)
    bad[0] = {**bad[0], "input_ids": bad[0]["input_ids"][:, :-1]}
    with pytest.raises(ValueError, match="micro-batch 0 tensor input_ids has shape"):
        pack(StepInputs(inputs.plan, bad, inputs.global_loss_tokens))


@pytest.fixture
def one_rank_world(tmp_path):
    ctx = init_distributed(1, 1, rank=0, world_size=1, init_method=f"file://{tmp_path}/init", timeout_s=30)
    try:
        yield ctx
    finally:
        shutdown()


def _one_stage(ctx, sc):
    from dynabatch.models.split import build_stage, layout_for, pipeline_spec_for

    model = H.make_model(sc)
    layout = layout_for(model, 1)
    stage = build_stage(model, layout, 0)
    opt, sched = H.make_optimizer(stage.parameters(), sc.num_steps)
    return Executor(stage, ctx, opt, scheduler=sched), pipeline_spec_for(model, layout, "float32"), stage


def test_one_stage_step_matches_reference_and_records_a_timeline(one_rank_world):
    sc = H.Scenario("one-stage", "gpt2", "gpt2-tiny", 1, policy="gpipe")
    ex, spec, stage = _one_stage(one_rank_world, sc)
    _, mbs = H.step_batch(sc.family, sc.seed, 0)
    result = train_step(ex, one_rank_world, 0, [mbs], spec=spec, policy="gpipe")
    want = H.reference_run(sc)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, want["grads"][0][stage.parameter_map[name]])
    assert result.loss == pytest.approx(want["loss"][0], rel=1e-6)
    # LOAD, F per micro-batch; B and FREE per micro-batch; REDUCE; STEP
    keys = [k for k, _, _ in result.timeline]
    assert len(keys) == 4 * len(mbs) + 2 and keys[-2:] == ["0REDUCE", "0STEP"]
    assert all(t0 <= t1 for _, t0, t1 in result.timeline)


def test_a_step_from_a_layout_trains_as_from_micro_batches(one_rank_world):
    sc = H.Scenario("one-stage", "gpt2", "gpt2-tiny", 1, policy="gpipe")
    ex, spec, stage = _one_stage(one_rank_world, sc)
    _, mbs = H.step_batch(sc.family, sc.seed, 0)
    plans = plan_step([[micro_batch_shape(mb) for mb in mbs]], spec, policy="gpipe", step=0)
    result = train_step(ex, one_rank_world, 0, spec=spec, plans=plans, replica_layouts=[b"the step"],
                        global_loss_tokens=sum(mb.num_loss_tokens for mb in mbs),
                        collate=lambda layout: mbs if layout == b"the step" else None)
    want = H.reference_run(sc)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, want["grads"][0][stage.parameter_map[name]])
    assert result.loss == pytest.approx(want["loss"][0], rel=1e-6)
    with pytest.raises(ValueError, match="with replica_layouts needs one per replica, plans and global_loss_tokens"):
        train_step(ex, one_rank_world, 1, spec=spec, replica_layouts=[b"the step"], collate=lambda _: mbs)


def test_unknown_opcode_and_failing_instruction_are_named(one_rank_world, monkeypatch):
    sc = H.Scenario("one-stage", "gpt2", "gpt2-tiny", 1, policy="gpipe")
    ex, spec, _ = _one_stage(one_rank_world, sc)
    _, mbs = H.step_batch(sc.family, sc.seed, 0)
    table = dict(HANDLERS)
    del table[Op.FREE]
    monkeypatch.setattr(executor_module, "HANDLERS", table)
    with pytest.raises(PipelineError, match=r"rank 0 .* step 0, instruction 0FREE0 .*no handler for opcode.*FREE"):
        train_step(ex, one_rank_world, 0, [mbs], spec=spec, policy="gpipe")
    monkeypatch.setattr(executor_module, "HANDLERS", HANDLERS)

    def broken(ex, ins):
        raise RuntimeError("boom")

    monkeypatch.setattr(executor_module, "HANDLERS", {**HANDLERS, Op.FORWARD: broken})
    with pytest.raises(PipelineError, match=r"step 1, instruction 0F0 slot=0 \(local\) failed: RuntimeError: boom"):
        train_step(ex, one_rank_world, 1, [mbs], spec=spec, policy="gpipe")


@pytest.mark.parametrize("policy", ["gpipe", "1f1b", "adaptive", "auto"])
def test_plan_step_lowers_every_policy_for_every_replica(policy):
    _, mbs = H.step_batch("t5", seed=0, step=0)
    spec = PipelineSpec.t5(1, 2, 64, "float32")
    replicas = H.split_replicas(mbs, 2)
    plans = plan_step([[micro_batch_shape(mb) for mb in r] for r in replicas], spec, policy=policy, step=3)
    assert sorted(plans) == list(range(6))
    assert all(p.step == 3 and p.num_replicas == 2 and p.num_micro_batches == 3 for p in plans.values())
    assert {p.replica_index for p in plans.values()} == {0, 1}


def test_unknown_policy_lists_the_valid_ones():
    spec = PipelineSpec.gpt(2, 64, "float32")
    with pytest.raises(ValueError, match="unknown policy 'zb'; valid: gpipe, 1f1b, adaptive, auto"):
        plan_step([[(1, 8, 0)]], spec, policy="zb")
