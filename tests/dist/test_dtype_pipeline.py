"""``--dtype bf16`` / ``fp16`` pipelines on CPU (gloo): 2-stage GPT-2 and T5 steps, a token-sliced GPT-2 step and
fp16 with loss scaling, each against the fp32 unsplit HF model over the same micro-batches.

One launch of 2 processes runs :data:`pipeline_harness.DTYPE_SCENARIOS`. The stages' layers must really compute
in the 16-bit type (forward hooks record the dtypes), activations travel in fp32 between the stages, and the
losses and gradient norms stay close to fp32 (a loose tolerance: 16-bit rounding, not a bug, separates them).
"""

from __future__ import annotations

import math

import pytest

import pipeline_harness as H

NAMES = list(H.DTYPE_SCENARIOS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("dtype"))
    codes, elapsed = H.launch(2, H.dtype_worker, (NAMES, workdir), deadline_s=300)
    assert codes == [0, 0], f"exit codes {codes} after {elapsed:.0f} s\n{H.failures(workdir, 2)}"
    return {name: H.load_results(workdir, sc) for name, sc in H.DTYPE_SCENARIOS.items()}


@pytest.mark.parametrize("name", NAMES)
def test_16_bit_pipeline_trains_close_to_fp32(runs, name):
    sc, got = H.DTYPE_SCENARIOS[name], runs[name]
    want = H.reference_run(sc, parents=H.sliced_parents if "sliced-" in name else None)  # fp32, unsplit
    half = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[sc.dtype]
    for rank, record in enumerate(got["records"]):
        assert half in record["compute_dtypes"], f"rank {rank} computed in {record['compute_dtypes']}"
    assert all(math.isfinite(x) for x in got["loss"] + got["grad_norm"])
    assert got["loss"][0] == pytest.approx(want["loss"][0], rel=5e-2)
    assert got["grad_norm"][0] == pytest.approx(want["grad_norm"][0], rel=1e-1)  # fp16: unscaled before the norm
    scales = got["records"][0]["loss_scale"]
    assert scales == ([2.0**16] * sc.num_steps if sc.dtype == "fp16" else [None] * sc.num_steps)
