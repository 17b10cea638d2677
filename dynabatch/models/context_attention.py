"""A token slice's causal attention over its context, as two flash calls merged by their log-sum-exp.

A token slice (TeraPipe) of ``s`` queries attends to ``c`` context keys (every earlier token of its
sample) and causally to its own ``s`` keys: a bottom-right ``(s, c + s)`` triangle. Handed to
``scaled_dot_product_attention`` as an explicit mask, the CPU flash kernel reads the mask for every
score and skips no block; on 2 CPU cores the slices of an 8,192-token sample then cost 1.2-1.7x the
attention of the whole sample (``is_causal``, whose kernel skips the blocks above the diagonal). Here
the keys are split where the slice begins:

* ``O_c, L_c``: the queries over the ``c`` context keys, every score allowed (no mask);
* ``O_s, L_s``: the queries over their own ``s`` keys, ``is_causal`` (a square, top-left aligned);

each from the flash kernel with its row log-sum-exp ``L``. The slice's output is the softmax over both
key sets: ``L = logaddexp(L_c, L_s)``, ``O = exp(L_c - L) O_c + exp(L_s - L) O_s`` (the merge of
FlashAttention's online softmax, and of ring attention's blocks).

Backward: the flash backward of a key block needs only the block's keys and values, the queries, the
*final* output ``O`` and log-sum-exp ``L``, and ``dO``: it recomputes the block's probabilities
``P = exp(Q K^T scale - L)`` and uses ``D = rowsum(dO * O)``, so calling it once per block with the merged
``O, L`` gives each block's exact ``dK, dV`` and its share of ``dQ``. The kernel's own ``L`` output carries
no gradient, which is why this is an :class:`torch.autograd.Function` rather than autograd through the merge.

Together the two calls compute ``s c + s^2 / 2`` scores, the slice's causal share, so a sample's slices
cost what the sample costs unsliced. Used for CPU tensors when the installed torch has the CPU flash
ops (they take grouped-query heads, fewer key than query heads, in both directions), with no dropout and
no additive bias; anything else takes the masked call (:func:`dynabatch.models.attention.segment_attention`).
Measured: ``docs/benchmarks/token_slicing/slice_attention_2cpu_20261207.md``.
"""

from __future__ import annotations

import torch

_aten = torch.ops.aten


def applies(query: torch.Tensor, key: torch.Tensor, context: int, bias, dropout_p: float) -> bool:
    """Whether :func:`context_causal_attention` can serve this call."""
    return (context > 0 and bias is None and not dropout_p and query.device.type == "cpu"
            and query.shape[1] % key.shape[1] == 0 and hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"))


def context_causal_attention(query, key, value, context: int, scale: float | None = None) -> torch.Tensor:
    """Attention of ``(n, H, s, Dh)`` queries over ``(n, Hk, c + s, Dh)`` keys/values, the first ``c`` of them
    (``context``) all visible, the last ``s`` causal. Returns ``(n, H, s, Dh)`` as SDPA would, in the dtype
    SDPA would compute in (autocast's, where it is on)."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    with torch.autocast(device, enabled=False):
        return _ContextCausal.apply(query, key, value, context, scale)


def _flash(q, k, v, causal: bool, scale):
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse  # (n, H, s, Dh), (n, H, s) float32


class _ContextCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, context, scale):
        c = context
        o_c, l_c = _flash(query, key[:, :, :c], value[:, :, :c], False, scale)
        o_s, l_s = _flash(query, key[:, :, c:], value[:, :, c:], True, scale)
        lse = torch.logaddexp(l_c, l_s)
        out = (o_c.float() * torch.exp(l_c - lse).unsqueeze(-1)
               + o_s.float() * torch.exp(l_s - lse).unsqueeze(-1)).to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.context, ctx.scale = c, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        c, scale = ctx.context, ctx.scale
        grad_out = grad_out.to(out.dtype)
        dq_c, dk_c, dv_c = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key[:, :, :c], value[:, :, :c], out, lse, 0.0, False, scale=scale)
        dq_s, dk_s, dv_s = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key[:, :, c:], value[:, :, c:], out, lse, 0.0, True, scale=scale)
        return dq_c + dq_s, torch.cat([dk_c, dk_s], dim=2), torch.cat([dv_c, dv_s], dim=2), None, None
