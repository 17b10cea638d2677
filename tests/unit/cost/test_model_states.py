"""Model states priced per rank under ``--zero`` (:mod:`dynabatch.cost.model_states`): the arithmetic, the larger
activation budget of the planner's :class:`~dynabatch.cost.stages.StageCostModel`, the tied token table's copy on a
later stage, and ``plan`` / ``simulate`` / ``train`` on the command line (the measured bytes of a run are compared with
these in ``tests/dist/test_zero.py``)."""

from __future__ import annotations

import json

import pytest

from dynabatch.cli import main
from dynabatch.training.config import TrainConfig
from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.model_specs import layer_param_count
from dynabatch.cost.model_states import per_rank_state_bytes
from dynabatch.cost.stages import StageCostModel
from dynabatch.cost.layer_split import balanced_layout


@pytest.mark.parametrize("zero, per_param", [(0, 18.0), (1, 4 + 2 + 4 + 8 / 8), (2, 4 + 2 + (4 + 8) / 8)])
def test_bytes_per_parameter_of_each_zero_setting(zero, per_param):
    """The issue's arithmetic for bf16 autocast (18 bytes a parameter unsharded), 8 replicas."""
    n = 1_000_000
    assert per_rank_state_bytes(18.0 * n, n, "adam", zero, 8) == pytest.approx(per_param * n)
    assert per_rank_state_bytes(18.0 * n, n, "adam", zero, 1) == pytest.approx(18.0 * n)  # nothing to shard over


def test_bad_zero_and_replicas_are_value_errors():
    with pytest.raises(ValueError, match="--zero must be one of 0, 1, 2"):
        per_rank_state_bytes(1.0, 1, "adam", 3, 2)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        per_rank_state_bytes(1.0, 1, "adam", 1, 0)


def test_sharding_grows_the_activation_budget():
    model = AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb")
    layout = balanced_layout(model, 2)
    budgets, states = [], []
    for zero in (0, 1, 2):
        cm = StageCostModel(model, layout, 40 * 2**30, zero=zero, replicas=4)
        budgets.append(cm.memory_budget_bytes)
        states.append(cm.model_state_bytes)
    assert budgets[0] < budgets[1] < budgets[2]
    n0 = sum(model.param_count(k) for k in layout.stages[0])  # stage 0 holds the token table itself
    assert states[0][0] - states[1][0] == pytest.approx(n0 * 8 * (1 - 1 / 4))
    assert states[1][0] - states[2][0] == pytest.approx(n0 * 4 * (1 - 1 / 4))


def test_a_later_stage_with_the_tied_head_pays_for_its_copy_of_the_token_table():
    model = AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb")
    assert model.spec.tie_embeddings
    layout = balanced_layout(model, 2)
    cm = StageCostModel(model, layout, 400 * 2**30)
    last = sum(model.param_count(k) for k in layout.stages[1])
    table = model.spec.vocab_size * model.spec.d_model
    assert cm.model_state_bytes[1] == pytest.approx(model.model_state_bytes(last + table))
    one = StageCostModel(model, balanced_layout(model, 1), 400 * 2**30)  # one stage: the table once
    assert one.model_state_bytes[0] == pytest.approx(model.model_state_bytes(
        sum(layer_param_count(model.spec, k) for k in one.layout.stages[0])))


SIMULATE = ["simulate", "--model", "llama3-70b", "--hardware", "h100-80gb", "--stages", "8", "--replicas", "8",
            "--max-input-len", "4096", "--max-target-len", "256", "--num-batches", "1", "--methods", "dynamic"]


def test_simulate_at_paper_scale_fits_only_with_sharded_states(tmp_path, capsys):
    assert main([*SIMULATE, "--zero", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 143.159 GiB for model states alone" in err[0] and "--zero" in err[0]
    out = tmp_path / "z2.json"
    assert main([*SIMULATE, "--zero", "2", "--json", str(out)]) == 0
    states = json.loads(out.read_text())["model_states"]
    assert states["zero"] == 2 and states["replicas"] == 8
    # simulate prices 16 bytes a parameter unsharded (no autocast copy): 4 + (4 + 8) / 8 = 5.5 under --zero 2
    assert max(states["model_state_gib_per_device"]) == pytest.approx(143.159 * 5.5 / 16, rel=1e-3)
    assert states["activation_budget_gib"] > 0


def test_plan_reports_the_states_per_device(capsys):
    assert main(["plan", "--model", "gpt", "--stages", "2", "--replicas", "4", "--zero", "1", "--num-batches", "1",
                 "--methods", "dynamic"]) == 0
    assert "model states per device (--zero 1, 4 replicas)" in capsys.readouterr().out


def test_train_takes_zero_2_with_a_baseline_and_on_virtual_stages():
    """``--zero 2`` was refused with a baseline method and is not: a baseline's dealt micro-batches are evened
    (``tests/unit/plan/test_equal_counts.py``, trained in ``tests/dist/test_zero.py``), and on virtual stages every replica
    of a device runs replica 0's chunk order (``tests/unit/schedule/test_virtual_lowering.py``, trained in
    ``tests/dist/test_zero.py``)."""
    for method, placement in (("packing", "linear"), ("padding", "auto"), ("dynamic", "interleaved:2"),
                              ("dynamic", "cyclic")):
        cfg = TrainConfig.of(zero=2, replicas=2, stages=2, method=method, placement=placement)
        assert (cfg.zero, cfg.method, cfg.placement) == (2, method, placement)


def test_the_model_states_line_says_one_replica_in_the_singular():
    """``plan --zero 1`` with one replica printed ``(--zero 1, 1 replicas)``."""
    from dynabatch.commands.common import describe_model_states

    states = {"zero": 1, "replicas": 1, "model_state_gib_per_device": [1.0, 2.0], "activation_budget_gib": 3.0}
    assert "(--zero 1, 1 replica)" in describe_model_states(states)
    assert "(--zero 1, 2 replicas)" in describe_model_states({**states, "replicas": 2})
