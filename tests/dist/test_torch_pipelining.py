"""The torch.distributed.pipelining peer (``dynabatch bench`` method ``pipelining``) trains like our executor.

One launch of 2 gloo processes; for GPT-2 and T5 (2 stages, tied embeddings, T5's relative-position
tables on both stages), every rank builds its stage twice from the same seeded model, then runs one
clipped AdamW step of the same packed micro-batches with our executor (``train_step``, 1F1B) and with
:class:`~dynabatch.engine.torch_pipelining.TorchPipeliningPeer` (``Schedule1F1B``, the last
micro-batch padded to the fixed row count with empty rows). Loss, gradient norm, the clipped
gradients of every parameter (tied copies summed across stages) and the updated parameters must match.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import pipeline_harness as H

ROWS = 3


def _packed(family: str):
    from dynabatch.data.baselines import make_batcher
    from dynabatch.data.batching import LengthLimits
    from dynabatch.data.sample import GlobalBatch
    from dynabatch.data.tokenize import TokenizerInfo
    from dynabatch.models.presets import PAD_ID

    samples, _ = H.step_batch(family, seed=5, step=0)
    limits = LengthLimits(family, max_input_len=24, max_target_len=16, max_seq_len=24)
    info = TokenizerInfo(pad_id=PAD_ID, eos_id=1, decoder_start_id=PAD_ID, vocab_size=H.VOCAB)
    batch = GlobalBatch(step=0, samples=tuple(samples), num_truncated=0)
    return make_batcher("packing", limits, info, rows_per_micro_batch=ROWS)(batch)


def worker(rank: int, workdir: str) -> None:
    H._setup_worker()
    try:
        for family in ("gpt2", "t5"):
            _run(rank, family, workdir)
    except BaseException as e:  # noqa: BLE001
        H._report_failure(workdir, rank, e)


def _run(rank: int, family: str, workdir: str) -> None:
    from dynabatch.models.split import build_stage, layout_for, pipeline_spec_for
    from dynabatch.engine.dist import init_distributed, shutdown
    from dynabatch.engine.executor import Executor
    from dynabatch.engine.step import train_step
    from dynabatch.engine.torch_pipelining import TorchPipeliningPeer, fixed_shape_inputs

    sc = H.Scenario(f"peer-{family}", family, f"{family}-tiny", 2)
    ctx = init_distributed(2, 1, rank=rank, world_size=2, init_method=f"file://{workdir}/{family}.init", timeout_s=60)
    model = H.make_model(sc)
    layout = layout_for(model, 2)
    spec = pipeline_spec_for(model, layout, "float32")
    ours, theirs = (build_stage(model, layout, ctx.stage_index) for _ in range(2))
    names = dict(ours.parameter_map)
    opt_ours, _ = H.make_optimizer(ours.parameters(), 1)
    opt_theirs, _ = H.make_optimizer(theirs.parameters(), 1)
    ex = Executor(ours, ctx, opt_ours, max_grad_norm=0.5)
    peer = TorchPipeliningPeer(theirs, spec, ctx, opt_theirs, max_grad_norm=0.5)
    mbs = _packed(family)
    tokens = sum(mb.num_loss_tokens for mb in mbs)
    result = train_step(ex, ctx, 0, [mbs] if ctx.is_planner else None, spec=spec, policy="1f1b")
    shape = (ROWS, *mbs[0].shape[1:], 0)[:3]
    inputs, num = fixed_shape_inputs(mbs, spec, ROWS)
    assert num == len(mbs) and inputs["labels"].shape[0] == num * ROWS
    loss = peer.step(num, shape, tokens, inputs if ctx.stage_index == 0 else None)
    record = {
        "num_micro_batches": len(mbs), "rows": [mb.shape[0] for mb in mbs],
        "loss": (result.loss, loss), "grad_norm": (result.grad_norm, peer.grad_norm),
        "grads": [{names[n]: p.grad.clone() for n, p in s.named_parameters()} for s in (ours, theirs)],
        "params": [{names[n]: p.detach().clone() for n, p in s.named_parameters()} for s in (ours, theirs)],
    }
    torch.save(record, os.path.join(workdir, f"{family}.rank{rank}.pt"))
    shutdown()


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("peer"))
    codes, elapsed = H.launch(2, worker, (workdir,), deadline_s=240)
    assert codes == [0, 0], f"exit codes {codes} after {elapsed:.0f} s\n{H.failures(workdir, 2)}"
    return {f: [torch.load(os.path.join(workdir, f"{f}.rank{r}.pt"), weights_only=False) for r in range(2)]
            for f in ("gpt2", "t5")}


@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_pipelining_peer_matches_executor(records, family):
    first, last = records[family]
    assert first["num_micro_batches"] >= 3 and first["rows"][-1] < ROWS  # a padded last micro-batch
    for rec in (first, last):
        ours_loss, theirs_loss = rec["loss"]
        assert np.isfinite(ours_loss) and theirs_loss == pytest.approx(ours_loss, rel=1e-5)
        ours_norm, theirs_norm = rec["grad_norm"]
        assert ours_norm > 0.5  # the clip is active
        assert theirs_norm == pytest.approx(ours_norm, rel=1e-5)
        for what in ("grads", "params"):
            ours, theirs = rec[what]
            assert ours.keys() == theirs.keys()
            for name in ours:
                torch.testing.assert_close(theirs[name], ours[name], rtol=1e-4, atol=1e-6, msg=f"{family} {what} {name}")
    # tied copies (the token table on both stages) stayed equal after the summed-gradient step
    shared = set(first["params"][1]) & set(last["params"][1])
    assert shared
    for name in shared:
        torch.testing.assert_close(first["params"][1][name], last["params"][1][name], rtol=0, atol=0)
