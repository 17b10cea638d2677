"""The real Hugging Face layers behind each profiled layer kind, with inputs for one shape.

A pipeline stage is a sum of *layer kinds*. Every kind is cut out of a full HF model built from the
config (so ``_attn_implementation`` and every module are exactly those used in training) and is run
with the inputs a stage would hand it. This module holds the machinery (:class:`Step`,
:class:`ModelLayers`, :func:`build_layers`); each model family's builders live in its module under
``dynabatch.models.families`` (``gpt2_layers``, ``t5_layers``, ``llama_layers``). The kinds:

GPT-2 (``E`` = sequence length)
  ``gpt2_embedding`` (b, E)   wte(ids) + wpe(positions), dropout
  ``gpt2_context``   (b, E)   causal + padding mask, built once per stage and shared by its blocks
  ``gpt2_block``     (b, E)   one ``GPT2Block``
  ``gpt2_head``      (b, E)   ln_f, lm_head, shifted cross-entropy (HF ``ForCausalLMLoss``)
T5 (``E`` = encoder length, ``D`` = decoder length)
  ``t5_encoder_embedding`` (b, E), ``t5_decoder_embedding`` (b, D)   shared embedding, dropout
  ``t5_encoder_context``   (b, E)   padding mask + relative position bias (``compute_bias`` of layer 0)
  ``t5_encoder_block``     (b, E)   one ``T5Block`` given the precomputed bias
  ``t5_encoder_final``     (b, E)   encoder final RMS norm + dropout
  ``t5_decoder_context``   (b, E, D) causal mask, cross mask, decoder bias, zero cross bias; also owns the
                                    encoder states every decoder block of the stage reads
  ``t5_decoder_block``     (b, E, D) one ``T5Block`` with cross-attention
  ``t5_head``              (b, D)   decoder final norm, dropout, output scaling, lm_head, cross-entropy

Relative attention bias: HF computes it in layer 0 of each stack and hands the same tensor to every
later layer. Here a stage computes it once (``*_context``) and blocks are profiled *with the bias given*,
so a stage of k blocks costs context + k x block, not k x (block + bias). Tensors shared by all blocks
of a stage (masks, biases, encoder states) are excluded from a block's stored bytes and counted once
in the context kind when a block saves them (checked by running one consuming block).

Every micro-batch is padded, so inputs carry one padding token (the last token of the last sample):
the attention masks are materialised as they are in training, instead of the mask-free fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from dynabatch.model_presets import build_model, model_class


Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class KindSpec:
    """A profiled layer kind."""

    name: str
    """Stable name used in profile files and stage specs."""
    dims: tuple[str, ...]
    """Table axes: ``("b", "E")``, ``("b", "D")`` or ``("b", "E", "D")``."""


@dataclass
class Step:
    """One kind at one shape: a forward closure plus what the measurement needs to know."""

    run: Callable[[], tuple[Tensors, Tensors]]
    """Forward. Returns ``(diff_outputs, aux_outputs)``; backward runs from ``diff_outputs``."""
    leaves: Tensors = ()
    """Inputs that need a gradient; their ``.grad`` is cleared before each iteration."""
    shared: Tensors = ()
    """Inputs shared by every layer of a stage: never counted in this kind's stored bytes."""
    consumer: Callable[[Tensors], object] | None = None
    """Context kinds: runs one consuming block on ``diff + aux`` outputs (memory pass only)."""
    passthrough: Tensors = ()
    """Inputs returned as outputs (T5 encoder states handed to every decoder block of a stage): counted in
    this kind's stored and peak bytes when a block saves them, as they are not allocated by ``run``."""
    grads: list[torch.Tensor] = field(default_factory=list)
    """Gradients for ``diff_outputs`` that need one (filled on the first run)."""


@dataclass
class ModelLayers:
    """A built HF model and the kinds it exposes."""

    name: str
    family: str
    """Registered family name (``gpt2``, ``t5``, ``llama``)."""
    model: nn.Module
    kinds: tuple[KindSpec, ...]
    makers: dict[str, Callable[[int, int, int], Step]]
    num_params: dict[str, int]
    """Parameters held by one use of each kind."""
    tied_params: dict[str, int]
    """Parameters of the (tied) token embedding that a kind holds; shared when two such kinds sit in one stage."""
    sequence_kind: str = "causal"
    """``causal`` or ``seq2seq`` (written to the profile so the tables need no family name)."""
    analytic_kinds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Analytic layer kind (``dynabatch.cost.model_specs``) -> the profiled kinds it is made of."""
    context_kinds: dict[str, str] = field(default_factory=dict)
    """Analytic block kind -> the profiled per-stage context kind its stage pays once."""

    @property
    def param_ptrs(self) -> frozenset[int]:
        return frozenset(p.untyped_storage().data_ptr() for p in self.model.parameters())


def token_ids(b: int, n: int, vocab: int, device) -> torch.Tensor:
    """Deterministic random token ids (b, n), avoiding the special ids 0-2."""
    g = torch.Generator().manual_seed(b * 100003 + n)
    return torch.randint(3, vocab, (b, n), generator=g).to(device)


def padding_mask(b: int, n: int, device) -> torch.Tensor:
    """All-ones (b, n) mask but for the last token of the last sample: a padded micro-batch."""
    mask = torch.ones(b, n, dtype=torch.long, device=device)
    if n > 1:
        mask[-1, -1] = 0
    return mask


def hidden_input(b: int, n: int, d: int, device, dtype) -> torch.Tensor:
    """Random hidden states (b, n, d) that need a gradient (a block's input)."""
    return torch.randn(b, n, d, device=device, dtype=dtype).requires_grad_(True)


def count_params(module: nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Parameters of ``module``, leaving out those whose name contains one of ``skip``."""
    return sum(p.numel() for n, p in module.named_parameters() if not any(s in n for s in skip))


def build_layers(model: str | object, builder: Callable, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, dropout: float = 0.0, seed: int = 0) -> ModelLayers:
    """Build the HF model and run ``builder(name, hf_model, device, dtype) -> ModelLayers`` on it.

    ``model`` is a preset name or local checkpoint (:mod:`dynabatch.model_presets`) or an HF config
    (``dropout`` is then taken from the config). ``builder`` is the model family's profiler layer
    builder (``dynabatch.models.families``: ``family.profile_layers``), so this module knows no family.
    """

    if isinstance(model, str):
        name, hf_model = model, build_model(model, dropout=dropout, seed=seed)
    else:
        torch.manual_seed(seed)
        name, hf_model = model.model_type, model_class(model).from_config(model)
    hf_model = hf_model.to(device=device, dtype=dtype).train()
    return builder(name, hf_model, torch.device(device), dtype)
