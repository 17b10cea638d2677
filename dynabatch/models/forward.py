"""Run Hugging Face T5 and GPT-2 on dynabatch micro-batches, with masks built from segment ids.

Padding and packing share one path. Every row carries segment ids (1.. per sample, 0 = pad), and
the masks (:mod:`dynabatch.models.masks`) are 4-D *additive float* masks, shape (B, 1, Q, K): 0 where a query may
attend a key, ``finfo(dtype).min`` where it may not. The rules:

* T5 encoder self-attention: block-diagonal, bidirectional (same segment).
* T5 decoder self-attention and GPT-2: block-diagonal and causal.
* T5 cross-attention: decoder segment k attends encoder segment k only.
* A real query never attends a pad key, so padding cannot change a real token's output. A pad query
  (segment 0) attends every key: no row is ever fully masked, so the softmax stays finite even when
  the large negative overflows to ``-inf`` (fp16). Pad outputs feed nothing that carries loss.

Why additive floats: transformers 5 returns any 4-D mask unchanged (``masking_utils``
``_preprocess_mask_arguments`` exits early), so the mask reaches the attention kernel as given.
``sdpa`` accepts bool or float masks (T5's ``create_position_bias_mask`` merges a bool mask with
``torch.where`` and adds a float one); ``eager`` only *adds* the mask to the scores, so a bool mask
there is silently wrong (adds 0/1). The float mask means the same thing under both.

GPT-2 gets the per-sample ``position_ids`` and ``use_cache=False``. T5 is relative-position: its
bias depends on in-row index differences, which inside one contiguous segment equal the per-sample
ones, so packing needs no position ids there. T5 runs ``model.encoder`` / ``model.decoder`` itself
(``T5ForConditionalGeneration.forward`` would rebuild 2-D masks) and then rescales the decoder output
by ``d_model ** -0.5`` when ``config.scale_decoder_outputs`` (tied embeddings) before ``lm_head``,
exactly as HF does. Losses are token sums in fp32; normalising by the global batch's loss-token
count is the caller's job. Tests (tests/unit/models/test_forward.py) show per-sample losses and gradients
equal between single-sample, padded and packed micro-batches under ``sdpa`` and ``eager``, and
equal to HF's own ``labels=`` loss.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from dynabatch.data.microbatch import IGNORE_INDEX, CausalMicroBatch, MicroBatch, Seq2SeqMicroBatch
from dynabatch.models.attention import use_segment_attention
from dynabatch.models.families import family_for_config
from dynabatch.models.masks import (  # noqa: F401 (the masks and token losses are imported from here too)
    _token_losses,
    bidirectional_segment_mask,
    causal_segment_mask,
    cross_segment_mask,
)
from dynabatch.models.split import layout_for, micro_batch_inputs, pipeline_spec_for


# ----------------------------------------------------------------------------------------------
# Forward passes
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossOutput:
    """Summed token losses of one micro-batch (not normalised)."""

    loss_sum: torch.Tensor
    """Scalar fp32 tensor: sum of token cross-entropies over loss tokens; differentiable."""
    num_loss_tokens: int
    """Tokens that carry loss (targets != ``IGNORE_INDEX``)."""
    token_losses: torch.Tensor
    """(B, T) fp32 per-token losses shaped like the targets, 0 where ignored."""


def _embedding_weight(model: torch.nn.Module) -> torch.Tensor:
    """Input embedding weight: gives the device to run on and the dtype for the masks."""
    return model.get_input_embeddings().weight


def causal_lm_forward(model: torch.nn.Module, mb: CausalMicroBatch) -> LossOutput:
    """GPT-2 (``GPT2LMHeadModel``) on a causal micro-batch; targets are pre-shifted, no HF label shift."""
    weight = _embedding_weight(model)
    device = weight.device
    input_ids = mb.input_ids.to(device, non_blocking=True)  # (B, T)
    segment_ids = mb.segment_ids.to(device, non_blocking=True)  # (B, T)
    out = model(
        input_ids=input_ids,
        attention_mask=causal_segment_mask(segment_ids, weight.dtype),  # (B, 1, T, T)
        position_ids=mb.position_ids.to(device, non_blocking=True),
        use_cache=False,
    )
    token_losses = _token_losses(out.logits, mb.target_ids.to(device, non_blocking=True))
    return LossOutput(loss_sum=token_losses.sum(), num_loss_tokens=mb.num_loss_tokens, token_losses=token_losses)


def seq2seq_forward(model: torch.nn.Module, mb: Seq2SeqMicroBatch) -> LossOutput:
    """T5 (``T5ForConditionalGeneration``) on a seq2seq micro-batch, encoder and decoder run directly."""
    weight = _embedding_weight(model)
    device, dtype = weight.device, weight.dtype
    enc_seg = mb.encoder_segment_ids.to(device, non_blocking=True)  # (B, E)
    dec_seg = mb.decoder_segment_ids.to(device, non_blocking=True)  # (B, D)
    encoder_states = model.encoder(
        input_ids=mb.input_ids.to(device, non_blocking=True),
        attention_mask=bidirectional_segment_mask(enc_seg, dtype),  # (B, 1, E, E)
    ).last_hidden_state  # (B, E, d_model)
    decoder_states = model.decoder(
        input_ids=mb.decoder_input_ids.to(device, non_blocking=True),
        attention_mask=causal_segment_mask(dec_seg, dtype),  # (B, 1, D, D)
        encoder_hidden_states=encoder_states,
        encoder_attention_mask=cross_segment_mask(dec_seg, enc_seg, dtype),  # (B, 1, D, E)
        use_cache=False,
    ).last_hidden_state  # (B, D, d_model)
    if getattr(model.config, "scale_decoder_outputs", False):  # tied T5 (not mT5): as T5ForConditionalGeneration
        decoder_states = decoder_states * (model.config.d_model**-0.5)
    logits = model.lm_head(decoder_states)  # (B, D, V)
    token_losses = _token_losses(logits, mb.labels.to(device, non_blocking=True))
    return LossOutput(loss_sum=token_losses.sum(), num_loss_tokens=mb.num_loss_tokens, token_losses=token_losses)


def forward_loss(model: torch.nn.Module, mb: MicroBatch, attention: str = "dense") -> LossOutput:
    """The summed token loss of ``mb`` on the whole ``model``.

    ``dense`` (the reference): :func:`causal_lm_forward` / :func:`seq2seq_forward` with 4-D masks.
    ``segments``: padding-free (:mod:`dynabatch.models.attention`), through the model's one-stage view
    (:func:`whole_model_stage`), the same code the pipeline stages run.
    """
    if attention == "segments":
        stage, spec = whole_model_stage(model)
        out = stage({}, micro_batch_inputs(mb, spec, 0))
        return LossOutput(loss_sum=out.loss_sum, num_loss_tokens=out.num_loss_tokens, token_losses=out.token_losses)
    if attention != "dense":
        raise ValueError(f"unknown attention path {attention!r}; valid: segments, dense")
    if isinstance(mb, CausalMicroBatch):
        return causal_lm_forward(model, mb)
    if isinstance(mb, Seq2SeqMicroBatch):
        return seq2seq_forward(model, mb)
    raise ValueError(f"unsupported micro-batch type {type(mb).__name__}; valid: CausalMicroBatch, Seq2SeqMicroBatch")


_VIEWS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def whole_model_stage(model: torch.nn.Module):
    """``(stage, spec)``: the whole model as one padding-free stage that *references* its modules (no copy:
    gradients land on the model's own parameters). Built once per model; switches the model's attention
    implementation to the padding-free one, which hands dense masks and generation to the previous one."""
    view = _VIEWS.get(model)
    if view is None:
        layout = layout_for(model, 1)
        stage = family_for_config(model.config).stage_class(model, layout, 0)
        stage.attention = "segments"
        use_segment_attention(model)
        view = _VIEWS[model] = (stage, pipeline_spec_for(model, layout))
    return view


def per_sample_losses(mb: MicroBatch, out: LossOutput) -> dict[int, float]:
    """Mean token loss of each sample, keyed by global-batch sample index.

    A loss token belongs to the segment at its position (causal targets sit inside their sample's
    span; seq2seq labels on the decoder side). Samples without loss tokens are left out.
    """
    if isinstance(mb, CausalMicroBatch):
        segment_ids, targets = mb.segment_ids, mb.target_ids
    else:
        segment_ids, targets = mb.decoder_segment_ids, mb.labels
    num_segments = max(len(row) for row in mb.sample_ids) + 1  # slot 0 collects padding
    rows = torch.arange(segment_ids.shape[0])[:, None]  # (B, 1)
    slot = (rows * num_segments + segment_ids).reshape(-1)  # (B*T,)
    is_loss = (targets != IGNORE_INDEX).reshape(-1)
    losses = out.token_losses.detach().float().cpu().reshape(-1)
    sums = torch.zeros(segment_ids.shape[0] * num_segments).index_add_(0, slot, losses * is_loss)
    counts = torch.zeros_like(sums).index_add_(0, slot, is_loss.float())
    sums, counts = sums.tolist(), counts.tolist()
    result: dict[int, float] = {}
    for r, row in enumerate(mb.sample_ids):
        for seg, sample_index in enumerate(row, start=1):
            n = counts[r * num_segments + seg]
            if n > 0:
                result[sample_index] = sums[r * num_segments + seg] / n
    return result
