"""Which units of a linear layout may cross each stage boundary, and what a stage holds and runs per move."""

import numpy as np
import pytest

from dynabatch.cost.boundary_moves import DOWN, STAY, UP, boundary_units, held_kinds, run_kinds, stage_moves
from dynabatch.cost.stages import StageLayout

GPT_HALVES = StageLayout((("embedding", "gpt", "gpt", "gpt_attn"), ("gpt_mlp", "gpt", "lm_head")))
T5 = StageLayout((("embedding", "t5_encoder", "t5_encoder"),
                  ("t5_encoder", "t5_encoder", "decoder_embedding", "t5_decoder", "t5_decoder", "lm_head")))
T5_SEAM = StageLayout((("embedding", "t5_encoder", "t5_encoder"),
                       ("decoder_embedding", "t5_decoder", "t5_decoder", "lm_head")))


def test_units_cross_within_one_stack_only():
    assert boundary_units(GPT_HALVES).down == (True,) and boundary_units(GPT_HALVES).up == (True,)
    assert boundary_units(T5).down == (True,) and boundary_units(T5).up == (True,)
    seam = boundary_units(T5_SEAM)
    assert seam.down == (False,) and seam.up == (False,) and not seam.any


def test_every_stage_keeps_a_unit_of_its_own():
    # the middle stage has two blocks: it lends its first unit up, never its last down as well
    layout = StageLayout((("embedding", "gpt", "gpt"), ("gpt", "gpt"), ("gpt", "gpt", "lm_head")))
    units = boundary_units(layout)
    assert units.down == (True, False) and units.up == (True, True)
    single = StageLayout((("embedding", "gpt"), ("gpt", "lm_head")))
    assert not boundary_units(single).any


def test_held_and_run_kinds():
    assert held_kinds(GPT_HALVES, 0) == ("embedding", "gpt", "gpt", "gpt_attn", "gpt_mlp")
    assert held_kinds(GPT_HALVES, 1) == ("gpt_attn", "gpt_mlp", "gpt", "lm_head")
    assert run_kinds(GPT_HALVES, 0, upper=STAY) == GPT_HALVES.stages[0]
    assert run_kinds(GPT_HALVES, 0, upper=DOWN) == ("embedding", "gpt", "gpt")
    assert run_kinds(GPT_HALVES, 1, lower=DOWN) == ("gpt_attn", "gpt_mlp", "gpt", "lm_head")
    assert run_kinds(GPT_HALVES, 0, upper=UP) == ("embedding", "gpt", "gpt", "gpt_attn", "gpt_mlp")
    assert run_kinds(GPT_HALVES, 1, lower=UP) == ("gpt", "lm_head")
    # whatever the move, the two stages run every unit once, in order
    for move in (DOWN, STAY, UP):
        assert run_kinds(GPT_HALVES, 0, upper=move) + run_kinds(GPT_HALVES, 1, lower=move) == \
            GPT_HALVES.stages[0] + GPT_HALVES.stages[1]


def test_check_and_stage_moves():
    units = boundary_units(T5_SEAM)
    with pytest.raises(ValueError, match="boundary 0: stage 0's last unit may not run on stage 1"):
        units.check(np.array([[0], [DOWN]]))
    with pytest.raises(ValueError, match="must be -1, 0 or 1"):
        boundary_units(T5).check(np.array([[2]]))
    assert boundary_units(T5).check([[UP], [DOWN]]).dtype == np.int8
    assert stage_moves(np.array([UP, DOWN]), 1, 3) == (UP, DOWN)
    assert stage_moves(np.array([UP, DOWN]), 0, 3) == (STAY, UP)
    assert stage_moves(np.array([UP, DOWN]), 2, 3) == (DOWN, STAY)
