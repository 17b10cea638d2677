"""A token slice's attention as two flash calls merged by log-sum-exp (dynabatch.models.context_attention).

Outputs and the gradients of queries, keys and values equal SDPA with the explicit bottom-right mask (fp32,
several shapes, a context of one token, grouped-query heads, strided inputs); under bf16 autocast it computes in bf16 as SDPA does;
``segment_attention`` serves a slice's groups (padded and packed) with it and gives the masked call's results.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynabatch.cost import pairs
from dynabatch.models import attention, context_attention
from dynabatch.models.attention import build_segments, segment_attention
from dynabatch.models.context_attention import context_causal_attention


def _masked(q, k, v, context, scale=None):
    s = q.shape[2]
    mask = torch.ones(s, context + s, dtype=torch.bool).tril(context)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _leaves(*shapes, dtype=torch.float32):
    return [torch.randn(*shape, dtype=dtype, requires_grad=True) for shape in shapes]


@pytest.mark.parametrize("n, heads, kv_heads, s, context, head_dim, scale", [
    (1, 4, 4, 64, 192, 64, None), (3, 2, 2, 17, 40, 8, 0.3), (2, 4, 4, 33, 1, 16, None), (1, 1, 1, 1, 5, 8, None),
    (2, 8, 2, 24, 50, 16, None)])  # the last: grouped-query attention, 4 query heads per key head
def test_merged_flash_calls_equal_the_masked_attention(n, heads, kv_heads, s, context, head_dim, scale):
    torch.manual_seed(0)
    q, k, v = _leaves((n, heads, s, head_dim), (n, kv_heads, context + s, head_dim), (n, kv_heads, context + s, head_dim))
    assert context_attention.applies(q, k, context, None, 0.0)
    want = _masked(q, k, v, context, scale)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got = context_causal_attention(q, k, v, context, scale)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=1e-5, msg=lambda m: f"d{name}: {m}")


def test_strided_inputs_and_bf16_autocast():
    """Views of a (B, T, H, Dh) projection (what HF layers hand over) and fp32 inputs under bf16 autocast."""
    torch.manual_seed(1)
    base = torch.randn(2, 48, 4, 16, requires_grad=True)
    q = base[:, 32:].transpose(1, 2)  # (2, 4, 16, 16), not contiguous
    k = v = base.transpose(1, 2)
    want = _masked(q, k, v, 32)
    assert not q.is_contiguous()
    torch.testing.assert_close(context_causal_attention(q, k, v, 32), want, atol=2e-5, rtol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = context_causal_attention(q, k, v, 32)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
    got.float().sum().backward()
    assert base.grad is not None and torch.isfinite(base.grad).all()


SLICE_LAYOUTS = {  # (context segment ids, the slice's segment ids)
    "continuing": ([[1, 1, 1], [1, 1, 1]], [[1, 1, 1, 1], [1, 1, 0, 0]]),  # one padded aligned group at tolerance 1
    "starting": ([[1, 1, 1, 1, 1], [1, 1, 1, 2, 2]], [[1, 1, 2, 2, 2, 0], [2, 2, 2, 2, 0, 0]]),  # a sample starts
}


@pytest.mark.parametrize("tolerance", [0.0, 1.0])
@pytest.mark.parametrize("layout", list(SLICE_LAYOUTS))
def test_segment_attention_serves_slices_with_the_merged_calls(layout, tolerance, monkeypatch):
    """Slices of packed and padded rows after their context: the merged calls serve the aligned groups that
    have context (at tolerance 1 the ``starting`` layout is one unaligned group, the masked call), and outputs
    and gradients equal the masked calls' (``applies`` forced off)."""
    monkeypatch.setattr(pairs, "PAD_TOLERANCE", tolerance)  # 0: every sample its own call; 1: one padded group
    context_ids, ids = (torch.tensor(x) for x in SLICE_LAYOUTS[layout])
    seg = build_segments("causal", ids, context_segment_ids=context_ids)
    b, q_len, k_len = ids.shape[0], ids.shape[1], ids.shape[1] + context_ids.shape[1]
    torch.manual_seed(2)
    q, k, v = _leaves((b, 2, q_len, 8), (b, 2, k_len, 8), (b, 2, k_len, 8))
    calls = []
    merged = context_attention.context_causal_attention
    monkeypatch.setattr(context_attention, "context_causal_attention",
                        lambda *a, **kw: calls.append(a[3]) or merged(*a, **kw))
    got = segment_attention(q, k, v, seg)
    got_grads = torch.autograd.grad(got.sum(), (q, k, v))
    assert calls == [g.key_len - g.query_len for g in seg.groups if g.aligned and g.key_len > g.query_len]
    assert calls or (layout, tolerance) == ("starting", 1.0)
    monkeypatch.setattr(attention.context_attention, "applies", lambda *a: False)
    want = segment_attention(q, k, v, build_segments("causal", ids, context_segment_ids=context_ids))
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=1e-5)
