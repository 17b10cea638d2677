"""Instruction IR: stable opcodes, text forms, tensor specs, pipeline spec, plan serialization."""

from __future__ import annotations

import dataclasses
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from dynabatch.schedule.compute import ComputeSchedule
from dynabatch.schedule.ir import (
    PLAN_FORMAT_VERSION,
    ExecutionPlan,
    Instr,
    Op,
    PipelineSpec,
    TensorSpec,
    message_tag,
)
from dynabatch.schedule.lower import lower

BF16 = "bfloat16"


def test_opcode_values_are_stable():
    # The values are the text and wire codes: changing one breaks stored plans and running executors.
    assert [(op.name, op.value) for op in Op] == [
        ("LOAD", "LOAD"),
        ("FORWARD", "F"),
        ("BACKWARD", "B"),
        ("SEND_ACT", "SEND_F"),
        ("RECV_ACT", "RECV_F"),
        ("SEND_GRAD", "SEND_B"),
        ("RECV_GRAD", "RECV_B"),
        ("WAIT", "WAIT"),
        ("FREE", "FREE"),
        ("REDUCE_GRADS", "REDUCE"),
        ("OPTIMIZER_STEP", "STEP"),
    ]


@pytest.mark.parametrize(
    "text, instr",
    [
        ("1F0", Instr(Op.FORWARD, 1, 0)),
        ("0B12", Instr(Op.BACKWARD, 0, 12)),
        ("3LOAD7", Instr(Op.LOAD, 3, 7)),
        ("2SEND_F3", Instr(Op.SEND_ACT, 2, 3, peer=3, tag=6)),
        ("2RECV_F3", Instr(Op.RECV_ACT, 2, 3, peer=1, tag=6)),
        ("2SEND_B3", Instr(Op.SEND_GRAD, 2, 3, peer=1, tag=7)),
        ("2RECV_B3", Instr(Op.RECV_GRAD, 2, 3, peer=3, tag=7)),
        ("1WAIT_RECV_F0", Instr(Op.WAIT, 1, 0, peer=0, tag=0, waits_on=Op.RECV_ACT)),
        ("0WAIT_SEND_F5", Instr(Op.WAIT, 0, 5, peer=1, tag=10, waits_on=Op.SEND_ACT)),
        ("1FREE0", Instr(Op.FREE, 1, 0)),
        ("0REDUCE", Instr(Op.REDUCE_GRADS, 0)),
        ("4STEP", Instr(Op.OPTIMIZER_STEP, 4)),
    ],
)
def test_compact_key_round_trips(text, instr):
    assert str(instr) == text
    assert Instr.from_str(text) == instr


def test_full_text_round_trips_every_field():
    tensors = (TensorSpec("dec_hidden", (4, 32, 64), BF16), TensorSpec("enc_out", (4, 128, 64), BF16))
    ins = Instr(Op.RECV_ACT, 2, 9, peer=5, slot=3, tag=18, tensors=tensors)
    text = ins.to_text()
    assert text == "2RECV_F9 slot=3 peer=5 tag=18 dec_hidden:bfloat16[4x32x64] enc_out:bfloat16[4x128x64]"
    assert Instr.from_str(text) == ins
    scalar = Instr(Op.LOAD, 0, 0, slot=0, tensors=(TensorSpec("scale", (), "float32"),))
    assert Instr.from_str(scalar.to_text()) == scalar


@pytest.mark.parametrize(
    "text, match",
    [
        ("", "empty"),
        ("F0", "expected <stage><OP>"),
        ("1X0", "unknown opcode 'X'"),
        ("1WAIT_F0", "unknown opcode 'F'|waits_on"),
        ("1F0 slot=x", "unknown field"),
        ("1F0 colour=2", "unknown field"),
        ("1RECV_F0 h:float7[2]", "unknown dtype"),
        ("0RECV_F0", "needs a peer"),
        ("1REDUCE3", "micro_batch 3 is invalid"),
        ("1F", "micro_batch -1 is invalid"),
    ],
)
def test_bad_text_raises_value_error(text, match):
    with pytest.raises(ValueError, match=match):
        Instr.from_str(text)


def test_instr_is_frozen_and_slotted():
    ins = Instr(Op.FORWARD, 0, 0)
    with pytest.raises(AttributeError):
        ins.stage = 1
    assert not hasattr(ins, "__dict__")


def test_tensor_spec():
    t = TensorSpec("hidden", (2, 8, 16), BF16)
    assert t.nbytes == 2 * 8 * 16 * 2
    assert TensorSpec.from_str(str(t)) == t
    with pytest.raises(ValueError, match="valid dtypes: float64"):
        TensorSpec("h", (1,), "bf16")
    with pytest.raises(ValueError, match="shape"):
        TensorSpec("h", (1, -2), BF16)
    with pytest.raises(ValueError, match="identifier"):
        TensorSpec("a b", (1,), BF16)


def test_message_tags_are_unique_per_direction():
    tags = {message_tag(m, op) for m in range(50) for op in (Op.SEND_ACT, Op.SEND_GRAD)}
    assert len(tags) == 100
    assert message_tag(3, Op.SEND_ACT) == message_tag(3, Op.RECV_ACT) == 6


# ------------------------------------------------------------------------------ pipeline spec


def test_gpt_sends_hidden_states():
    spec = PipelineSpec.gpt(3, d_model=64, dtype="float32")
    assert spec.send_tensors(0, 4, 128, 0) == (TensorSpec("hidden", (4, 128, 64), "float32"),)
    assert spec.send_tensors(2, 4, 128, 0) == ()  # last stage
    names = lambda s: [t.name for t in spec.load_tensors(s, 4, 128, 0)]  # noqa: E731
    assert names(0) == ["segment_ids", "input_ids", "position_ids"]
    assert names(1) == ["segment_ids"]
    assert names(2) == ["segment_ids", "labels"]


def test_t5_decoder_stages_relay_the_encoder_output():
    spec = PipelineSpec.t5(1, 2, d_model=32)
    assert spec.stage_roles == ("encoder", "decoder", "decoder")
    assert spec.send_tensors(0, 2, 10, 5) == (TensorSpec("enc_hidden", (2, 10, 32), BF16),)
    assert spec.send_tensors(1, 2, 10, 5) == (
        TensorSpec("dec_hidden", (2, 5, 32), BF16),
        TensorSpec("enc_out", (2, 10, 32), BF16),
    )
    loads = {s: [t.name for t in spec.load_tensors(s, 2, 10, 5)] for s in range(3)}
    assert loads[0] == ["segment_ids", "input_ids"]
    assert loads[1] == ["segment_ids", "decoder_segment_ids", "decoder_input_ids"]
    assert loads[2] == ["segment_ids", "decoder_segment_ids", "labels"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(family="bert", stage_roles=("gpt",), d_model=8), "unknown sequence kind .bert.; valid: causal, seq2seq"),
        (dict(family="gpt", stage_roles=("encoder",), d_model=8), "only gpt stages"),
        (dict(family="t5", stage_roles=("decoder", "encoder"), d_model=8), "encoder stages then"),
        (dict(family="t5", stage_roles=("encoder",), d_model=8), "encoder stages then"),
        (dict(family="gpt", stage_roles=(), d_model=8), "non-empty"),
        (dict(family="gpt", stage_roles=("gpt",), d_model=0), "d_model"),
        (dict(family="gpt", stage_roles=("gpt",), d_model=8, dtype="half"), "valid dtypes"),
    ],
)
def test_pipeline_spec_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineSpec(**kwargs)


@pytest.mark.parametrize("family, num_stages", [("t5", 2), ("t5", 4), ("gpt", 3)])
def test_send_bytes_match_the_cost_model(family, num_stages):
    """What the IR puts on the wire is what the analytic model charges for (``send_bytes``)."""
    from dynabatch.cost.analytic import AnalyticCostModel
    from dynabatch.cost.hardware import hardware_spec
    from dynabatch.cost.model_specs import TransformerSpec
    from dynabatch.cost.layer_split import balanced_layout

    spec = TransformerSpec(family, d_model=64, num_heads=4, d_kv=16, d_ff=128, num_layers=4,
                           num_decoder_layers=4 if family == "t5" else 0, vocab_size=100)
    model = AnalyticCostModel(spec, hardware_spec("a100-80gb"))
    layout = balanced_layout(model, num_stages, ref_shape=(2, 64, 16))
    pipe = PipelineSpec.from_layout(layout, d_model=64, dtype=BF16)
    b, E, D = 3, 40, (12 if family == "t5" else 0)
    for s, kinds in enumerate(layout.stages):
        want = model.send_bytes(kinds[-1], b, E, D if family == "t5" else None)
        assert sum(t.nbytes for t in pipe.send_tensors(s, b, E, D)) == want, (s, kinds)


# ------------------------------------------------------------------------------ serialization


def _plans(family="t5", seed=0, moves=None):
    rng = np.random.default_rng(seed)
    S, M = 3, 5
    text = "\n".join(" ".join([f"F{m}" for m in range(M)] + [f"B{m}" for m in range(M)]) for _ in range(S))
    spec = PipelineSpec.t5(1, 2, 16) if family == "t5" else PipelineSpec.gpt(S, 16)
    shapes = np.stack([rng.integers(1, 5, M), rng.integers(1, 64, M), rng.integers(1, 32, M)], axis=1)
    return lower(ComputeSchedule.from_str(text), shapes, spec, step=7, moves=moves)


MOVES = np.array([[0, 0], [-1, 0], [1, -1], [0, 1], [-1, -1]])
"""(M, S - 1) moving stage boundaries of the 3 stages and 5 micro-batches of :func:`_plans`."""


@pytest.mark.parametrize("family, moves", [("t5", None), ("gpt", None), ("gpt", MOVES)])
def test_bytes_and_text_round_trip(family, moves):
    for plan in _plans(family, moves=moves).values():
        data = plan.to_bytes()
        assert data[:4] == b"DBXP"
        assert ExecutionPlan.from_bytes(data) == plan
        assert ExecutionPlan.from_text(plan.to_text()) == plan
        assert ExecutionPlan.from_text(plan.to_text()).step == 7


def test_each_stage_carries_its_micro_batches_moves():
    plans = _plans("gpt", moves=MOVES)
    for m, (below, above) in enumerate(MOVES):
        assert plans[0].moves_of(m) == (0, int(below))
        assert plans[1].moves_of(m) == (int(below), int(above))
        assert plans[2].moves_of(m) == (int(above), 0)
    assert _plans("gpt", moves=np.zeros_like(MOVES))[1].moves == ()  # no move: nothing carried
    assert _plans("gpt")[1].moves_of(3) == (0, 0)
    with pytest.raises(ValueError, match="two entries of -1, 0 or 1 per micro-batch"):
        dataclasses.replace(plans[1], moves=(0, 2) * 5)


def test_binary_form_is_compact():
    plan = _plans()[1]
    assert len(plan.to_bytes()) < 20 * len(plan.instructions)


def test_version_mismatch_is_a_clear_error():
    plan = _plans()[0]
    data = plan.to_bytes()
    newer = data[:4] + struct.pack("<H", PLAN_FORMAT_VERSION + 1) + data[6:]
    with pytest.raises(ValueError, match=f"format version {PLAN_FORMAT_VERSION + 1} is not supported"):
        ExecutionPlan.from_bytes(newer)
    text = plan.to_text().replace(f"v{PLAN_FORMAT_VERSION} ", f"v{PLAN_FORMAT_VERSION + 1} ", 1)
    with pytest.raises(ValueError, match="reads version"):
        ExecutionPlan.from_text(text)


def test_corrupt_input_is_a_value_error():
    with pytest.raises(ValueError, match="magic"):
        ExecutionPlan.from_bytes(b"PK\x03\x04rest")
    data = _plans()[0].to_bytes()
    with pytest.raises(ValueError, match="corrupt"):
        ExecutionPlan.from_bytes(data[:6] + zlib.compress(b'{"plan": [1]}'))
    with pytest.raises(ValueError, match="first line"):
        ExecutionPlan.from_text("0F0\n")


def test_plan_rank_layout_is_checked():
    with pytest.raises(ValueError, match="replica_index \\* num_devices \\+ device"):
        ExecutionPlan(rank=1, stage=1, num_stages=2, replica_index=1, num_replicas=2, num_micro_batches=0,
                      num_slots=0, instructions=())


def test_schedule_package_imports_no_torch():
    code = (
        "import sys; import dynabatch.schedule.ir, dynabatch.schedule.lower, dynabatch.schedule.validate, "
        "dynabatch.schedule.serialize; bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
