"""Pipeline training on CPU/gloo equals single-process training of the unsplit HF model.

One launch of 4 processes runs every scenario of :data:`pipeline_harness.SCENARIOS` (GPT-2 and T5;
S = 2 and 4 stages; gpipe, 1f1b and adaptive; 2 replicas x 2 stages; several AdamW steps with
gradient clipping and an LR schedule). Global batches hold micro-batches of different shapes, with
padded and packed rows. The parent compares, by HF parameter name:

* gradients of every step with a reference that runs the unsplit model over the same micro-batches
  with gradient accumulation of ``loss_sum / global loss tokens`` (default fp32 tolerances);
* gradients of step 0 with a reference that runs every sample alone, unpadded (rtol 1e-4): masks,
  packing and the global token normalisation are right;
* parameters after each optimizer step, the reported loss and gradient norm;
* tied copies (the token table on the first, seam and last stages; T5's relative-position tables on
  every stage of a stack) and data-parallel replicas hold bitwise equal gradients and parameters
  (checked while loading the results).
"""

from __future__ import annotations

import pytest
import torch

import pipeline_harness as H

ONE_STEP = [n for n, sc in H.SCENARIOS.items() if sc.num_steps == 1]
MULTI_STEP = [n for n, sc in H.SCENARIOS.items() if sc.num_steps > 1]
SINGLES = [n for n, sc in H.SCENARIOS.items() if sc.policy == "1f1b" or sc.num_replicas > 1]


def _unclipped(sc: H.Scenario, run: dict, step: int = 0) -> dict:
    """The step's gradients before clipping (the workers record them after ``STEP`` clipped them)."""
    grads = run["grads"][step]
    if sc.max_grad_norm is None:
        return grads
    coef = min(sc.max_grad_norm / (run["grad_norm"][step] + 1e-6), 1.0)
    return {n: g / coef for n, g in grads.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("pipeline"))
    world = max(sc.world_size for sc in H.SCENARIOS.values())
    codes, elapsed = H.launch(world, H.scenarios_worker, (list(H.SCENARIOS), workdir), deadline_s=300)
    assert codes == [0] * world, f"exit codes {codes} after {elapsed:.0f} s\n{H.failures(workdir, world)}"
    return {name: H.load_results(workdir, sc) for name, sc in H.SCENARIOS.items()}


_REFERENCES: dict = {}


def reference(sc: H.Scenario) -> dict:
    key = (sc.family, sc.preset, sc.num_steps, sc.max_grad_norm, sc.seed)
    if key not in _REFERENCES:
        _REFERENCES[key] = H.reference_run(sc)
    return _REFERENCES[key]


def _assert_named_close(got: dict, want: dict, what: str, **tol) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{what} {name}: {m}", **tol)


@pytest.mark.parametrize("name", ONE_STEP)
def test_one_step_gradients_match_unsplit_model(runs, name):
    sc, got = H.SCENARIOS[name], runs[name]
    want = reference(sc)
    _assert_named_close(got["grads"][0], want["grads"][0], f"{name} ({got['layout']}) grad")
    assert got["loss"][0] == pytest.approx(want["loss"][0], rel=1e-6)
    assert got["grad_norm"][0] == pytest.approx(want["grad_norm"][0], rel=1e-5)


@pytest.mark.parametrize("name", MULTI_STEP)
def test_steps_with_adamw_match_unsplit_model(runs, name):
    sc, got = H.SCENARIOS[name], runs[name]
    want = reference(sc)
    for step in range(sc.num_steps):
        _assert_named_close(got["grads"][step], want["grads"][step], f"{name} step {step} grad")
        _assert_named_close(got["params"][step], want["params"][step], f"{name} params after step {step}")
        assert got["loss"][step] == pytest.approx(want["loss"][step], rel=1e-6)
        assert got["grad_norm"][step] == pytest.approx(want["grad_norm"][step], rel=1e-5)
    assert max(want["grad_norm"]) > sc.max_grad_norm  # clipping was active


@pytest.mark.parametrize("name", SINGLES)
def test_gradients_match_samples_run_alone(runs, name):
    sc = H.SCENARIOS[name]
    got = _unclipped(sc, runs[name])
    _assert_named_close(got, H.singles_grads(sc), f"{name} vs samples alone", rtol=1e-4, atol=1e-6)


def test_tied_copies_are_held_by_several_stages(runs):
    """The tied groups are really split across ranks in these layouts (so their reduction is tested)."""
    records = runs["t5-S4xR1-1f1b-3step"]["records"]
    holders = [r for r, rec in enumerate(records) if "shared.weight" in rec["grads"][0]]
    assert len(holders) >= 3, holders  # encoder embedding, decoder embedding (seam), tied lm_head
    enc_bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert sum(enc_bias in rec["grads"][0] for rec in records) >= 2
    gpt = runs["gpt2-S4xR1-1f1b-1step"]["records"]
    assert [r for r, rec in enumerate(gpt) if "transformer.wte.weight" in rec["grads"][0]] == [0, 3]


@pytest.mark.parametrize("name,layout", [
    ("gpt2-S3xR1-halves-1step", "embedding+gpt_attn | gpt_mlp+gpt_attn | gpt_mlp+lm_head"),
    ("t5-S3xR1-halves-1step", "embedding+t5_enc_attn | t5_enc_ffn+t5_enc_attn | "
                              "t5_enc_ffn+decoder_embedding+t5_decoderx2+lm_head")])
def test_a_stage_boundary_inside_a_block_ran_its_halves(runs, name, layout):
    """The halves scenarios (their gradients are checked with the others) ran on three ranks with both blocks cut."""
    got = runs[name]
    assert got["layout"] == layout
    assert len(got["records"]) == 3


def test_measured_timelines_hold_every_forward_and_backward(runs):
    from dynabatch.schedule.trace import to_chrome_trace

    for name in ("gpt2-S2xR2-1f1b-3step", "t5-S4xR1-1f1b-3step"):
        sc = H.SCENARIOS[name]
        timelines = runs[name]["records"][0]["timelines"]
        assert len(timelines) == sc.num_steps
        for step_timelines in timelines:
            assert sorted(step_timelines) == list(range(sc.num_replicas))
            for p, ops in step_timelines.items():
                num_mb = len(H.split_replicas(list(range(H.NUM_MICRO_BATCHES)), sc.num_replicas)[p])
                assert len(ops) == 2 * num_mb * sc.num_stages
                assert min(op.start_s for op in ops) >= 0 and all(op.end_s >= op.start_s for op in ops)
                # a stage's backward of a micro-batch starts after the next stage's backward ended
                end_b = {(op.stage, op.micro_batch): op.end_s for op in ops if op.phase.value == "B"}
                for op in ops:
                    if op.phase.value == "B" and op.stage < sc.num_stages - 1:
                        assert op.start_s >= end_b[(op.stage + 1, op.micro_batch)]
                assert len(to_chrome_trace(ops, process_name="executed")["traceEvents"]) > len(ops)
