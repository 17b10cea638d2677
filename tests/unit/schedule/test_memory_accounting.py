"""Training schedules priced as `dynabatch simulate` prices them (model states, message buffers, send
time), validated with memory on every step, and "does not fit" advice that really fits."""

from __future__ import annotations

import re

import numpy as np
import pytest

from dynabatch.training.config import TrainConfig

GIB = 2**30


def _planner(toy_data, memory_gib: float, policy: str = "adaptive", recompute: str = "auto"):
    from dynabatch.data.batching import GlobalBatcher, LengthLimits
    from dynabatch.models.presets import build_model
    from dynabatch.models.split import layout_for
    from dynabatch.training.planner import StepPlanner
    from dynabatch.training.trainer import planner_cost_model

    cfg = TrainConfig(model="gpt2-tiny", stages=2, policy=policy, global_batch_tokens=8192, max_input_len=128,
                      memory_gib=memory_gib, recompute=recompute)
    model = build_model("gpt2-tiny", vocab_size=toy_data.tokens.vocab_size)
    cost_model = planner_cost_model(cfg, model.config, layout_for(model, 2))
    limits = LengthLimits("gpt2", max_input_len=128, max_target_len=32, max_seq_len=128)
    return StepPlanner(GlobalBatcher(toy_data, limits, token_budget=8192), cfg, cost_model, toy_data.tokens), model


@pytest.fixture(scope="module")
def gpt_data(toy_mixture_dir, byt5):
    import os

    from dynabatch.data.mixture import MixtureSpec
    from dynabatch.data.pipeline import MixtureData

    return MixtureData.load(MixtureSpec.from_file(os.path.join(toy_mixture_dir, "toy.json")), byt5, "gpt2")


def test_planned_training_schedule_fits_once_model_states_count(gpt_data):
    """The trainer's planner schedules within the device memory with model states and message buffers
    counted; a schedule priced without model states (the old training path) overflows the same device."""
    from dynabatch.training.step_score import send_time_of
    from dynabatch.schedule.step import compute_schedule
    from dynabatch.schedule.simulate import simulate, with_message_buffers

    memory = 0.012
    planner, _ = _planner(gpt_data, memory)
    step = planner()
    states = np.array(planner.cost_model.model_state_bytes)
    assert states.max() > 0.3 * memory * GIB  # model states are a large share of this device
    costs = with_message_buffers(step.costs[0])
    send = send_time_of(planner.cost_model)
    planned = simulate(step.schedules[0], costs, model_state_bytes=states, send_time=send)
    assert max(planned.peak_memory_bytes) <= memory * GIB
    assert step.model_state_bytes == tuple(planner.cost_model.model_state_bytes)
    shapes = np.asarray(step.shapes[0], dtype=np.int64).reshape(-1, 3)
    blind = compute_schedule("adaptive", shapes, 2, costs, memory * GIB, send_time=send)  # states left out
    assert max(simulate(blind, costs, model_state_bytes=states).peak_memory_bytes) > memory * GIB


def test_auto_recompute_plans_what_none_refuses_and_is_never_slower(gpt_data):
    """The trainer's planner under --recompute auto: where memory binds it plans steps the partition refuses
    without recomputation (the long samples recompute, or, priced without any, a plan that the simulated schedule,
    which admits micro-batches by their actual memory rather than S in flight, shows within the limit), and wherever none can
    plan, auto's simulated step is not slower."""
    from dynabatch.schedule.simulate import simulate, with_message_buffers

    refused = compared = 0
    for memory in (0.0075, 0.008, 0.009, 0.010, 0.012, 0.02):
        auto = _planner(gpt_data, memory)[0]()
        try:
            none = _planner(gpt_data, memory, recompute="none")[0]()
        except ValueError as e:  # the advice names recomputation, which would have planned it
            assert "alone needs" in str(e) and "pass --recompute auto" in str(e)
            refused += 1
            if auto.recompute_counts.get("full", 0) + auto.recompute_counts.get("selective", 0) == 0:
                for schedule, costs in zip(auto.schedules, auto.costs):
                    assert simulate(schedule, with_message_buffers(costs), model_state_bytes=auto.model_state_bytes,
                                    memory_limit_bytes=memory * GIB).fits_memory
            continue
        compared += 1
        assert auto.predicted_step_s <= none.predicted_step_s * (1 + 1e-9)
    assert refused and compared


def test_training_plans_are_validated_with_model_states(gpt_data):
    """`plan_step` on the training path checks memory on every rank: a GPipe step that fits the buffers and
    activations but not those plus the model states is refused with one line naming the step and stage."""
    from dynabatch.models.split import layout_for, pipeline_spec_for
    from dynabatch.schedule.step import lower_step as plan_step
    from dynabatch.schedule.validate import validate

    planner, model = _planner(gpt_data, 0.012)
    step = planner()
    spec = pipeline_spec_for(model, layout_for(model, 2), "float32")
    costs = step.costs[0]
    shapes = [np.asarray(step.shapes[0], dtype=np.int64).reshape(-1, 3)]
    plans = plan_step(shapes, spec, policy="gpipe", costs=[costs])  # no memory limit: no memory check
    report = validate(plans, stored_bytes={0: costs.stored_bytes}, peak_bytes={0: costs.peak_bytes})
    peaks = np.array([report.peak_memory_bytes[r] for r in range(2)])  # (S,) buffers + activations per stage
    states = np.array(step.model_state_bytes)
    tight = peaks * 1.01
    plan_step(shapes, spec, policy="gpipe", costs=[costs], memory_limit_bytes=tight + states, model_state_bytes=states)
    plan_step(shapes, spec, policy="gpipe", costs=[costs], memory_limit_bytes=tight)  # states not counted: fits
    with pytest.raises(ValueError, match=r"step 7: the gpipe schedule does not fit the device memory .* > limit "
                                         r".*stage 0.*use --policy adaptive or auto"):
        plan_step(shapes, spec, policy="gpipe", step=7, costs=[costs], memory_limit_bytes=tight,
                  model_state_bytes=states)


def test_does_not_fit_advice_gives_a_device_memory_that_fits(gpt_data):
    """The single-sample error names the --memory-gib that fits (model states included); planning with
    exactly that value succeeds, while the bare activation figure the old message gave does not."""
    with pytest.raises(ValueError) as info:
        _planner(gpt_data, 0.006)[0]()
    msg = str(info.value)
    assert "alone needs" in msg and "model states" in msg and "recomput" not in msg  # auto already recomputes
    activations = float(re.search(r"smallest budget that fits every sample is ([\d.]+) GiB", msg).group(1))
    device = float(re.search(r"\(--memory-gib\) of at least ([\d.]+) GiB", msg).group(1))
    assert device > activations
    planner, _ = _planner(gpt_data, device)
    planner()  # fits
    with pytest.raises(ValueError, match=r"needs [\d.]+ GiB"):  # the old advice: model states left out
        _planner(gpt_data, activations + 1e-3)[0]()


MEMORY_RUNS = ([(m, r, "segments", "fp32") for m in ("gpt2-tiny", "t5-tiny", "llama") for r in ("auto", "selective", "full")]
               + [(m, r, "dense", "fp32") for m in ("gpt2-tiny", "t5-tiny") for r in ("auto", "full")]
               + [(m, r, "segments", "bf16") for m in ("gpt2-tiny", "t5-tiny", "llama") for r in ("auto", "full")]
               + [("t5-tiny", "selective", "segments", "bf16")])


@pytest.mark.parametrize("model, recompute, attention, dtype", MEMORY_RUNS)
def test_measured_saved_activations_match_the_prediction(tmp_path, toy_mixture_dir, byt5, model, recompute, attention,
                                                         dtype, capsys, monkeypatch):
    """metrics.jsonl logs, per stage, the bytes autograd kept for backward (measured by the executor's
    SavedActivationMeter) next to the schedule's simulated peak of stored activation bytes: within 10%
    for GPT-2 and T5 (measured 1.00-1.04x), also with every block recomputed (full: 1.01-1.04x) and with the
    attention cores recomputed (selective: 1.00x; it was 1.6x for GPT-2 while the model priced score tensors
    that the per-segment SDPA never kept and GPT-2's gelu_new as two FFN-wide tensors instead of five; the
    default auto recomputes nothing here). T5: 1.00x in all three modes since the model counts what HF's RMSNorm
    keeps (its fp32 normalised copy), cross-attention on the flash kernel (no scores; only self-attention carries
    the bias that sends SDPA to its math path on CPU) and the position-bias window kept once per stack under
    selective and full (selective was 1.23x, full right only by offsetting errors). A tiny Llama folder (RMSNorm,
    grouped-query attention, gated SiLU): 1.01-1.06x (1.11-1.19x before RMSNorm's copy was counted). The dense
    reference path: 1.00-1.01x in every mode, since the model knows a causal stage's SDPA keeps the 4-D mask and
    no scores, and T5's checkpointed blocks keep the masks (before: GPT-2 0.71x / 1.37x, T5 full 1.50x). Under bf16
    autocast (what GPUs run): 0.93-1.06x, since the model knows the residual stream and norms stay fp32, each
    projection saves its own bf16 cast of an fp32 input, T5's unfused attention runs in fp32 and its FFN casts
    through the fp32 down projection, and the meter leaves autocast's weight copies (model states) out (before: T5
    1.39-1.66x, GPT-2 1.08-1.20x; Llama did not run). `scripts/memory_check.py` runs the same matrix.
    Packed rows (several samples in one padding-free row: a packing_free plan, or --pack-rows auto) measure
    1.10-1.11x their prediction (gpt2-tiny bf16, 2026-12-05), outside this bound: the runs here plan with the DP
    alone (--plan-candidates off), whose rows on CPU hold one sample each."""
    import json
    import os

    from dynabatch.cli import main

    if model == "llama":
        from family_configs import build, decoder_config

        model = str(tmp_path / "llama")
        build(decoder_config("llama", vocab_size=512)).save_pretrained(model)
        byt5.save_pretrained(model)
    out = tmp_path / "run"
    # In this process (a world of one, as the command started on its own): the same run without the 5-6 s of
    # importing torch and transformers afresh and tearing them down that a `python -m dynabatch` process costs.
    monkeypatch.delenv("RANK", raising=False)
    code = main(["train", "--model", model, "--tokenizer", "byt5", "--mixture", os.path.join(toy_mixture_dir, "toy.json"),
                 "--global-batch-tokens", "4096", "--max-input-len", "256", "--max-target-len", "64", "--steps", "3",
                 "--log-every", "0", "--no-timeline", "--output-dir", str(out), "--recompute", recompute,
                 "--attention", attention, "--dtype", dtype,
                 "--plan-candidates", "off"])  # the DP's plans: one sample per row on CPU (packed rows: see the note below)
    assert code == 0, capsys.readouterr().err[-2000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    for r in records:
        measured, predicted = r["memory_measured_bytes"], r["memory_predicted_bytes"]
        assert len(measured) == len(predicted) == 1 and measured[0] > 0
        assert set(r["recompute"]) == (set() if recompute == "auto" else {recompute})
        assert measured[0] == pytest.approx(predicted[0], rel=0.10), (measured, predicted)


def test_plan_and_simulate_take_memory_gib(capsys, tmp_path):
    """`--memory-gib` overrides the hardware preset's device memory: a budget below one sample's need is
    the documented error, with the device memory that fits; a bad value is one line. With the default
    `--recompute auto` the samples that do not fit whole run with activation recomputation instead.
    A lengths file, not the built-in mixture (no tokenizing): two samples of 1,000-1,100 tokens among short
    ones; whole, the longer needs 8.4 GiB with gpt-1.3b's model states, recomputed both fit in 8 GiB."""
    from dynabatch.cli import main

    rng = np.random.default_rng(0)
    e = np.concatenate([[1100, 1000], rng.integers(50, 400, 80)])
    lengths = str(tmp_path / "lengths.npz")
    np.savez(lengths, input_len=e, target_len=np.ones_like(e))
    args = ["simulate", "--lengths", lengths, "--model", "gpt", "--preset", "gpt-1.3b", "--stages", "4",
            "--max-input-len", "2048", "--num-batches", "1", "--global-batch-tokens", "16384", "--json"]
    assert main([*args, "--memory-gib", "80"]) == 0
    capsys.readouterr()
    assert main([*args, "--memory-gib", "8", "--methods", "dynamic"]) == 0  # auto: the long samples recompute
    capsys.readouterr()
    assert main([*args, "--memory-gib", "8", "--methods", "dynamic", "--recompute", "none"]) == 2
    err = capsys.readouterr().err
    assert "alone needs" in err and "(--memory-gib) of at least" in err
    assert main([*args, "--memory-gib", "nan"]) == 2
    assert "--memory-gib must be a finite number > 0" in capsys.readouterr().err


def test_the_planners_bound_counts_the_loaded_inputs(tmp_path, toy_mixture_dir, capsys):
    """The validator counts a micro-batch's loaded inputs (ids, segment and position ids, labels) from LOAD to
    FREE; the planner's bound must too. With one stage there are no message buffers, and before the loads were
    priced gpt2-tiny at 0.0135 GiB planned a micro-batch 16 kB over the budget the validator then refused
    ("the auto schedule does not fit the device memory ... micro-batches in flight: [0]"), while 0.013 and
    0.014 GiB trained."""
    import json
    import os

    from dynabatch.cli import main
    from dynabatch.cost.stages import LOAD_BYTES_PER_TOKEN, StageCostModel
    from dynabatch.cost.layer_split import balanced_layout
    from dynabatch.cost.analytic import AnalyticCostModel

    model = AnalyticCostModel.from_names("gpt-350m", "a100-40gb")
    stages = StageCostModel(model, balanced_layout(model, 1), 40 * 2**30)
    b, e = np.array([3.0]), np.array([500.0])
    costs = stages.per_stage(b, e, np.zeros(1))
    _, stored, _ = stages.evaluate(b, e, np.zeros(1))
    assert costs.load_bytes[0, 0] == LOAD_BYTES_PER_TOKEN * 3 * 500
    assert stored[0] == costs.stored_bytes[0, 0] + costs.load_bytes[0, 0]  # one stage: no message buffers
    out = tmp_path / "run"
    code = main(["train", "--model", "gpt2-tiny", "--tokenizer", "byt5", "--global-batch-tokens", "2048",
                 "--mixture", os.path.join(toy_mixture_dir, "toy.json"), "--max-input-len", "512", "--steps", "2",
                 "--memory-gib", "0.0135", "--output-dir", str(out), "--log-every", "0", "--no-timeline"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert len([json.loads(line) for line in open(out / "metrics.jsonl")]) == 2
