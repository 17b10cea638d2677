"""How many FFN-wide (``bT x d_ff``) tensors a model's feed-forward keeps for backward, measured once.

The analytic model's FFN stores its input, then what the activation path saves: for a plain activation
its input and its output (the down projection's input), for a gated one the gate, the up projection and the
product. That count depends on how the activation is written, not only on its name: Hugging Face's
``gelu_new`` (GPT-2's default, and Flan-T5's gated-GELU) is a Python expression whose ``tanh``, ``0.5 x`` and
``1 + tanh`` each stay saved, five FFN-wide tensors where a fused GELU keeps two; ReLU saves only its output,
which the down projection saves too (one). So :func:`ffn_saved_tensors` runs the activation path once on a
small tensor under ``saved_tensors_hooks`` and counts the distinct storages it keeps, in units of one
FFN-wide tensor (dtype-neutral: the activation runs in the dtype it receives).
"""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def ffn_saved_tensors(activation: str, gated: bool) -> float:
    """FFN-wide tensors saved by ``act(x) @ W_down`` (gated: ``(act(gate) * up) @ W_down``), with ``x``,
    ``gate`` and ``up`` fresh tensors (the up projections' outputs) and ``W_down`` a parameter (not counted).

    ``activation`` is a ``transformers.activations.ACT2FN`` name; an unknown one raises ``ValueError``."""
    from transformers.activations import ACT2FN

    if activation not in ACT2FN:
        raise ValueError(f"unknown activation {activation!r}; valid: {', '.join(sorted(ACT2FN))}")
    act, width = ACT2FN[activation], 16
    storages: dict[int, int] = {}
    # the count is cached for the process: measured with autograd recording and no autocast, whatever the caller's
    # mode (a first call under no_grad, as an evaluation plans, would save nothing and price every later run wrong)
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        # fixed values, not torch's global random stream: a planning call leaves the caller's RNG as it was
        down = torch.nn.Parameter(torch.linspace(-1.0, 1.0, width * 4).reshape(width, 4))

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() != down.untyped_storage().data_ptr():
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        x, up = (torch.linspace(-2.0, 2.0, 8 * width).reshape(8, width).requires_grad_() * 1.0  # non-leaf, like
                 for _ in range(2))  # a projection's output
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            (act(x) * up if gated else act(x)) @ down
    return sum(storages.values()) / (x.numel() * x.element_size())
