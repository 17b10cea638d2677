"""The executor's tied-gradient sum counts a copy without a gradient as zeros.

Under moving stage boundaries (:mod:`dynabatch.models.boundary_copies`) a unit's copy that no micro-batch of a step
ran has ``grad is None``; ``REDUCE`` must then give every copy the other copies' summed gradient (here two chunks of
one rank hold a copy each, as virtual stages do; across ranks the same zero-filled gradient enters the all-reduce).
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("ran", [0, 1])
def test_tied_sum_treats_a_missing_gradient_as_zeros(tmp_path, ran):
    from dynabatch.engine.dist import init_distributed, shutdown, tied_groups
    from dynabatch.engine.executor import Executor

    ctx = init_distributed(1, 1, rank=0, world_size=1, init_method=f"file://{tmp_path}/init", timeout_s=30)
    try:
        copies = [torch.nn.Parameter(torch.ones(3, 2)) for _ in range(2)]
        other = torch.nn.Parameter(torch.zeros(4))  # an untied parameter no micro-batch used either
        grad = torch.arange(6.0).reshape(3, 2)
        copies[ran].grad = grad.clone()
        ex = Executor.__new__(Executor)
        ex.ctx, ex.zero = ctx, None
        ex.params = [*copies, other]
        ex.tied_params = {"transformer.h.1.attn.c_attn.weight": copies}
        ex.tied = tied_groups(ctx, ex.tied_params)
        ex.reduce_gradients()
    finally:
        shutdown()
    for p in copies:
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)
    torch.testing.assert_close(other.grad, torch.zeros(4), rtol=0, atol=0)
