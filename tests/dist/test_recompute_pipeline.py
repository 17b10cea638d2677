"""Activation recomputation in gloo pipelines: plans that recompute train exactly like the unsplit model.

One launch of 2 processes runs a GPT-2 (1F1B), a T5 (GPipe) and a token-sliced Llama (GQA, 1F1B) step on 2
stages, each rank's plan rewritten to recompute per micro-batch (``full``, ``selective``, ``none`` in turn,
shifted by the stage, so neighbouring stages run different modes for one micro-batch). The parent compares
gradients, parameters and losses by HF parameter name with the single-process unsplit model (default fp32
tolerances; the plain runs' check, :mod:`test_pipeline_training`), and the workers' checkpoint counts
show that the modes ran.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import pipeline_harness as H

SCENARIOS = {
    "gpt2-S2xR1-1f1b-1step": (H.SCENARIOS, H.plain_step),
    "t5-S2xR1-gpipe-1step": (H.SCENARIOS, H.plain_step),
    "sliced-llama-S2xR1-1f1b-1step": (H.LLAMA_SCENARIOS, H.sliced_step),
}
TAG = "-recompute"
MODES = ("full", "selective", "none")


def recompute_worker(rank: int, workdir: str) -> None:
    """Every scenario with each plan's ``recompute`` set (module docstring); writes the rank's checkpoint count."""
    H._setup_worker()
    try:
        from dynabatch.models import recompute
        from dynabatch.engine.executor import Executor

        calls = [0]
        real_checkpoint, real_run = recompute.checkpoint, Executor.run

        def counting_checkpoint(*args, **kwargs):
            calls[0] += 1
            return real_checkpoint(*args, **kwargs)

        def run(self, inputs):
            plan = inputs.plan
            modes = tuple(MODES[(m + plan.stage) % len(MODES)] for m in range(plan.num_micro_batches))
            return real_run(self, dataclasses.replace(inputs, plan=dataclasses.replace(plan, recompute=modes)))

        recompute.checkpoint, Executor.run = counting_checkpoint, run
        for name, (table, make_step) in SCENARIOS.items():
            H.run_scenario(rank, table[name], workdir, make_step=make_step, tag=TAG)
        with open(os.path.join(workdir, f"checkpoints.rank{rank}"), "w") as f:
            f.write(str(calls[0]))
    except BaseException as e:  # noqa: BLE001
        H._report_failure(workdir, rank, e)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("recompute"))
    codes, elapsed = H.launch(2, recompute_worker, (workdir,), deadline_s=300)
    assert codes == [0, 0], f"exit codes {codes} after {elapsed:.0f} s\n{H.failures(workdir, 2)}"
    out = {name: H.load_results(workdir, table[name], tag=TAG) for name, (table, _) in SCENARIOS.items()}
    out["checkpoints"] = [int(open(os.path.join(workdir, f"checkpoints.rank{r}")).read()) for r in range(2)]
    return out


def test_the_modes_ran_on_every_rank(runs):
    assert all(n > 0 for n in runs["checkpoints"]), runs["checkpoints"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_recomputing_pipeline_equals_unsplit_model(runs, name):
    table, make_step = SCENARIOS[name]
    sc, got = table[name], runs[name]
    want = H.reference_run(sc, parents=H.sliced_parents if make_step is H.sliced_step else None)
    for key in ("grads", "params"):
        assert got[key][0].keys() == want[key][0].keys()
        for n, t in want[key][0].items():
            torch.testing.assert_close(got[key][0][n], t, msg=lambda m: f"{name} {key} {n}: {m}")
    assert got["loss"][0] == pytest.approx(want["loss"][0], rel=1e-5)
