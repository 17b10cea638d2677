"""Profiled attention cores: the per-segment term of the cost tables.

A block's table entry ``block(b, E)`` is measured with dense attention over the padded rows. Padding-free
attention computes only each sample's block of score pairs (:mod:`dynabatch.cost.pairs`), so the tables
price a micro-batch with ``P`` pairs as

    block(b, E, P) = block(b, E) - core(b, E) + core(P)

where ``core`` is the block's attention core alone, profiled as its own layer kind. :func:`add_attention_cores`
adds those kinds to any family's :class:`~dynabatch.cost.layers.ModelLayers` without knowing the family: the
core kind of a block runs the block's own forward once with a capturing attention implementation
registered in ``transformers.AttentionInterface``, records the arguments HF hands the attention function
(queries, keys, values, mask, T5's position bias, scaling, dropout) and then measures that same function
on those arguments, with the queries, keys and values as leaves. Every family dispatches attention through
that interface (GPT-2, Llama/Qwen2/Mistral, T5), so the core is exactly the computation inside the profiled
block (HF's ``sdpa`` with its padding mask here).

Kinds, per analytic block kind of the family (``ModelLayers.analytic_kinds``):

* ``gpt`` / ``t5_encoder`` block ``X``: ``X_attention`` (b, E), the self-attention core (role ``encoder``);
* ``t5_decoder`` block ``X``: ``X_self_attention`` (b, D) (role ``decoder``) and ``X_cross_attention``
  (b, E, D) (role ``cross``).

The profile records ``model.attention_cores = {block kind: {role: core kind}}``; the tables' stage specs
never count core kinds, so dense stage costs are unchanged, and :mod:`dynabatch.cost.segments` applies the
correction when pairs are given.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from dynabatch.cost.layers import KindSpec, ModelLayers, Step

CAPTURE = "dynabatch_profile_capture"
"""The capturing attention implementation's name in ``transformers.AttentionInterface``."""
ROLES = {"gpt": (("encoder", "attention", ("b", "E")),),
         "t5_encoder": (("encoder", "attention", ("b", "E")),),
         "t5_decoder": (("decoder", "self_attention", ("b", "D")), ("cross", "cross_attention", ("b", "E", "D")))}
"""Analytic block kind -> (role, kind-name suffix, table dims) of its attention cores, in call order."""

_recording: list | None = None
_original: dict[int, str] = {}


def _capture(module, query, key, value, attention_mask, **kwargs):
    """The registered implementation: record the call, then run the implementation the module had."""
    impl = _original.get(id(module.config), "sdpa")
    fn = _implementation(module, impl)
    if _recording is not None:
        _recording.append((fn, module, query, key, value, attention_mask, kwargs))
    return fn(module, query, key, value, attention_mask, **kwargs)


def _implementation(module, impl: str):
    """What HF's attention layers call for ``impl``: the registered function, or the modeling file's
    ``eager_attention_forward`` (HF's own fallback for ``eager``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)


def capture_attention(model: torch.nn.Module, run) -> list:
    """Run ``run()`` (no grad) with every attention call of ``model`` recorded: a list of
    ``(function, module, query, key, value, mask, kwargs)`` in call order."""
    from transformers import AttentionInterface

    global _recording
    AttentionInterface.register(CAPTURE, _capture)
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    _original.clear()
    _original.update(saved)
    _recording = []
    try:
        for c in configs.values():
            c._attn_implementation = CAPTURE
        with torch.no_grad():
            run()
        return _recording
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]
        _recording = None


def _detached(x):
    return x.detach() if isinstance(x, torch.Tensor) else x


def _core_step(model, block_maker, index: int, b: int, e: int, d: int) -> Step:
    """Measure attention call ``index`` of one block forward at ``(b, e, d)`` on its own."""
    block = block_maker(b, e, d)
    calls = capture_attention(model, block.run)
    if index >= len(calls):
        raise RuntimeError(f"the block made {len(calls)} attention call(s); expected at least {index + 1}")
    fn, module, q, k, v, mask, kwargs = calls[index]
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    mask = _detached(mask)
    kwargs = {name: _detached(x) for name, x in kwargs.items()}
    shared = tuple(x for x in (mask, *kwargs.values()) if isinstance(x, torch.Tensor))
    return Step(run=lambda: ((fn(module, q, k, v, mask, **kwargs)[0],), ()), leaves=(q, k, v), shared=shared)


def attention_core_kinds(layers: ModelLayers) -> dict[str, dict[str, str]]:
    """``{block kind: {role: core kind}}`` for the blocks of ``layers`` (module docstring)."""
    out: dict[str, dict[str, str]] = {}
    for analytic, roles in ROLES.items():
        for block in layers.analytic_kinds.get(analytic, ()):
            out[block] = {role: f"{block}_{suffix}" for role, suffix, _ in roles}
    return out


def add_attention_cores(layers: ModelLayers) -> ModelLayers:
    """``layers`` with one extra kind per attention core of each block (module docstring); parameters 0."""
    kinds, makers = list(layers.kinds), dict(layers.makers)
    num_params, cores = dict(layers.num_params), attention_core_kinds(layers)
    for analytic, roles in ROLES.items():
        for block in layers.analytic_kinds.get(analytic, ()):
            if block not in makers:
                continue
            for index, (role, _, dims) in enumerate(roles):
                name = cores[block][role]
                if name in makers:
                    continue

                def make(b, e, d, _maker=makers[block], _index=index, _dims=dims):
                    # a (b, D) core still runs its decoder block, whose cross-attention needs some E
                    return _core_step(layers.model, _maker, _index, b, e if "E" in _dims else max(d, 1), d)

                kinds.append(KindSpec(name, dims))
                makers[name] = make
                num_params[name] = 0
    return replace(layers, kinds=tuple(kinds), makers=makers, num_params=num_params)
