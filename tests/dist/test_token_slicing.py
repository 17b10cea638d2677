"""Token slicing (TeraPipe) in the runtime: a step with sliced samples equals the unsliced model.

One launch of 4 gloo processes runs :data:`pipeline_harness.SLICED_SCENARIOS`: GPT-2 on 2 and 4
stages, GPipe, 1F1B, adaptive and the per-step choice (``auto``), 2 replicas x 2 stages, a
second AdamW step, and virtual stages (``interleaved:2``: 2 devices x 2 chunks, the slices' chains kept on every
chunk, with 1 replica in the order train_step picks and with 2 replicas in DynaPipe's wait-free cyclic order). Every global batch mixes ordinary micro-batches (padded and packed rows) with
three chains of token slices: one sample cut unevenly with slices of length 1, two rows (one packed
with two samples, one padded) cut into 9 slices, and one sample cut in two. The parent compares, by
HF parameter name, the gradients, parameters and loss with a single-process run of the unsplit model
over the *unsliced* micro-batches (default fp32 tolerances). The same 2-stage 1F1B step with the
carried key/value gradient dropped must differ from it, so the comparison has teeth.
"""

from __future__ import annotations

import pytest
import torch

import pipeline_harness as H

NAMES = list(H.SLICED_SCENARIOS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("slicing"))
    world = max(sc.world_size for sc in H.SLICED_SCENARIOS.values())
    codes, elapsed = H.launch(world, H.sliced_worker, (NAMES, workdir), deadline_s=300)
    assert codes == [0] * world, f"exit codes {codes} after {elapsed:.0f} s\n{H.failures(workdir, world)}"
    out = {name: H.load_results(workdir, sc) for name, sc in H.SLICED_SCENARIOS.items()}
    out["dropped"] = H.load_results(workdir, H.DROP_KV_GRAD, tag="-dropped")
    return out


_REFERENCES: dict = {}


def reference(sc: H.Scenario) -> dict:
    key = (sc.preset, sc.num_steps)
    if key not in _REFERENCES:
        _REFERENCES[key] = H.reference_run(sc, parents=H.sliced_parents)
    return _REFERENCES[key]


def test_the_step_really_has_slices():
    sc = H.SLICED_SCENARIOS[NAMES[0]]
    (mbs,), (links,) = H.sliced_step(sc, 0)
    lengths = [mb.shape[1] for mb, p in zip(mbs, links) if p >= 0 or p in links]
    assert 1 in lengths and sum(p >= 0 for p in links) == 4 + 8 + 1
    assert max(mb.shape[0] for mb, p in zip(mbs, links) if p >= 0) == 2  # several samples per slice
    assert len(mbs) == 3 + 5 + 9 + 2


@pytest.mark.parametrize("name", NAMES)
def test_sliced_gradients_equal_unsliced_reference(runs, name):
    sc = H.SLICED_SCENARIOS[name]
    got, want = runs[name], reference(sc)
    for step in range(sc.num_steps):
        assert got["grads"][step].keys() == want["grads"][step].keys()
        for n, g in want["grads"][step].items():
            torch.testing.assert_close(got["grads"][step][n], g, msg=lambda m: f"step {step} grad {n}: {m}")
        for n, p in want["params"][step].items():
            torch.testing.assert_close(got["params"][step][n], p, msg=lambda m: f"step {step} param {n}: {m}")
        assert got["loss"][step] == pytest.approx(want["loss"][step], rel=1e-5)


def test_dropping_the_carried_key_value_gradient_changes_the_gradients(runs):
    sc = H.DROP_KV_GRAD
    kept, dropped, want = runs[sc.name], runs["dropped"], reference(sc)
    assert dropped["loss"][0] == pytest.approx(want["loss"][0], rel=1e-5)  # the forward is unchanged
    diffs = {n: float((dropped["grads"][0][n] - g).abs().max()) for n, g in want["grads"][0].items()}
    kept_diffs = {n: float((kept["grads"][0][n] - g).abs().max()) for n, g in want["grads"][0].items()}
    assert max(diffs.values()) > 100 * max(max(kept_diffs.values()), 1e-7), (diffs, kept_diffs)
