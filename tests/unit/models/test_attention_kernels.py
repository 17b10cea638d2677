"""Padding-free attention kernels (dynabatch.models.attention_kernels) against per-segment SDPA.

On this CPU, flex_attention runs forward only and varlen_attn not at all, so: flex's document BlockMask and
T5 score_mod are checked forward (no grad) against the ``sdpa`` kernel for every attention kind and whole
stages of GPT-2, Llama and T5 on padded, packed and sliced micro-batches; varlen's packing (token indices,
``cu_seqlens``, scatter back) is checked by running it with a per-sample SDPA stand-in for the CUDA
kernel, which computes exactly what FlashAttention varlen computes; ``auto`` picks ``sdpa`` on CPU, the
counters say which kernel ran, and a kernel that cannot train on the device is refused with one line.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from dynabatch.models import attention_kernels as ak
from dynabatch.models.attention import build_segments, segment_attention
from dynabatch.models.split import build_stage, layout_for, micro_batch_inputs, pipeline_spec_for
from dynabatch.data.microbatch import token_slices
from test_attention import MODELS, ROWS, _micro_batch

IDS = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 2, 2, 3, 3, 3]])


@contextlib.contextmanager
def kernel(name: str):
    before = ak.attention_kernel()
    ak.use_attention_kernel(name)
    try:
        yield
    finally:
        ak.use_attention_kernel(before)


def _qkv(b, h, q_len, k_len, head_dim=8, kv_heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = kv_heads or h
    return (torch.randn(b, h, q_len, head_dim, generator=g), torch.randn(b, kv, k_len, head_dim, generator=g),
            torch.randn(b, kv, k_len, head_dim, generator=g))


def _toeplitz_bias(h: int, n: int) -> torch.Tensor:
    offsets = torch.randn(h, 2 * n - 1, generator=torch.Generator().manual_seed(3))
    i = torch.arange(n)
    return offsets[:, i[None, :] - i[:, None] + n - 1][None]  # (1, H, n, n), depends on j - i only


def _layouts():
    context = torch.tensor([[1, 1, 1, 1], [1, 1, 2, 2], [1, 1, 1, 2]])
    yield "bidirectional", build_segments("bidirectional", IDS), IDS.shape[1]
    yield "causal", build_segments("causal", IDS), IDS.shape[1]
    yield "slice", build_segments("causal", torch.tensor([[1, 1, 2], [2, 3, 3], [2, 2, 0]]),
                                  context_segment_ids=context), 7
    yield "cross", build_segments("cross", torch.tensor([[1, 1, 2, 0], [1, 1, 1, 0], [1, 2, 3, 3]]),
                                  IDS), IDS.shape[1]


def test_toeplitz_offsets_recover_every_entry():
    bias = _toeplitz_bias(3, 6)
    offsets = ak.toeplitz_offsets(bias)
    i = torch.arange(6)
    assert torch.equal(offsets[:, i[None, :] - i[:, None] + 5][None], bias)


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_flex_equals_per_segment_sdpa_for_every_kind(with_bias, gqa):
    for kind, seg, k_len in _layouts():
        if with_bias and kind in ("slice", "cross"):
            continue  # T5 has no token slices, and its cross-attention bias is dropped
        q, k, v = _qkv(3, 4, seg.query_len, k_len, kv_heads=2 if gqa else None)
        bias = _toeplitz_bias(4, seg.max_len + 2) if with_bias else None
        with kernel("sdpa"):
            want = segment_attention(q, k, v, seg, scale=0.3, bias=bias)
        with kernel("flex"), torch.no_grad():
            seg.masks.clear()
            before = ak.KERNEL_CALLS.copy()
            got = segment_attention(q, k, v, seg, scale=0.3, bias=bias)
        assert ak.calls_since(before) == {"flex": 1}, kind
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{kind}: {m}")
        assert got.abs().sum() > 0


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """What FlashAttention varlen computes, per sample with SDPA (causal aligned bottom-right)."""
    out = []
    for i in range(len(cu_q) - 1):
        qs, ks = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1), k[cu_k[i]:cu_k[i + 1]].transpose(0, 1)
        vs = v[cu_k[i]:cu_k[i + 1]].transpose(0, 1)
        lq, lk = qs.shape[1], ks.shape[1]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if window_size == (-1, 0) else None
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                  enable_gqa=enable_gqa).transpose(0, 1))
    return torch.cat(out)


def _reference_varlen_torch_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
    """torch 2.10-2.11's signature (the lent H200 runs 2.11): ``is_causal``, no ``window_size``, no GQA."""
    assert q.shape[1] == k.shape[1], "this varlen_attn takes as many key/value heads as query heads"
    return _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0) if is_causal else (-1, -1))


@pytest.mark.parametrize("signature", [_reference_varlen, _reference_varlen_torch_2_11], ids=["torch2.12+", "torch2.11"])
@pytest.mark.parametrize("gqa", [False, True])
def test_varlen_packing_scatters_every_sample_back(monkeypatch, gqa, signature):
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", signature)
    for kind, seg, k_len in _layouts():
        q, k, v = _qkv(3, 4, seg.query_len, k_len, kv_heads=2 if gqa else None)
        q.requires_grad_(True)
        with kernel("sdpa"):
            want = segment_attention(q, k, v, seg, scale=0.3)
            want_grad, = torch.autograd.grad(want.square().sum(), q)
        got = ak._run_varlen(q, k, v, seg, 0.3, None)
        got_grad, = torch.autograd.grad(got.square().sum(), q)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind}: {m}")
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{kind}: {m}")


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("rows", ["padded", "packed", "mixed"])
def test_flex_stage_forward_equals_the_sdpa_stage(family, rows):
    model = MODELS[family]()
    layout = layout_for(model, 1)
    spec, mb = pipeline_spec_for(model, layout), _micro_batch(family, ROWS[rows])
    stage = build_stage(model, layout, 0, "segments")
    with torch.no_grad():
        with kernel("sdpa"):
            want = stage({}, micro_batch_inputs(mb, spec, 0))
        with kernel("flex"):
            before = ak.KERNEL_CALLS.copy()
            got = stage({}, micro_batch_inputs(mb, spec, 0))
    used = ak.calls_since(before)
    assert used.get("flex", 0) > 0 and set(used) <= {"flex", "sdpa"}  # dense-row layouts stay on sdpa
    torch.testing.assert_close(got.token_losses, want.token_losses, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_flex_token_slices_equal_the_sdpa_slices(family):
    model = MODELS[family]()
    layout = layout_for(model, 1)
    spec, mb = pipeline_spec_for(model, layout), _micro_batch(family, ROWS["mixed"])
    stage = build_stage(model, layout, 0, "segments")
    bounds = [0, 1, 4, 9, mb.shape[1]]
    losses = {}
    for name in ("sdpa", "flex"):
        with kernel(name), torch.no_grad():
            context, out = None, []
            for piece in token_slices(mb, bounds):
                o = stage({}, micro_batch_inputs(piece, spec, 0), context, sliced=True)
                context = o.slice_record.extend()
                out.append(o.token_losses)
            losses[name] = torch.cat(out, dim=1)
    torch.testing.assert_close(losses["flex"], losses["sdpa"], rtol=1e-5, atol=1e-5)


def test_auto_runs_sdpa_on_cpu_and_explicit_kernels_fall_back_per_call():
    seg = build_segments("causal", IDS)
    q, k, v = _qkv(3, 4, 7, 7)
    q.requires_grad_(True)
    for name in ("auto", "varlen", "flex"):  # varlen is CUDA-only; flex cannot backward on CPU
        with kernel(name):
            before = ak.KERNEL_CALLS.copy()
            segment_attention(q, k, v, seg).sum().backward()
        assert ak.calls_since(before) == {"sdpa": 1}, name
    assert ak.KERNELS["varlen"].unfit(q, seg, None, 0.0) == "varlen_attn is CUDA-only"
    assert "no backward on CPU" in ak.KERNELS["flex"].unfit(q, seg, None, 0.0)
    assert "dropout" in ak.KERNELS["flex"].unfit(q.detach(), seg, None, 0.1)


def test_a_kernel_that_cannot_train_is_refused_in_one_line():
    assert ak.kernel_problem("auto", "cpu") is None and ak.kernel_problem("sdpa", "cpu") is None
    assert "needs CUDA" in ak.kernel_problem("varlen", "cpu")
    assert "needs --dtype bf16 or fp16" in ak.kernel_problem("varlen", "cuda", "fp32")
    assert "cannot train on CPU" in ak.kernel_problem("flex", "cpu")
    with pytest.raises(ValueError, match="unknown attention kernel 'fa3'; valid: auto, sdpa, varlen, flex"):
        ak.use_attention_kernel("fa3")


def test_under_auto_a_kernel_that_raises_is_replaced_by_sdpa(monkeypatch, caplog):
    seg = build_segments("causal", IDS)
    q, k, v = _qkv(3, 4, 7, 7)
    with kernel("sdpa"):
        want = segment_attention(q, k, v, seg)

    def broken(*args):
        raise RuntimeError("no kernel image is available")

    monkeypatch.setattr(ak, "KERNELS", {**ak.KERNELS, "flex": ak.SegmentKernel("flex", ak._sdpa_unfit, broken)})
    monkeypatch.setattr(ak, "_BROKEN", {})
    with kernel("flex"), pytest.raises(RuntimeError, match="no kernel image"):  # an explicit choice raises
        segment_attention(q, k, v, seg)
    monkeypatch.setattr(ak, "AUTO_ORDER", ("flex",))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # auto tries AUTO_ORDER on CUDA only
    with kernel("auto"):
        before = ak.KERNEL_CALLS.copy()
        first = segment_attention(q, k, v, seg)
        second = segment_attention(q, k, v, seg)  # flex is not tried again
    assert ak.calls_since(before) == {"sdpa": 2} and set(ak._BROKEN) == {"flex"}
    assert "attention kernel flex failed (RuntimeError: no kernel image" in caplog.text
    torch.testing.assert_close(first, want)
    torch.testing.assert_close(second, want)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_under_auto_recomputation_stopping_early_is_not_a_kernel_failure(monkeypatch, mode):
    """Non-reentrant checkpointing ends a recomputation by raising ``_StopRecomputationError`` from inside the
    last op that saves a tensor, which is the kernel: ``auto`` must let it through, not drop the kernel for
    ``sdpa`` (on the H200 that broke checkpoint's state and the backward: measured 2026-12-04)."""
    from dynabatch.models.recompute import checkpointed, recompute_mode

    seg = build_segments("causal", IDS)
    q, k, v = (t.requires_grad_() for t in _qkv(3, 4, 7, 7))
    with kernel("sdpa"):
        segment_attention(q, k, v, seg).square().sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]

    def dense(query, key, value, segments, scale, bias):  # a CUDA kernel's place: one masked SDPA call
        real = IDS > 0
        allowed = (IDS[:, :, None] == IDS[:, None, :]) & real[:, :, None] & torch.ones(7, 7, dtype=torch.bool).tril()
        allowed |= torch.eye(7, dtype=torch.bool) & ~real[:, :, None]  # padding attends to itself, then zeroed
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None], scale=scale)
        return (out * real[:, None, :, None]).transpose(1, 2)

    stand_in = ak.SegmentKernel("flex", ak._sdpa_unfit, dense)
    monkeypatch.setattr(ak, "KERNELS", {**ak.KERNELS, "flex": stand_in})
    monkeypatch.setattr(ak, "_BROKEN", {})
    monkeypatch.setattr(ak, "AUTO_ORDER", ("flex",))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    for t in (q, k, v):
        t.grad = None
    with kernel("auto"), recompute_mode(mode):
        before = ak.KERNEL_CALLS.copy()
        checkpointed(lambda *a: segment_attention(*a, seg) * 1.0, q, k, v).square().sum().backward()
    assert ak._BROKEN == {} and ak.calls_since(before) == {"flex": 2}  # the forward and its recomputation
    for got, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, w)
