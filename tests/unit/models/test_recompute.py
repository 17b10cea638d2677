"""Activation recomputation (:mod:`dynabatch.models.recompute`): exact gradients, less saved memory.

For GPT-2, T5 and Llama (GQA) tiny models with dropout, chained stages give the same loss and every
parameter gradient under ``selective`` and ``full`` as under ``none`` (fp32, atol 1e-6), each stage forward
seeded with ``forked_rng(seed_for(...))`` as the executor does, on both attention paths and, for GPT-2 and
Llama, with token slices (``full`` re-runs the slice cache's hook during recomputation). The meter sees a
checkpointed block keep exactly its inputs, and the executor runs each micro-batch under the plan's mode.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from dynabatch.cost.boundary_moves import stage_moves
from dynabatch.cost.stages import StageLayout
from dynabatch.data.collate import collate_causal, collate_seq2seq
from dynabatch.data.microbatch import token_slices
from dynabatch.data.sample import TokenizedSample
from dynabatch.models import recompute
from dynabatch.models.presets import PAD_ID, build_model
from dynabatch.models.recompute import current_mode, recompute_mode
from dynabatch.models.split import build_stages, forked_rng, layout_for, micro_batch_inputs, pipeline_spec_for, seed_for
from dynabatch.engine.memory import SavedActivationMeter
from family_configs import build, decoder_config

MODES = ("none", "selective", "full")
VOCAB = 512


def _samples(seed: int, lengths) -> list[TokenizedSample]:
    rng = np.random.default_rng(seed)
    return [TokenizedSample("t", rng.integers(3, VOCAB, n).astype(np.int32), rng.integers(3, VOCAB, m).astype(np.int32))
            for n, m in lengths]


def _model(family: str, dropout: float = 0.1):
    if family == "llama":
        return build(decoder_config("llama", vocab_size=VOCAB, num_layers=2, attention_dropout=dropout), seed=0)
    return build_model(f"{family}-tiny", vocab_size=VOCAB, dropout=dropout, seed=0).train()


def _micro_batch(family: str):
    samples = _samples(1, ((20, 7), (9, 4), (13, 3)))
    rows = [[0], [1, 2]]  # a padded row and a packed row
    if family == "t5":
        return collate_seq2seq(samples, rows, pad_id=PAD_ID, decoder_start_id=PAD_ID)
    return collate_causal(samples, rows, pad_id=PAD_ID)


def run_chain(stages, spec, pieces, mode: str, sliced: bool = False, moves=None):
    """Forward each piece through the chained stages (piece ``j`` on stage ``i`` under ``forked_rng(seed_for(0,
    0, j, i))`` and ``recompute_mode(mode)``, as the executor runs it), then backward in reverse piece order
    (a token slice chain's order). Returns the loss, the gradients by original parameter name (tied copies
    summed, a copy that did not run counting as zeros) and the meter's peak saved bytes. ``moves``: one row of
    boundary moves for every piece (stages built with ``moving_boundaries``)."""
    for s in stages:
        s.zero_grad(set_to_none=True)
    meter = SavedActivationMeter(exclude=[p for s in stages for p in s.parameters()])
    contexts, runs = [None] * len(stages), []
    with meter:
        for j, piece in enumerate(pieces):
            received, row = {}, []
            for i, stage in enumerate(stages):
                loaded = micro_batch_inputs(piece, spec, i)
                kwargs = {} if moves is None else {"moves": stage_moves(moves, i, len(stages))}
                with forked_rng(seed_for(0, 0, j, i)), recompute_mode(mode):
                    if sliced:
                        out = stage(received, loaded, contexts[i], sliced=True, **kwargs)
                    else:
                        out = stage(received, loaded, **kwargs)
                if sliced:
                    contexts[i] = out.slice_record.extend()
                row.append((received, out))
                received = {n: t.detach().requires_grad_() for n, t in out.sends.items()}
            runs.append(row)
        peak = meter.peak_bytes
        carried = [None] * len(stages)
        for row in reversed(runs):
            grads: dict = {}
            for i in reversed(range(len(stages))):
                received, out = row[i]
                if out.loss_sum is not None:
                    tensors, roots = [out.loss_sum], [None]
                else:
                    pairs = [(t, grads[n]) for n, t in out.sends.items() if t.requires_grad and grads.get(n) is not None]
                    tensors, roots = [t for t, _ in pairs], [g for _, g in pairs]
                if sliced:
                    extra, extra_grads = out.slice_record.backward_roots(carried[i])
                    tensors, roots = tensors + extra, roots + extra_grads
                torch.autograd.backward(tensors, roots)
                if sliced:
                    carried[i] = out.slice_record.context_grads(carried[i])
                grads = {n: t.grad for n, t in received.items()}
        assert meter.live_bytes == 0  # every kept input released after its region's backward
    loss = sum(float(row[-1][1].loss_sum.detach()) for row in runs)
    by_name: dict[str, torch.Tensor] = {}
    for s in stages:
        for n, p in s.named_parameters():
            name, g = s.parameter_map[n], p.grad if p.grad is not None else torch.zeros_like(p)
            by_name[name] = g.clone() if name not in by_name else by_name[name] + g
    return loss, by_name, peak


def _check_modes_equal(results) -> None:
    loss, grads, peak = results["none"]
    for mode in ("selective", "full"):
        got_loss, got, _ = results[mode]
        assert got_loss == pytest.approx(loss, rel=1e-7, abs=1e-6), mode
        assert got.keys() == grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(got[name], g, rtol=0, atol=1e-6, msg=f"{mode} {name}")
    # the modes really ran: each stores less (dropout on the attention probabilities: the math SDPA path)
    assert results["full"][2] < results["selective"][2] < peak


@pytest.mark.parametrize("attention", ["segments", "dense"])
@pytest.mark.parametrize("family", ["gpt2", "t5", "llama"])
def test_recomputation_gives_the_gradients_of_none(family, attention):
    model = _model(family)
    layout = layout_for(model, 2)
    stages, spec = build_stages(model, layout, attention), pipeline_spec_for(model, layout)
    mb = _micro_batch(family)
    _check_modes_equal({mode: run_chain(stages, spec, [mb], mode) for mode in MODES})


@pytest.mark.parametrize("attention", ["segments", "dense"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_recomputation_of_token_slices_gives_the_gradients_of_none(family, attention):
    model = _model(family)
    layout = layout_for(model, 2)
    stages, spec = build_stages(model, layout, attention), pipeline_spec_for(model, layout)
    mb = _micro_batch(family)
    pieces = token_slices(mb, [0, 1, 6, 17, mb.shape[1]])
    _check_modes_equal({mode: run_chain(stages, spec, pieces, mode, sliced=True) for mode in MODES})


def test_sliced_full_recomputation_equals_the_unsliced_model():
    """Without dropout the sliced chain under ``full`` is the unsliced micro-batch (the carried keys/values and
    their gradients survive the recomputation's second call of the slice cache)."""
    model = _model("gpt2", dropout=0.0)
    layout = layout_for(model, 2)
    stages, spec = build_stages(model, layout), pipeline_spec_for(model, layout)
    mb = _micro_batch("gpt2")
    loss, grads, _ = run_chain(stages, spec, [mb], "none")
    got_loss, got, _ = run_chain(stages, spec, token_slices(mb, [0, 5, 11, mb.shape[1]]), "full", sliced=True)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(got[name], g, msg=name)


def test_rng_state_preservation_is_what_makes_dropout_exact(monkeypatch):
    model = _model("gpt2", dropout=0.2)
    layout = layout_for(model, 1)
    stages, spec = build_stages(model, layout), pipeline_spec_for(model, layout)
    mb = _micro_batch("gpt2")
    _, want, _ = run_chain(stages, spec, [mb], "none")
    real = recompute.checkpoint
    monkeypatch.setattr(recompute, "checkpoint", lambda *a, **k: real(*a, **{**k, "preserve_rng_state": False}))
    _, got, _ = run_chain(stages, spec, [mb], "full")
    assert max(float((got[n] - g).abs().max()) for n, g in want.items()) > 1e-3


def test_recompute_mode_is_validated_and_scoped():
    assert current_mode() == "none"
    with recompute_mode("full"):
        assert current_mode() == "full"
        with recompute_mode("selective"):
            assert current_mode() == "selective"
        assert current_mode() == "full"
    assert current_mode() == "none"
    with pytest.raises(ValueError, match="unknown recompute mode 'some'; valid: none, selective, full"):
        with recompute_mode("some"):
            pass


# ------------------------------------------------------------------------------------------ memory


def _stage_peaks(model, layout, stage_index: int, mb, attention: str) -> dict[str, int]:
    """Peak saved bytes of one stage's forward per mode, fed a received leaf like the executor's."""
    stage = build_stages(model, layout, attention)[stage_index]
    spec = pipeline_spec_for(model, layout)
    b, e, d = (*mb.shape, 0)[:3]
    shapes = {t.name: t.shape for t in spec.send_tensors(stage_index - 1, b, e, d)}
    peaks = {}
    for mode in MODES:
        torch.manual_seed(0)
        received = {n: torch.randn(s).requires_grad_() for n, s in shapes.items()}
        with SavedActivationMeter(exclude=stage.parameters()) as meter:
            with forked_rng(1), recompute_mode(mode):
                out = stage(received, micro_batch_inputs(mb, spec, stage_index))
            peaks[mode] = meter.peak_bytes
            sends = [t for t in out.sends.values() if t.requires_grad]
            torch.autograd.backward(sends, [torch.ones_like(t) for t in sends])
            assert meter.live_bytes == 0
    return peaks


def test_full_keeps_only_the_block_inputs_and_selective_less_than_none():
    """A middle GPT-2 stage of two blocks: under ``full`` it keeps the two blocks' (B, T, d) inputs (plus, dense,
    the shared (B, 1, T, T) mask), far below ``none``; ``selective`` keeps less than ``none``."""
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=256,
                                  resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    model = build(config)
    layout = StageLayout((("embedding", "gpt"), ("gpt", "gpt"), ("gpt", "lm_head")))
    mb = _micro_batch("gpt2")
    b, t = mb.shape
    block_input = b * t * 64 * 4
    seen = {}
    for attention in ("segments", "dense"):
        peaks = seen[attention] = _stage_peaks(model, layout, 1, mb, attention)
        mask = b * t * t * 4 if attention == "dense" else 0
        assert peaks["full"] == 2 * block_input + mask
        assert peaks["selective"] < peaks["none"] and peaks["full"] < peaks["none"] / 4
    print(f"gpt2 middle stage (B, T, d) = ({b}, {t}, 64), 2 blocks, dropout 0.1: {seen}")


def test_t5_decoder_stage_keeps_its_block_inputs_under_full():
    """A T5 decoder stage of one block: under ``full`` it keeps the block's inputs (the received ``dec_hidden``
    and ``enc_out``, the (1, H, n, n) self-attention bias; segments: the (1, H, 1, 1) zero cross-attention bias
    that stands in for HF's (1, H, D, E) one; dense: both masks) and the bias lookup's buckets."""
    config = AutoConfig.for_model("t5", vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                  num_decoder_layers=3, num_heads=4, feed_forward_proj="gated-gelu",
                                  tie_word_embeddings=False, dropout_rate=0.1, pad_token_id=PAD_ID,
                                  decoder_start_token_id=PAD_ID, use_cache=False)
    model = build(config)
    layout = StageLayout((("embedding", "t5_encoder", "t5_encoder", "decoder_embedding", "t5_decoder"),
                          ("t5_decoder",), ("t5_decoder", "lm_head")))
    mb = _micro_batch("t5")
    b, e, d = mb.shape
    seen = {}
    for attention in ("segments", "dense"):
        peaks = seen[attention] = _stage_peaks(model, layout, 1, mb, attention)
        n = d  # the bias covers the longest decoder sample (segments) or the padded row (dense): here both D
        bias = 4 * n * n * 4 + (2 * n - 1) * 8  # (1, H, n, n) fp32 and the int64 buckets of its lookup
        masks = (b * d * d + b * d * e) * 4 if attention == "dense" else 4 * 1 * 1 * 4
        assert peaks["full"] == (b * d + b * e) * 64 * 4 + bias + masks
        assert peaks["selective"] < peaks["none"] and peaks["full"] < peaks["none"] / 2
    print(f"t5 decoder stage (B, E, D) = ({b}, {e}, {d}), 1 block, dropout 0.1: {seen}")


# ------------------------------------------------------------------------------------------ executor


def test_the_executor_runs_each_micro_batch_under_the_plans_mode(tmp_path):
    """One-rank pipeline, dropout seeded per micro-batch: a plan that recomputes (``full`` / ``selective`` /
    mixed per micro-batch) gives the gradients of the plan that does not, with less saved memory."""
    from dynabatch.engine.dist import init_distributed, shutdown

    ctx = init_distributed(1, 1, rank=0, world_size=1, init_method=f"file://{tmp_path}/init", timeout_s=30)
    try:
        _check_executor_modes(ctx)
    finally:
        shutdown()


def _check_executor_modes(ctx) -> None:
    from dynabatch.engine.executor import Executor
    from dynabatch.engine.step import micro_batch_shape, step_payloads
    from dynabatch.schedule.step import lower_step as plan_step

    model = _model("gpt2")
    layout = layout_for(model, 1)
    stage, spec = build_stages(model, layout)[0], pipeline_spec_for(model, layout)
    ex = Executor(stage, ctx, torch.optim.SGD(stage.parameters(), lr=0.0), dropout_seed=3, measure_memory=True)
    mbs = [_micro_batch("gpt2"), collate_causal(_samples(2, ((30, 9),)), [[0]], pad_id=PAD_ID)]
    plan = plan_step([[micro_batch_shape(mb) for mb in mbs]], spec, policy="gpipe")[0]
    inputs = step_payloads({0: plan}, [mbs], spec)[0]
    results = {}
    for modes in (("none", "none"), ("full", "full"), ("selective", "selective"), ("full", "none")):
        step = ex.run(dataclasses.replace(inputs, plan=dataclasses.replace(plan, recompute=modes)))
        results[modes] = step.saved_peak_bytes, {n: p.grad.clone() for n, p in stage.named_parameters()}, step.loss
    peak, grads, loss = results[("none", "none")]
    for modes, (got_peak, got, got_loss) in results.items():
        assert got_loss == loss
        for n, g in grads.items():
            torch.testing.assert_close(got[n], g, rtol=0, atol=1e-6, msg=f"{modes} {n}")
        if modes != ("none", "none"):
            assert got_peak < peak, modes
    assert results[("full", "full")][0] < results[("full", "none")][0]
