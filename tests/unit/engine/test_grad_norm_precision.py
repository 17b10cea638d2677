"""The gradient norm of ``--zero 0`` is summed in float64, as ``--zero 1``/``2``'s shards are.

torch's fp32 ``_foreach_norm`` on CPU lost 2e-4 (relative) on a 2.1M-element gradient like gpt2-tiny's 8,192 x 256
token table and 1e-3 on a 12.8M-element one, so a 2 x 2 gpt2-tiny run (its builtin tokenizer) logged gradient norms
1.6e-5-2.2e-5 apart between ``--zero 0`` and ``--zero 1``/``2`` (whose float64 shard sums are exact), and the default
``--max-grad-norm`` clipped ``--zero 0`` by another factor (its losses from step 1 on differed by 2.6e-9)."""

from __future__ import annotations

import torch


def test_zero0_gradient_norm_is_exact_on_a_large_gradient(tmp_path):
    from dynabatch.engine.dist import init_distributed, shutdown
    from dynabatch.engine.executor import Executor

    ctx = init_distributed(1, 1, rank=0, world_size=1, init_method=f"file://{tmp_path}/init", timeout_s=30)
    try:
        gen = torch.Generator().manual_seed(0)
        big = torch.nn.Parameter(torch.zeros(8192 * 256))
        small = torch.nn.Parameter(torch.zeros(10))
        big.grad = torch.randn(big.numel(), generator=gen) * 1e-4
        big.grad[:1000] *= 100  # a few large entries, as a token table's rows of frequent tokens
        small.grad = torch.ones(10)
        stage = torch.nn.Module()
        stage.big, stage.small = big, small
        stage.tied_parameters = lambda: {}
        ex = Executor.__new__(Executor)
        ex.ctx, ex.zero, ex.loss_scaler, ex.scheduler, ex.max_grad_norm = ctx, None, None, None, None
        ex.params = ex.norm_params = [big, small]
        ex.device = torch.device("cpu")
        ex.loss_sum = torch.zeros((), dtype=torch.float64)
        ex.optimizer = torch.optim.SGD([big, small], lr=0.0)
        want = (big.grad.double().square().sum() + small.grad.double().square().sum()).sqrt().item()
        ex.optimizer_step(1)
    finally:
        shutdown()
    assert abs(ex.grad_norm / want - 1) < 1e-9, (ex.grad_norm, want)
