"""The executor's autocast (bf16 over fp32 master weights): one half-precision copy of the weights per step,
shared by every micro-batch, not one per micro-batch in flight.

On the H200 (2026-12-04) GPT-2 small's dynamic plan of ~85 micro-batches under a GPipe order
measured about 30 GB more saved activations than predicted: each forward, entering autocast on its own,
re-cast every weight, and each micro-batch's graph kept its own bf16 copy until its backward. The step now
runs inside one outer (disabled) autocast region, which keeps autocast's cast cache alive for the step.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from dynabatch.data.collate import collate_causal
from dynabatch.data.sample import TokenizedSample
from dynabatch.models.presets import PAD_ID, build_model
from dynabatch.models.split import build_stages, layout_for, pipeline_spec_for


def _micro_batches(n: int):
    rng = np.random.default_rng(0)
    samples = [TokenizedSample("t", rng.integers(3, 300, 12).astype(np.int32), rng.integers(3, 300, 3).astype(np.int32))
               for _ in range(n)]
    return [collate_causal(samples, [[i]], pad_id=PAD_ID) for i in range(n)]


def _block_weight_bytes_bf16(stage) -> int:
    """bf16 bytes of the blocks' matmul weights: a lower bound of what one forward's casts hold."""
    return sum(p.numel() * 2 for n, p in stage.named_parameters() if p.dim() == 2 and ("attn" in n or "mlp" in n))


def test_micro_batches_in_flight_share_one_bf16_copy_of_the_weights(tmp_path, monkeypatch):
    from dynabatch.engine.dist import init_distributed, shutdown
    from dynabatch.engine.executor import Executor
    from dynabatch.engine.memory import SavedActivationMeter
    from dynabatch.engine.step import micro_batch_shape, step_payloads
    from dynabatch.schedule.step import lower_step as plan_step

    # the meter leaves autocast's weight copies out (model states); count them here, where they are the point
    monkeypatch.setattr(SavedActivationMeter, "_is_weight_cast", lambda self, t: False)

    ctx = init_distributed(1, 1, rank=0, world_size=1, init_method=f"file://{tmp_path}/init", timeout_s=30)
    try:
        model = build_model("gpt2-tiny", vocab_size=320, dropout=0.0, seed=0)
        layout = layout_for(model, 1)
        stage, spec = build_stages(model, layout)[0], pipeline_spec_for(model, layout)
        ex = Executor(stage, ctx, torch.optim.SGD(stage.parameters(), lr=0.0), measure_memory=True,
                      autocast_dtype=torch.bfloat16)
        mbs = _micro_batches(6)
        plan = plan_step([[micro_batch_shape(mb) for mb in mbs]], spec, policy="gpipe")[0]  # every forward first
        inputs = step_payloads({0: plan}, [mbs], spec)[0]

        def run():
            step = ex.run(dataclasses.replace(inputs))
            return step.saved_peak_bytes, {n: p.grad.clone() for n, p in stage.named_parameters()}, step.loss

        shared_peak, shared_grads, shared_loss = run()
        monkeypatch.setattr(Executor, "_step_autocast", lambda self: contextlib.nullcontext())
        own_peak, own_grads, own_loss = run()  # as before: autocast entered per forward only
    finally:
        shutdown()
    assert shared_loss == own_loss
    for n, g in own_grads.items():
        torch.testing.assert_close(shared_grads[n], g, rtol=0, atol=0, msg=n)
    copies = _block_weight_bytes_bf16(stage)
    # per-forward autocast: six micro-batches in flight hold six copies; shared: one
    assert own_peak - shared_peak >= 0.9 * 5 * copies, (own_peak, shared_peak, copies)


def test_the_meter_leaves_autocast_weight_copies_out():
    """Under autocast a linear saves its bf16 weight copy (a view of it) and its input's bf16 cast: the meter
    counts the input's cast (an activation) and not the weight's (a model state, priced as ``cast_copy_bytes``)."""
    from dynabatch.engine.memory import SavedActivationMeter

    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    with SavedActivationMeter(exclude=layer.parameters()) as meter, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).float().sum().backward()
    assert meter.peak_bytes == 8 * 64 * 2  # x's bf16 cast only (the weight's would add 64 * 32 * 2)
    with SavedActivationMeter(exclude=()) as all_saved, torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).float().sum().backward()
    assert all_saved.peak_bytes == 8 * 64 * 2 + 64 * 32 * 2  # not excluded: the weight's copy counts
