"""Stage boundaries that move per micro-batch (:mod:`dynabatch.models.boundary_copies`).

For GPT-2, Llama-style decoders (whole blocks and block halves) and T5's encoder (blocks and halves), stages built
with ``moving_boundaries=True`` run several micro-batches, each with another row of moves (``DOWN``, ``0``, ``UP``
at every boundary that allows it): each micro-batch's loss equals the whole model's, and the gradients summed over
the step, tied copies summed by original name (a copy no micro-batch ran counting as zeros), equal the whole
model's. The copies are tied groups named by the original parameter, held by the stages
:func:`~dynabatch.models.split.tied_parameter_stages` says. A GPT-2 token-slice chain with a move equals the
unsliced model (also under ``full`` recomputation of the copies). Built without the option a stage is today's, and
a move a stage holds no copy for is a ``ValueError``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynabatch.cost.boundary_moves import DOWN, STAY, UP, boundary_units, run_kinds, stage_moves
from dynabatch.cost.stages import StageLayout
from dynabatch.data.collate import collate_causal, collate_seq2seq
from dynabatch.data.microbatch import token_slices
from dynabatch.models.boundary_copies import units_to_run
from dynabatch.models.forward import forward_loss
from dynabatch.models.presets import PAD_ID, build_model
from dynabatch.models.split import build_stage, build_stages, micro_batch_inputs, pipeline_spec_for, tied_parameter_stages
from family_configs import build, decoder_config
from test_recompute import run_chain
from test_stage_split import ROWS, VOCAB, _assert_model_grads, _run_pipeline, _samples

GPT_HALVES = (("embedding", "gpt", "gpt_attn"), ("gpt_mlp", "gpt_attn"), ("gpt_mlp", "gpt", "lm_head"))
GPT_BLOCKS = (("embedding", "gpt", "gpt"), ("gpt", "gpt", "lm_head"))
T5_MINI = (  # encoder blocks and halves move; the decoder never does
    ("embedding", "t5_encoder", "t5_encoder"), ("t5_encoder", "t5_enc_attn"),
    ("t5_enc_ffn", "decoder_embedding", "t5_decoder", "t5_decoder"), ("t5_decoder", "t5_decoder", "lm_head"),
)
T5_TINY = (  # the middle stage holds only an FFN half; the attention half moving down needs the bias table there
    ("embedding", "t5_encoder", "t5_enc_attn"), ("t5_enc_ffn",), ("decoder_embedding", "t5_decoder", "t5_decoder",
                                                                  "lm_head"),
)
CASES = [
    ("gpt2-mini", GPT_BLOCKS),
    ("gpt2-mini", GPT_HALVES),
    ("llama", GPT_BLOCKS),
    ("qwen2-tied", (("embedding", "gpt", "gpt_attn"), ("gpt_mlp", "gpt", "lm_head"))),
    ("t5-mini", T5_MINI),
    ("t5-tiny", T5_TINY),
]


def _model(name: str):
    if name == "llama":
        return build(decoder_config("llama", vocab_size=VOCAB, num_layers=4))
    if name == "qwen2-tied":
        return build(decoder_config("qwen2", vocab_size=VOCAB, num_layers=3, tie=True))
    return build_model(name, vocab_size=VOCAB, dropout=0.0, seed=0).train()


def _micro_batch(name: str, k: int):
    samples, rows = _samples(seed=k), ROWS["packed" if k % 2 else "padded"]
    if name.startswith("t5"):
        return collate_seq2seq(samples, rows, pad_id=PAD_ID, decoder_start_id=PAD_ID)
    return collate_causal(samples, rows, pad_id=PAD_ID)


def _move_rows(layout: StageLayout) -> list[np.ndarray]:
    """All moves down, none, all up (where allowed), and down/up alternating by boundary."""
    units = boundary_units(layout)
    assert units.any
    n = units.num_boundaries
    down = [DOWN if units.down[b] else STAY for b in range(n)]
    up = [UP if units.up[b] else STAY for b in range(n)]
    mixed = [(down if b % 2 == 0 else up)[b] for b in range(n)]
    return [units.check(np.array(row, dtype=np.int8))[0] for row in (down, [STAY] * n, up, mixed)]


@pytest.mark.parametrize("name,stage_kinds", CASES)
def test_moved_units_give_the_whole_models_losses_and_gradients(name, stage_kinds):
    model, layout = _model(name), StageLayout(stage_kinds)
    spec = pipeline_spec_for(model, layout)
    stages = build_stages(model, layout, moving_boundaries=True)
    for k, row in enumerate(_move_rows(layout)):
        mb = _micro_batch(name, k)
        ref = forward_loss(model, mb)
        ref.loss_sum.backward()  # the whole model's gradients accumulate over the micro-batches, as the stages'
        loss_sum, num_loss_tokens = _run_pipeline(stages, spec, mb, moves=row)
        torch.testing.assert_close(loss_sum, ref.loss_sum, msg=lambda m, row=row: f"moves {row}: {m}")
        assert num_loss_tokens == ref.num_loss_tokens
    _assert_model_grads(model, stages)
    # the copies are tied groups named by the original parameter, held by both stages
    holders = tied_parameter_stages(model, layout, moving_boundaries=True)
    for group, indices in holders.items():
        assert tuple(i for i, st in enumerate(stages) if group in st.tied_parameters()) == indices, group
    moved = {g for g in holders if g in dict(model.named_parameters())}
    assert moved and all(len(holders[g]) == 2 for g in moved)


PART_KIND = {"AttentionHalf": "attn", "MlpHalf": "mlp", "EncoderAttentionHalf": "attn", "EncoderFeedForwardHalf": "mlp"}
"""What kind of unit a part module is (a whole block otherwise)."""
UNIT_KIND = {"gpt": "block", "t5_encoder": "block", "gpt_attn": "attn", "t5_enc_attn": "attn", "gpt_mlp": "mlp",
             "t5_enc_ffn": "mlp"}
"""The same for the movable layer kinds of :func:`run_kinds`."""


@pytest.mark.parametrize("name,stage_kinds", CASES)
def test_each_stage_runs_the_kinds_of_its_moves(name, stage_kinds):
    """The units a stage runs per move are :func:`run_kinds`'s movable kinds, in order."""
    model, layout = _model(name), StageLayout(stage_kinds)
    stages = build_stages(model, layout, moving_boundaries=True)
    for row in _move_rows(layout):
        for s, stage in enumerate(stages):
            moves = stage_moves(row, s, layout.num_stages)
            got = [PART_KIND.get(type(u).__name__, "block") for u in units_to_run(stage, moves)]
            want = [UNIT_KIND[k] for k in run_kinds(layout, s, *moves) if k in UNIT_KIND]
            assert got == want, (s, row)


@pytest.mark.parametrize("mode", ["none", "full"])
@pytest.mark.parametrize("row", [(DOWN,), (UP,)])
def test_token_slices_with_a_move_equal_the_unsliced_model(row, mode):
    """The slice cache finds a moved unit's attention by its ``layer_idx`` on whichever stage runs it; under ``full``
    the copy is checkpointed like every block."""
    model, layout = _model("gpt2-mini"), StageLayout(GPT_BLOCKS)
    stages, spec = build_stages(model, layout, moving_boundaries=True), pipeline_spec_for(model, layout)
    mb = _micro_batch("gpt2-mini", 1)
    ref = forward_loss(model, mb)
    ref.loss_sum.backward()
    moves = np.array(row, dtype=np.int8)
    loss, grads, _ = run_chain(stages, spec, token_slices(mb, [0, 3, 7, mb.shape[1]]), mode, sliced=True, moves=moves)
    assert loss == pytest.approx(float(ref.loss_sum.detach()), rel=1e-5)
    ran, idle = (stages[1].moved_down, stages[0].blocks[-1]) if row == (DOWN,) else (stages[0].moved_up, stages[1].blocks[0])
    assert all(p.grad is not None for p in ran.parameters()) and all(p.grad is None for p in idle.parameters())
    for n, p in model.named_parameters():
        atol = max(1e-5, 2e-6 * float(p.grad.abs().max()))
        torch.testing.assert_close(grads[n], p.grad, rtol=1.3e-6, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("name,stage_kinds", CASES)
def test_without_moving_boundaries_stages_are_unchanged(name, stage_kinds):
    model, layout = _model(name), StageLayout(stage_kinds)
    for s in range(layout.num_stages):
        off, on = build_stage(model, layout, s), build_stage(model, layout, s, moving_boundaries=True)
        off_names = [n for n, _ in off.named_parameters()]
        assert not any(n.startswith("moved_") for n in off_names)
        assert off.held_kinds == off.kinds and set(off.tied_parameters()) <= {
            "shared_embedding", "encoder_relative_bias", "decoder_relative_bias"}
        extra = [n for n, _ in on.named_parameters() if n not in off_names]
        assert all(n.startswith(("moved_down.", "moved_up.", "encoder_relative_bias.")) for n in extra), extra
        assert [n for n, _ in on.named_parameters() if n in off_names] == off_names


def test_a_move_without_a_held_copy_is_a_value_error():
    model, layout = _model("gpt2-mini"), StageLayout(GPT_HALVES)
    spec = pipeline_spec_for(model, layout)
    mb = _micro_batch("gpt2-mini", 0)
    plain = build_stage(model, layout, 1)
    received = {"hidden": torch.zeros(*mb.input_ids.shape, model.config.n_embd)}
    with pytest.raises(ValueError, match="stage 1 holds no copy of stage 0's last unit .*built without moving_boundaries"):
        plain(received, micro_batch_inputs(mb, spec, 1), moves=(DOWN, STAY))
    moving = build_stage(model, layout, 1, moving_boundaries=True)
    with pytest.raises(ValueError, match="stage 1 may not lend its last unit to stage 2"):
        moving(received, micro_batch_inputs(mb, spec, 1), moves=(STAY, DOWN))
    first = build_stage(model, layout, 0, moving_boundaries=True)
    with pytest.raises(ValueError, match="stage 0 has no boundary below"):
        first({}, micro_batch_inputs(mb, spec, 0), moves=(DOWN, STAY))
    with pytest.raises(ValueError, match="must be -1, 0 or 1"):
        moving(received, micro_batch_inputs(mb, spec, 1), moves=(2, STAY))
