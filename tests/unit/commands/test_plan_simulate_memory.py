"""``plan`` and ``simulate`` judge memory with one check (:mod:`dynabatch.commands.scheduled`: the simulated peak of
the schedule ``choose_schedule`` gives a plan), choose a dynamic method only among those that fit, and warn as
``train`` does when ``--zero`` has one replica to shard across."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dynabatch.cli import main
from dynabatch.commands import plan as plan_command
from dynabatch.commands import simulate as simulate_command
from dynabatch.cost.model_states import describe_zero

GPT = ["--model", "gpt", "--stages", "4", "--lengths", "data/heavy_tail_2048.npz", "--max-input-len", "2048",
       "--num-batches", "1"]


def _json(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("memory_gib, token_budget_fits", [("10.5", True), ("10.4", False)])
def test_plan_and_simulate_agree_on_whether_a_plan_fits_near_the_limit(memory_gib, token_budget_fits, capsys):
    """GPT-1.3B on the 2,048-token heavy tail: ``token_budget``'s schedule peaks at 9.44 GiB under the 9.45 GiB
    limit of 10.5 GiB (10% kept free), and at 9.364 GiB, just over the 9.36 GiB of 10.4 GiB; ``padding``'s far over
    both. The two commands plan the baselines alike and check them alike: the same peak, the same verdict (before,
    plan's ``S x stored + peak`` bound refused ``padding`` and ``packing_free`` at 40 GiB where simulate ran them)."""
    argv = [*GPT, "--memory-gib", memory_gib, "--methods", "token_budget,padding"]
    planned = _json(capsys, ["plan", *argv])
    simulated = _json(capsys, ["simulate", *argv])
    assert planned["memory_limit_gib"] == pytest.approx(simulated["memory_limit_gib"])
    for method in ("token_budget", "padding"):
        p, s = planned["methods"][method], simulated["methods"][method]
        assert p["fits_memory"] == s["fits_memory"]
        assert p["peak_memory_gib"] == pytest.approx(s["peak_memory_gib"])
    budget = planned["methods"]["token_budget"]
    assert budget["fits_memory"] is token_budget_fits
    assert abs(budget["peak_memory_gib"] - planned["memory_limit_gib"]) < 0.02  # near the limit
    assert not planned["methods"]["padding"]["fits_memory"]


def _without_fit(run, unfit: set[str], row_key):
    """``run`` (plan's ``plan_method`` or simulate's ``simulate_method``) whose result for a method in ``unfit``
    is marked as not fitting the memory (what a variant whose schedule overflows reports)."""

    def wrapped(method, *a, **k):
        row = run(method, *a, **k)
        if method not in unfit:
            return row
        return {**row, "fits_memory": False} if row_key else dataclasses.replace(row, fits_memory=False)

    return wrapped


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_the_dynamic_method_is_chosen_among_those_that_fit(command, capsys, monkeypatch):
    """The faster of ``dynamic`` and ``dynamic_sliced`` is taken only among those that fit; when neither fits,
    none is chosen, no speedup is reported and one plain line says so."""
    module, name = (plan_command, "plan_method") if command == "plan" else (simulate_command, "simulate_method")
    real = getattr(module, name)
    argv = [command, *GPT, "--methods", "dynamic,dynamic_sliced,token_budget"]
    if command == "simulate":
        argv += ["--search-steps", "2"]
    step = "predicted_step_s" if command == "plan" else "step_s"
    monkeypatch.setattr(module, name, _without_fit(real, {"dynamic"}, command == "plan"))
    out = _json(capsys, argv)
    assert not out["methods"]["dynamic"]["fits_memory"] and out["methods"]["dynamic_sliced"]["fits_memory"]
    assert out["dynamic_method"] == "dynamic_sliced" and out["dynamic_methods_compared"] == "fitting"
    ratio = "dynamic_speedup_vs_best_baseline" if command == "plan" else "dynamic_throughput_vs_best_baseline"
    assert out[ratio] is not None
    if command == "plan":
        assert out[ratio] == pytest.approx(out["methods"]["token_budget"][step] / out["methods"]["dynamic_sliced"][step])

    monkeypatch.setattr(module, name, _without_fit(real, {"dynamic", "dynamic_sliced"}, command == "plan"))
    out = _json(capsys, argv)
    assert out["dynamic_method"] is None and out["dynamic_methods_compared"] == "none fits" and out[ratio] is None
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert ("no dynamic method (dynamic, dynamic_sliced) fits the memory: none is chosen and no speedup over the "
            "baselines is reported") in table
    assert " vs best baseline" not in table


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_zero_with_one_replica_warns_as_train_does(command, capsys):
    argv = [command, *GPT, "--methods", "token_budget", "--search-steps", "1"][: None if command == "simulate" else -2]
    assert main([*argv, "--zero", "1"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: {describe_zero(1, 1)}"]
    assert "--zero 1 with one replica: there is nothing to shard" in err[0]
    assert main([*argv, "--zero", "2", "--replicas", "2"]) == 0
    assert capsys.readouterr().err.strip() == ""


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_dynamic_that_cannot_plan_a_sample_is_left_out_beside_dynamic_sliced(command, capsys, monkeypatch):
    """A sample the whole-sample planner cannot admit even alone (the planner's ``ValueError``, as on the 32k long
    tail at 40 GiB) no longer ends a run that compares ``dynamic_sliced`` too: ``dynamic`` does not fit, so it is
    left out with one warning line and ``dynamic_sliced`` is the one chosen; without ``dynamic_sliced`` the error
    stands (one line, exit 2)."""
    module, name = (plan_command, "plan_method") if command == "plan" else (simulate_command, "simulate_method")
    real = getattr(module, name)

    def refusing(method, *a, **k):
        if method == "dynamic":
            raise ValueError("sample 3 of global batch 0 alone needs 9 GiB of activation memory")
        return real(method, *a, **k)

    monkeypatch.setattr(module, name, refusing)
    argv = [command, *GPT, "--methods", "dynamic,dynamic_sliced,token_budget"]
    out = _json(capsys, argv)
    assert "dynamic" not in out["methods"] and out["dynamic_method"] == "dynamic_sliced"
    assert list(out["left_out"]) == ["dynamic"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "warning: dynamic does not fit the memory and is left out (dynamic_sliced cuts such samples into token "
        "slices): sample 3 of global batch 0 alone needs 9 GiB of activation memory"]
    assert "dynamic_sliced vs best baseline" in captured.out
    assert main([command, *GPT, "--methods", "dynamic,token_budget"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "alone needs 9 GiB" in err[0]
