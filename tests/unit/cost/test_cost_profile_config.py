"""`TrainConfig.cost_profile`: the planner's stage cost model runs on the profile's tables; a profile of a
different model config is a clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_cost_tables import synthetic_profile

from dynabatch.training.config import TrainConfig
from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.planner_model import ProfiledLayerModel
from dynabatch.cost.stages import in_flight_buffer_bytes
from dynabatch.models.presets import build_model
from dynabatch.models.split import layout_for
from dynabatch.training.trainer import planner_cost_model


@pytest.fixture(scope="module")
def t5_tiny():
    model = build_model("t5-tiny")
    return model.config, layout_for(model, 2)


def _profile(tmp_path, config: dict) -> str:
    p = synthetic_profile("t5")
    p["model"]["config"] = config
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(p))
    return str(path)


def test_cost_profile_plans_with_measured_tables(tmp_path, t5_tiny):
    config, layout = t5_tiny
    assert isinstance(planner_cost_model(TrainConfig(stages=2), config, layout).model, AnalyticCostModel)
    cfg = TrainConfig(stages=2, cost_profile=_profile(tmp_path, config.to_dict()), max_input_len=256)
    cost_model = planner_cost_model(cfg, config, layout)
    assert isinstance(cost_model.model, ProfiledLayerModel)
    b, e, d = np.array([1.0, 4.0, 16.0]), np.array([20.0, 100.0, 200.0]), np.array([10.0, 50.0, 100.0])
    got = cost_model.evaluate(b, e, d)
    want = list(cost_model.model.bottleneck_cost(layout.stages, b, e, d))
    want[1] = want[1] + in_flight_buffer_bytes(cost_model.per_stage(b, e, d)).max(axis=0)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    assert np.all(got[0] > 0) and np.all(got[0] < 1.0)  # the synthetic tables' seconds, not the analytic ones


def test_mismatched_cost_profile_is_a_clear_error(tmp_path, t5_tiny):
    config, layout = t5_tiny
    other = {**config.to_dict(), "d_model": config.d_model * 2, "vocab_size": config.vocab_size + 1}
    cfg = TrainConfig(stages=2, cost_profile=_profile(tmp_path, other), max_input_len=256)
    with pytest.raises(ValueError, match=r"different model config.*vocab_size.*d_model: profile 128 != model 64"):
        planner_cost_model(cfg, config, layout)


def test_a_profile_of_another_model_family_says_so_alone(tmp_path, t5_tiny):
    """A GPT-2 profile given to a T5 run listed every field of both families (``d_model: profile None != model 64;
    ... n_embd: profile 64 != model None; ...``, 16 of them) and ended with ``--model ...``; it now names the two
    families and the model to profile."""
    config, layout = t5_tiny
    gpt = {"model_type": "gpt2", "vocab_size": config.vocab_size, "n_embd": 64, "n_layer": 2, "n_head": 4}
    path = _profile(tmp_path, gpt)
    profile = json.loads(open(path).read())
    profile["model"]["name"] = "gpt2-tiny"
    open(path, "w").write(json.dumps(profile))
    cfg = TrainConfig(model="t5-tiny", stages=2, cost_profile=path, max_input_len=256)
    with pytest.raises(ValueError) as e:
        planner_cost_model(cfg, config, layout)
    assert str(e.value) == (f"cost profile {path} was measured on a gpt2 model (gpt2-tiny), and this run's model "
                            "(t5-tiny) is a t5; profile this model with `dynabatch profile --model t5-tiny`")


def test_a_profile_whose_grid_stops_below_the_length_limits_is_one_line(tmp_path, t5_tiny):
    config, layout = t5_tiny
    path = _profile(tmp_path, config.to_dict())  # encoder lengths up to 256, decoder lengths up to 128
    cfg = TrainConfig(stages=2, cost_profile=path, max_input_len=300, max_target_len=200)
    with pytest.raises(ValueError) as e:
        planner_cost_model(cfg, config, layout)
    assert str(e.value) == (
        f"cost profile {path} covers encoder lengths up to 256 and decoder lengths up to 128 (batch sizes up to 16), "
        "but this run's samples reach --max-input-len 300 and --max-target-len 200; re-profile with `dynabatch "
        "profile ... --seq-lengths 16,32,64,128,256,300 --dec-lengths 8,32,128,200` covering them, or lower "
        "--max-input-len to 256 and --max-target-len to 128")
    planner_cost_model(TrainConfig(stages=2, cost_profile=path, max_input_len=256, max_target_len=128), config, layout)


def test_train_refuses_a_short_profile_before_anything_loads(tmp_path, capsys):
    from dynabatch.cli import main

    path = tmp_path / "gpt.json"
    path.write_text(json.dumps(synthetic_profile("gpt2")))  # lengths up to 256
    code = main(["train", "--model", "gpt2-tiny", "--cost-profile", str(path), "--max-steps", "1",
                 "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        f"dynabatch train: error: cost profile {path} covers lengths up to 256 (batch sizes up to 16), but this run's "
        "samples reach --max-input-len 512; re-profile with `dynabatch profile ... --seq-lengths 16,32,64,128,256,512` "
        "covering them, or lower --max-input-len to 256"]
    assert not (tmp_path / "run").exists()


def test_efficiencies_beyond_the_profiles_batch_sizes_are_not_reported(tmp_path, capsys):
    """A profile that times one sample a micro-batch only (every larger batch size out of memory) trains, and the
    ideal step of amortised copies, which it cannot price, gives no efficiency instead of one of about 1e30."""
    from dynabatch.cli import main

    profile = synthetic_profile("gpt2", oom_at=(2, 1))
    profile["model"]["config"] = build_model("gpt2-tiny").config.to_dict()
    path = tmp_path / "gpt.json"
    path.write_text(json.dumps(profile))
    run = tmp_path / "run"
    code = main(["train", "--model", "gpt2-tiny", "--cost-profile", str(path), "--max-steps", "2", "--max-input-len",
                 "128", "--max-target-len", "64", "--global-batch-tokens", "1024", "--no-timeline",
                 "--output-dir", str(run)])
    assert code == 0, capsys.readouterr().err[-3000:]
    with open(run / "metrics.jsonl", encoding="utf-8") as f:
        steps = [r for r in map(json.loads, f) if "kind" not in r]
    assert len(steps) == 2 and all(r["efficiency_balanced"] is None and r["efficiency_amortised"] is None
                                   for r in steps)
    assert all(0 < x <= 1 for r in steps for x in r["device_busy_fraction"])
