"""Split models: chained stages reproduce the unsplit model's loss and gradients exactly.

For GPT-2 and T5 presets, every balanced layout with 1-4 stages (plus hand-made layouts that cut T5
at its seam in other places) is built with ``build_stages``. One micro-batch runs through the stages
in one process the way a pipeline would: each stage receives detached, ``requires_grad`` copies of
its predecessor's sends; backward is the last stage's ``loss_sum.backward()`` followed, stage by
stage in reverse, by ``torch.autograd.backward(sends, grads of the next stage's received)``. The loss
sum must equal ``forward.py``'s on the whole model, and the stage gradients, summed over tied copies
by ``parameter_map``, must equal the whole model's gradients, for padded and packed micro-batches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynabatch.cost.boundary_moves import stage_moves
from dynabatch.cost.stages import StageLayout
from dynabatch.data.collate import collate_causal, collate_seq2seq
from dynabatch.data.sample import TokenizedSample
from dynabatch.models.forward import forward_loss
from dynabatch.models.presets import EOS_ID, PAD_ID, build_model
from dynabatch.models.split import (
    build_stage,
    build_stages,
    forked_rng,
    layout_for,
    micro_batch_inputs,
    pipeline_spec_for,
    seed_for,
    tied_parameter_stages,
)

VOCAB = 512
ROWS = {"padded": [[i] for i in range(5)], "packed": [[0, 1, 2], [3], [4]]}
T5_TINY_HAND_LAYOUTS = [
    # The seam alone at the end of a stage, then a stage starting at decoder_embedding.
    (("embedding", "t5_encoder"), ("t5_encoder",), ("decoder_embedding", "t5_decoder"), ("t5_decoder", "lm_head")),
    # Encoder and decoder layers in one stage, starting mid-encoder and ending mid-decoder.
    (("embedding", "t5_encoder"), ("t5_encoder", "decoder_embedding", "t5_decoder"), ("t5_decoder", "lm_head")),
    (("embedding", "t5_encoder", "t5_encoder", "decoder_embedding", "t5_decoder"), ("t5_decoder", "lm_head")),
]
GPT2_TINY_HALF_LAYOUTS = [
    # A stage boundary inside a block: its attention half ends one stage, its MLP half begins the next.
    (("embedding", "gpt_attn"), ("gpt_mlp", "gpt", "lm_head")),
    (("embedding", "gpt", "gpt_attn"), ("gpt_mlp", "lm_head")),
    # Both blocks cut: the middle stage holds the MLP half of one block and the attention half of the next.
    (("embedding", "gpt_attn"), ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "lm_head")),
]
T5_TINY_HALF_LAYOUTS = [
    # A stage boundary inside an encoder block: its self-attention half ends one stage, its FFN half begins the next.
    (("embedding", "t5_enc_attn"), ("t5_enc_ffn", "t5_encoder", "decoder_embedding", "t5_decoder"), ("t5_decoder", "lm_head")),
    (("embedding", "t5_encoder", "t5_enc_attn"), ("t5_enc_ffn", "decoder_embedding", "t5_decoder", "t5_decoder", "lm_head")),
    # Both encoder blocks cut: the middle stage holds one block's FFN half and the next block's attention half.
    (("embedding", "t5_enc_attn"), ("t5_enc_ffn", "t5_enc_attn"), ("t5_enc_ffn", "decoder_embedding", "t5_decoder",
                                                                  "t5_decoder", "lm_head")),
    # A stage holding nothing but an FFN half (no mask, no position bias, no bias table).
    (("embedding", "t5_encoder", "t5_enc_attn"), ("t5_enc_ffn",), ("decoder_embedding", "t5_decoder", "t5_decoder",
                                                                   "lm_head")),
]
CASES = (
    [("gpt2-tiny", s, None) for s in (1, 2)]
    + [("gpt2-tiny", len(lay), lay) for lay in GPT2_TINY_HALF_LAYOUTS]
    + [("gpt2-mini", s, None) for s in (3, 4)]
    + [("t5-tiny", s, None) for s in (1, 2, 3, 4)]
    + [("t5-mini", 4, None)]
    + [("t5-tiny", len(lay), lay) for lay in T5_TINY_HAND_LAYOUTS]
    + [("t5-tiny", len(lay), lay) for lay in T5_TINY_HALF_LAYOUTS]
)


def _samples(seed: int = 0) -> list[TokenizedSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(5):
        n_in, n_tgt = int(rng.integers(2, 9)), int(rng.integers(2, 7))
        inputs = np.append(rng.integers(3, VOCAB, n_in - 1), EOS_ID).astype(np.int32)
        targets = np.append(rng.integers(3, VOCAB, n_tgt - 1), EOS_ID).astype(np.int32)
        out.append(TokenizedSample(task="t", input_ids=inputs, target_ids=targets))
    return out


def _micro_batch(name: str, packing: str):
    samples, rows = _samples(), ROWS[packing]
    if name.startswith("gpt2"):
        return collate_causal(samples, rows, pad_id=PAD_ID)
    return collate_seq2seq(samples, rows, pad_id=PAD_ID, decoder_start_id=PAD_ID)


def _model(name: str, dropout: float = 0.0):
    return build_model(name, vocab_size=VOCAB, dropout=dropout, seed=0).train()


def _run_pipeline(stages, spec, mb, moves=None):
    """Forward and backward through the stages like a pipeline; returns (loss_sum, num_loss_tokens). ``moves``: the
    micro-batch's row of boundary moves (stages built with ``moving_boundaries``)."""
    b, e = mb.input_ids.shape
    d = mb.decoder_input_ids.shape[1] if hasattr(mb, "decoder_input_ids") else 0
    received, inputs, outputs = {}, [], []
    for s, stage in enumerate(stages):
        recv = {k: v.detach().requires_grad_() for k, v in received.items()}
        kwargs = {} if moves is None else {"moves": stage_moves(moves, s, len(stages))}
        out = stage(recv, micro_batch_inputs(mb, spec, s), **kwargs)
        expected = spec.send_tensors(s, b, e, d)
        assert [t.name for t in expected] == list(out.sends), f"stage {s} sends"
        assert [t.shape for t in expected] == [tuple(v.shape) for v in out.sends.values()]
        inputs.append(recv)
        outputs.append(out)
        received = out.sends
    last = outputs[-1]
    last.loss_sum.backward()
    for s in range(len(stages) - 2, -1, -1):
        names = list(outputs[s].sends)
        grads = [inputs[s + 1][k].grad for k in names]
        assert all(g is not None for g in grads), f"stage {s + 1} produced no gradient for some of {names}"
        torch.autograd.backward([outputs[s].sends[k] for k in names], grads)
    return last.loss_sum, last.num_loss_tokens


def _summed_stage_grads(stages) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.named_parameters():
            original = stage.parameter_map[name]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[original] = grads[original] + g if original in grads else g.clone()
    return grads


def _check_chained(model, layout: StageLayout, mb) -> None:
    spec = pipeline_spec_for(model, layout)
    stages = build_stages(model, layout)

    ref = forward_loss(model, mb)
    ref.loss_sum.backward()
    loss_sum, num_loss_tokens = _run_pipeline(stages, spec, mb)

    torch.testing.assert_close(loss_sum, ref.loss_sum)
    assert num_loss_tokens == ref.num_loss_tokens == mb.num_loss_tokens
    _assert_model_grads(model, stages)


def _assert_model_grads(model, stages) -> None:
    """The stages' gradients, summed over tied copies by ``parameter_map``, equal the whole model's."""
    grads = _summed_stage_grads(stages)
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == ref_grads.keys()  # every parameter lives on some stage, nothing extra
    for n, g in ref_grads.items():
        # Unnormalised token-loss sums give gradients up to ~50; padding-free attention sums in another
        # order than the dense reference, so the absolute tolerance scales with the gradient (fp32 ~1e-6).
        atol = max(1e-5, 2e-6 * float(g.abs().max()))
        torch.testing.assert_close(grads[n], g, rtol=1.3e-6, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("packing", ["padded", "packed"])
@pytest.mark.parametrize("name,num_stages,hand_layout", CASES)
def test_chained_stages_match_unsplit_model(name, num_stages, hand_layout, packing):
    model = _model(name)
    layout = StageLayout(hand_layout) if hand_layout else layout_for(model, num_stages)
    assert layout.num_stages == num_stages
    _check_chained(model, layout, _micro_batch(name, packing))


@pytest.mark.parametrize("name,stage_kinds", [("gpt2-tiny", None), ("t5-tiny", T5_TINY_HAND_LAYOUTS[1])])
def test_chained_stages_match_under_eager_attention(name, stage_kinds):
    model = _model(name)
    model.set_attn_implementation("eager")  # the stage copies inherit the configs
    layout = StageLayout(stage_kinds) if stage_kinds else layout_for(model, 2)
    _check_chained(model, layout, _micro_batch(name, "packed"))


TIED_CASES = [
    ("gpt2-mini", (("embedding", "gpt"), ("gpt", "gpt"), ("gpt", "lm_head")), {"shared_embedding": (0, 2)}),
    (
        "t5-tiny",
        T5_TINY_HAND_LAYOUTS[0],
        {"shared_embedding": (0, 2, 3), "encoder_relative_bias": (0, 1), "decoder_relative_bias": (2, 3)},
    ),
    (
        "t5-tiny",
        T5_TINY_HAND_LAYOUTS[1],
        {"shared_embedding": (0, 1, 2), "encoder_relative_bias": (0, 1), "decoder_relative_bias": (1, 2)},
    ),
    (  # the middle stage holds only an encoder block's FFN half: no position-bias table
        "t5-tiny",
        T5_TINY_HALF_LAYOUTS[3],
        {"shared_embedding": (0, 2), "encoder_relative_bias": (0,), "decoder_relative_bias": (2,)},
    ),
]


@pytest.mark.parametrize("name,stage_kinds,expected_holders", TIED_CASES)
def test_tied_groups_identical_across_stages(name, stage_kinds, expected_holders):
    model = _model(name)
    layout = StageLayout(stage_kinds)
    stages = build_stages(model, layout)
    holders = tied_parameter_stages(model, layout)
    assert holders == expected_holders
    for group, stage_indices in holders.items():
        assert tuple(i for i, st in enumerate(stages) if group in st.tied_parameters()) == stage_indices
        first = stages[stage_indices[0]].tied_parameters()[group]
        for i in stage_indices[1:]:
            other = stages[i].tied_parameters()[group]
            assert other is not first  # each stage owns its copy
            torch.testing.assert_close(other, first, rtol=0, atol=0)
    params = dict(model.named_parameters())
    for stage in stages:  # stages own their parameters, equal to the model's at build time
        for n, p in stage.named_parameters():
            assert p is not params[stage.parameter_map[n]]
            torch.testing.assert_close(p, params[stage.parameter_map[n]], rtol=0, atol=0)


def test_micro_batch_inputs_follow_load_tensors():
    model = _model("t5-tiny")
    layout = layout_for(model, 3)
    spec = pipeline_spec_for(model, layout)
    mb = _micro_batch("t5-tiny", "packed")
    b, e, d = mb.shape
    for s in range(3):
        loaded = micro_batch_inputs(mb, spec, s)
        expected = spec.load_tensors(s, b, e, d)
        assert list(loaded) == [t.name for t in expected]
        assert [tuple(v.shape) for v in loaded.values()] == [t.shape for t in expected]
    assert micro_batch_inputs(mb, spec, 2)["labels"] is mb.labels
    gpt = _model("gpt2-tiny")
    gpt_spec = pipeline_spec_for(gpt, layout_for(gpt, 2))
    gmb = _micro_batch("gpt2-tiny", "packed")
    assert micro_batch_inputs(gmb, gpt_spec, 1)["labels"] is gmb.target_ids  # pre-shifted targets
    with pytest.raises(ValueError, match="needs a causal pipeline spec, got .seq2seq."):
        micro_batch_inputs(gmb, spec, 0)


def test_too_many_stages_names_both_numbers():
    with pytest.raises(ValueError, match=r"\(2\), got 3"):
        layout_for(_model("gpt2-tiny"), 3)
    with pytest.raises(ValueError, match=r"\(4\), got 5"):
        layout_for(_model("t5-tiny"), 5)


def test_layout_must_match_model():
    model = _model("gpt2-tiny")
    with pytest.raises(ValueError, match="does not cover"):
        build_stage(model, StageLayout((("embedding", "gpt", "lm_head"),)), 0)
    with pytest.raises(ValueError, match="hold no transformer block"):
        build_stage(model, StageLayout((("embedding", "gpt", "gpt"), ("lm_head",))), 0)


def test_seed_for_is_deterministic_and_distinct():
    seeds = {seed_for(7, step, mb, st) for step in range(4) for mb in range(8) for st in range(4)}
    assert len(seeds) == 4 * 8 * 4
    assert seed_for(7, 1, 2, 3) == seed_for(7, 1, 2, 3) != seed_for(8, 1, 2, 3)
    assert all(0 <= s < 2**63 for s in seeds)
    with pytest.raises(ValueError, match="step"):
        seed_for(0, -1, 0, 0)


def test_dropout_reproducible_under_seed():
    model = _model("t5-tiny", dropout=0.3)
    layout = layout_for(model, 2)
    spec = pipeline_spec_for(model, layout)
    stage = build_stage(model, layout, 0)
    loaded = micro_batch_inputs(_micro_batch("t5-tiny", "packed"), spec, 0)

    def run(seed):
        torch.manual_seed(seed)
        return next(iter(stage({}, loaded).sends.values()))

    a, b, c = run(seed_for(0, 0, 0, 0)), run(seed_for(0, 0, 0, 0)), run(seed_for(0, 0, 1, 0))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    torch.manual_seed(123)
    with forked_rng(seed_for(0, 0, 0, 0)):  # same masks, and the outer RNG stream is left alone
        torch.testing.assert_close(next(iter(stage({}, loaded).sends.values())), a, rtol=0, atol=0)
    after_fork = torch.rand(4)
    torch.manual_seed(123)
    torch.testing.assert_close(after_fork, torch.rand(4), rtol=0, atol=0)
