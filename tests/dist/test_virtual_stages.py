"""Virtual stages over gloo: several pipeline chunks per process train exactly like the unsplit model.

One launch of 4 processes runs T5 under the cyclic placement (2 devices, 4 chunks: device d holds encoder chunk
d and decoder chunk d, so device 0 holds two copies of the token table) and GPT-2 interleaved (v = 2: 2 devices,
4 chunks), each with one replica and with two (4 processes), several AdamW steps with gradient clipping. Every
step's ops are ordered as the planner would (the shortest of the placed orders), or, as the planner would hand them
over, by interleaved 1F1B (the ``-1f1b`` scenarios) or DynaPipe's wait-free cyclic order (``-wfc``) and lowered onto the devices
(:func:`dynabatch.schedule.virtual.lower_placed`; the plans are validated before they run). The parent compares
gradients, parameters, losses and gradient norms by HF parameter name with the single-process unsplit model
(:func:`pipeline_harness.reference_run`, default fp32 tolerances); tied copies and replicas must hold bitwise
equal values (checked while loading).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import pipeline_harness as H

SCENARIOS = {
    sc.name: sc
    for sc in [
        H.Scenario("t5-cyclic-R1", "t5", "t5-tiny", 2, 1, num_steps=2, max_grad_norm=0.5, seed=4, placement="cyclic"),
        H.Scenario("t5-cyclic-R2", "t5", "t5-tiny", 2, 2, num_steps=2, seed=5, placement="cyclic"),
        H.Scenario("gpt2-interleaved-R1", "gpt2", "gpt2-mini", 2, 1, num_steps=2, max_grad_norm=0.5, seed=6,
                   placement="interleaved:2"),
        H.Scenario("gpt2-interleaved-R2", "gpt2", "gpt2-mini", 2, 2, num_steps=2, seed=7, placement="interleaved:2"),
        # the interleaved-1F1B orders (6 micro-batches: 3 rounds of 2 devices), handed to train_step as the planner does
        H.Scenario("t5-cyclic-1f1b", "t5", "t5-tiny", 2, 1, num_steps=1, seed=8, placement="cyclic",
                   placed_policy="interleaved_1f1b"),
        H.Scenario("gpt2-interleaved-1f1b", "gpt2", "gpt2-mini", 2, 1, num_steps=1, seed=9, placement="interleaved:2",
                   placed_policy="interleaved_1f1b"),
        # every chunk boundary inside a block: each device holds MLP halves and attention halves of its chunks
        H.Scenario("gpt2-interleaved-halves", "gpt2", "gpt2-mini", 2, 1, num_steps=2, max_grad_norm=0.5, seed=11,
                   placement="interleaved:2", stages=(("embedding", "gpt", "gpt_attn"), ("gpt_mlp", "gpt_attn"),
                                                      ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "lm_head"))),
        # DynaPipe's wait-free cyclic orders, handed over the same way
        H.Scenario("t5-cyclic-wfc", "t5", "t5-tiny", 2, 1, num_steps=1, seed=10, placement="cyclic",
                   placed_policy="wait_free_cyclic"),
    ]
}


def virtual_worker(rank: int, workdir: str) -> None:
    H._setup_worker()
    try:
        for sc in SCENARIOS.values():
            H.run_scenario(rank, sc, workdir)
    except BaseException as e:  # noqa: BLE001
        H._report_failure(workdir, rank, e)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("virtual"))
    codes, elapsed = H.launch(4, virtual_worker, (workdir,), deadline_s=300)
    assert codes == [0] * 4, f"exit codes {codes} after {elapsed:.0f} s\n{H.failures(workdir, 4)}"
    return {name: H.load_results(workdir, sc) for name, sc in SCENARIOS.items()}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_virtual_stages_equal_the_unsplit_model(runs, name):
    sc, run = SCENARIOS[name], runs[name]
    ref = H.reference_run(dataclasses.replace(sc, placement="linear"))
    for step in range(sc.num_steps):
        assert run["grads"][step].keys() == ref["grads"][step].keys()
        for n, want in ref["grads"][step].items():  # both after clipping
            torch.testing.assert_close(run["grads"][step][n], want, msg=f"step {step} grad {n}")
        for n, want in ref["params"][step].items():
            torch.testing.assert_close(run["params"][step][n], want, msg=f"step {step} param {n}")
        assert run["loss"][step] == pytest.approx(ref["loss"][step], rel=1e-5)
        assert run["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=1e-5)


def test_chunks_cut_inside_blocks_ran_their_halves(runs):
    assert runs["gpt2-interleaved-halves"]["layout"] == (
        "embedding+gpt+gpt_attn | gpt_mlp+gpt_attn | gpt_mlp+gpt_attn | gpt_mlp+lm_head")


def test_each_device_ran_its_chunks_one_op_at_a_time(runs):
    """The measured timeline holds all 4 chunks' forwards and backwards, and two chunks of one device (T5 cyclic:
    an encoder and a decoder chunk) never computed at the same time."""
    for name in ("t5-cyclic-R1", "gpt2-interleaved-R1"):
        ops = runs[name]["records"][0]["timelines"][0][0]  # rank 0's record: step 0, replica 0
        assert sorted({(op.stage, op.phase.value) for op in ops}) == [(s, p) for s in range(4) for p in "BF"]
        for device in (0, 1):
            spans = sorted((op.start_s, op.end_s) for op in ops if op.stage % 2 == device)
            assert len(spans) == 2 * 2 * H.NUM_MICRO_BATCHES
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), name


def test_devices_ran_the_fixed_orders_handed_over(runs):
    """Device orders in the planner's schedule are what the executors run (train_step lowers them as given)."""
    from dynabatch.schedule.step import token_costs
    from dynabatch.schedule.interleaved import interleaved_1f1b_orders
    from dynabatch.schedule.placement import Placement
    from dynabatch.schedule.wait_free_cyclic import wait_free_cyclic_orders

    for name in ("t5-cyclic-1f1b", "gpt2-interleaved-1f1b", "t5-cyclic-wfc"):
        placement = Placement.parse(SCENARIOS[name].placement, 2)
        ops = runs[name]["records"][0]["timelines"][0][0]
        if name.endswith("wfc"):  # no memory limit: the cycle pattern, whatever the costs
            costs = token_costs([(1, 1, 1)] * H.NUM_MICRO_BATCHES, placement.num_stages)
            expected = wait_free_cyclic_orders(costs, placement)
        else:
            expected = interleaved_1f1b_orders(placement, H.NUM_MICRO_BATCHES)
        for device in (0, 1):
            ran = [(op.phase.value, op.stage, op.micro_batch)
                   for op in sorted(ops, key=lambda op: op.start_s) if op.stage % 2 == device]
            assert ran == expected[device], name
