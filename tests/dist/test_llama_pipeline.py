"""Llama-style decoders (Llama with an untied head, Qwen2 with Q/K/V biases and a tied head, both with
grouped-query attention) trained as pipelines on CPU/gloo equal the unsplit HF model.

One launch of 4 processes runs :data:`pipeline_harness.LLAMA_SCENARIOS`: S = 2 and 4 stages, gpipe,
1f1b and adaptive, 2 replicas x 2 stages over 3 AdamW steps, plain global batches (padded and packed
rows: rotary positions restart in every packed sample, and every stage loads them) and sliced ones
(ordinary micro-batches mixed with chains of token slices: the carried keys/values have the GQA shape
``(B, kv_heads, C, head_dim)`` and the slices' rotary positions continue the sample's). The parent
compares gradients, parameters and losses, by HF parameter name, with a single-process run of the
unsplit model over the unsliced micro-batches (default fp32 tolerances).
"""

from __future__ import annotations

import pytest
import torch

import pipeline_harness as H

NAMES = list(H.LLAMA_SCENARIOS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("llama"))
    world = max(sc.world_size for sc in H.LLAMA_SCENARIOS.values())
    codes, elapsed = H.launch(world, H.llama_worker, (NAMES, workdir), deadline_s=400)
    assert codes == [0] * world, f"exit codes {codes} after {elapsed:.0f} s\n{H.failures(workdir, world)}"
    return {name: H.load_results(workdir, sc) for name, sc in H.LLAMA_SCENARIOS.items()}


def _reference(name: str) -> dict:
    sc = H.LLAMA_SCENARIOS[name]
    return H.reference_run(sc, parents=H.sliced_parents if name.startswith("sliced-") else None)


@pytest.mark.parametrize("name", NAMES)
def test_llama_pipeline_equals_unsplit_model(runs, name):
    sc, got = H.LLAMA_SCENARIOS[name], runs[name]
    want = _reference(name)
    for step in range(sc.num_steps):
        for key in ("grads", "params"):
            assert got[key][step].keys() == want[key][step].keys()
            for n, t in want[key][step].items():
                torch.testing.assert_close(got[key][step][n], t, msg=lambda m: f"{name} step {step} {key} {n}: {m}")
        assert got["loss"][step] == pytest.approx(want["loss"][step], rel=1e-6)


def test_sliced_steps_really_carry_gqa_keys():
    sc = H.LLAMA_SCENARIOS["sliced-qwen2-S4xR1-adaptive-1step"]
    model = H.make_model(sc)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    (mbs,), (links,) = H.sliced_step(sc, 0)
    assert sum(p >= 0 for p in links) == 4 + 8 + 1  # slices that continue a chain
