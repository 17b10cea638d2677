"""One pipeline stage of a Hugging Face ``T5ForConditionalGeneration``.

A stage holds a contiguous run of ``embedding, t5_encoder x L, decoder_embedding, t5_decoder x L,
lm_head`` and runs, in that order, what HF runs for those layers:

* ``embedding``: ``dropout(shared(input_ids))`` (the encoder stack's input);
* ``t5_encoder``: ``T5Block`` s with the bidirectional segment mask (B, 1, E, E); where a stage boundary cuts
  inside an encoder block (``--split-blocks``), the stage before runs its ``t5_enc_attn`` half (``layer[0]``, HF's
  ``T5LayerSelfAttention``) and the stage after its ``t5_enc_ffn`` half (``layer[-1]``, ``T5LayerFF``), each
  followed by HF's fp16 clamp, so the two halves chained are the block bit for bit
  (:class:`EncoderAttentionHalf`, :class:`EncoderFeedForwardHalf`);
* ``decoder_embedding`` (the seam): ``enc_out = dropout(encoder.final_layer_norm(h))`` and the decoder
  input ``dropout(shared(decoder_input_ids))``;
* ``t5_decoder``: ``T5Block`` s with the causal segment mask (B, 1, D, D), cross-attending to
  ``enc_out`` under the cross mask (B, 1, D, E) (decoder segment k sees encoder segment k only);
* blocks run through :func:`~dynabatch.models.recompute.run_block` (activation recomputation under the
  executor's mode; the position bias and ``enc_out`` are inputs every block keeps, stored once);
* ``lm_head``: ``dropout(decoder.final_layer_norm(h))``, times ``d_model ** -0.5`` when
  ``config.scale_decoder_outputs`` (tied head), ``lm_head``, fp32 token-loss sum against ``labels``.

Relative position bias. HF computes it in layer 0 of each stack (the only one with a
``relative_attention_bias`` table) and hands the (1, H, Q, K) tensor to the later layers. A pipeline
stage may hold later layers without layer 0, so every stage with layers of a stack keeps that stack's
table (a copy, or on the stage that holds layer 0, the very same embedding module) and computes the bias
itself with HF's bucketing, then passes it to all its blocks (layer 0 then skips its own
``compute_bias``). The bias depends on in-row index differences only; inside one packed segment they
equal the per-sample differences, and cross-segment entries are masked. The copies are tied groups
``encoder_relative_bias`` / ``decoder_relative_bias`` (and the token table / tied head
``shared_embedding``), whose gradients the runtime sums across stages. The cross-attention bias is zero
(HF builds zeros in decoder layer 0 and passes them on; so do we, per stage).

Gradient of ``enc_out``. Every decoder layer cross-attends to ``enc_out``, so its gradient is the sum
over all decoder stages. A decoder stage that receives ``enc_out`` sends ``enc_out.view_as(enc_out)``
(an identity node) downstream. The executor marks received tensors ``requires_grad`` and calls
``torch.autograd.backward([dec_hidden, enc_out_sent], [grad_dec, grad_enc])``: the downstream gradient
enters through the identity node and the stage's own cross-attention gradient through ``dec_hidden``'s
graph; autograd adds both into the received ``enc_out``'s ``.grad``, which is what the stage sends back.
The seam stage produces ``enc_out`` itself, so there both gradients flow on into its encoder layers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.t5.modeling_t5 import T5Attention

from dynabatch.cost.model_specs import BLOCK_HALVES, ENCODER_ATTENTION_KINDS
from dynabatch.models.attention import Segments, build_segments
from dynabatch.models.block_parts import stage_blocks
from dynabatch.models.boundary_copies import boundary_tied_parameters, hold_copies, units_to_run
from dynabatch.models.masks import cross_segment_mask
from dynabatch.models.recompute import run_block
from dynabatch.models.stage import StageModule, StageOutput, loss_output

SHARED_EMBEDDING = "shared_embedding"
ENCODER_RELATIVE_BIAS = "encoder_relative_bias"
DECODER_RELATIVE_BIAS = "decoder_relative_bias"
DECODER_KINDS = ("decoder_embedding", "t5_decoder", "lm_head")
ENCODER_BLOCK = "t5_encoder"
ENCODER_ATTENTION_HALF, ENCODER_FFN_HALF = BLOCK_HALVES[ENCODER_BLOCK]


def t5_tied_groups(kinds: tuple[str, ...], tied_head: bool) -> tuple[str, ...]:
    """Tied-parameter groups a T5 stage with layer ``kinds`` holds (``tied_head``: lm_head is the table)."""
    groups = []
    if "embedding" in kinds or "decoder_embedding" in kinds or (tied_head and "lm_head" in kinds):
        groups.append(SHARED_EMBEDDING)
    if any(k in ENCODER_ATTENTION_KINDS for k in kinds):  # an encoder FFN half alone needs no position bias
        groups.append(ENCODER_RELATIVE_BIAS)
    if "t5_decoder" in kinds:
        groups.append(DECODER_RELATIVE_BIAS)
    return tuple(groups)


def relative_position_bias(table: nn.Embedding, config, query_length: int, key_length: int, bidirectional: bool):
    """T5's bucketed relative position bias, (1, H, Q, K): the values of ``T5Attention.compute_bias`` with
    no cache, computed from the ``Q + K - 1`` distinct offsets instead of all ``Q x K`` pairs.

    The bias is Toeplitz (it depends on ``j - i`` only): bucket and look up each offset once, ``vals``
    (Q + K - 1, H), then window it (``unfold``: row ``i`` is ``vals[Q - 1 - i : Q - 1 - i + K]``). The
    backward then sums the windows' gradients (``unfold``'s native backward) into Q + K - 1 rows before
    the embedding's scatter, instead of scattering Q x K x H values; at Q = K = 2048 with 4 heads that
    takes the bias's forward + backward from about 0.8-1.0 s to 0.1-0.3 s on one CPU core. Values are
    bitwise HF's; gradients equal up to summation order (tests/unit/models/test_stage_split.py).
    """
    offsets = torch.arange(-(query_length - 1), key_length, dtype=torch.long, device=table.weight.device)
    buckets = T5Attention._relative_position_bucket(
        offsets,  # (Q + K - 1,) = memory - context for every distinct pair
        bidirectional=bidirectional,
        num_buckets=config.relative_attention_num_buckets,
        max_distance=config.relative_attention_max_distance,
    )
    vals = table(buckets)  # (Q + K - 1, H)
    windows = vals.unfold(0, key_length, 1)  # (Q, H, K): windows[k, h, j] = vals[k + j, h]
    return windows.flip(0).permute(1, 0, 2).unsqueeze(0)  # [i, j] = vals[Q - 1 - i + j]: (1, H, Q, K)


def _blocks_before(layout, stage_index: int, kind: str) -> int:
    return sum(k == kind for s in layout.stages[:stage_index] for k in s)


def _clamp_fp16(hidden: torch.Tensor) -> torch.Tensor:
    """HF ``T5Block``'s clamp after each sub-layer under fp16 (inf values to the largest finite ones)."""
    if hidden.dtype != torch.float16:
        return hidden
    top = torch.finfo(hidden.dtype).max
    clamp_value = torch.where(torch.isinf(hidden).any(), top - 1000, top)
    return torch.clamp(hidden, min=-clamp_value, max=clamp_value)


class EncoderAttentionHalf(nn.Module):
    """The first half of a T5 encoder block (``t5_enc_attn``): its ``T5LayerSelfAttention`` (norm, self-attention
    with the position bias, residual add) and the fp16 clamp; returns a 1-tuple like ``T5Block``'s first output."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.self_attention = block.layer[0]

    def forward(self, hidden: torch.Tensor, attention_mask, position_bias: torch.Tensor) -> tuple[torch.Tensor]:
        out = self.self_attention(hidden, attention_mask=attention_mask, position_bias=position_bias)[0]
        return (_clamp_fp16(out),)  # (B, E, d)


class EncoderFeedForwardHalf(nn.Module):
    """The second half of a T5 encoder block (``t5_enc_ffn``): its ``T5LayerFF`` (norm, FFN, residual add) and the
    fp16 clamp. It takes no mask and no position bias."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.feed_forward = block.layer[-1]

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor]:
        return (_clamp_fp16(self.feed_forward(hidden)),)  # (B, E, d)


def encoder_parts(model: nn.Module, layout, stage_index: int) -> list[nn.Module]:
    """The encoder modules stage ``stage_index`` runs, in order: whole ``T5Block`` s, or the half of one that a
    stage boundary cuts."""
    half = {ENCODER_ATTENTION_HALF: EncoderAttentionHalf, ENCODER_FFN_HALF: EncoderFeedForwardHalf}
    blocks = model.encoder.block
    return [half[kind](blocks[i]) if kind in half else blocks[i]
            for i, kind in stage_blocks(layout, stage_index, ENCODER_BLOCK)]


class T5Stage(StageModule):
    """Stage ``stage_index`` of a T5 pipeline cut by a :class:`~dynabatch.cost.stages.StageLayout`.

    A stage with any decoder kind has role ``decoder`` (:meth:`PipelineSpec.from_layout`): it sends
    ``dec_hidden`` (B, D, d) and ``enc_out`` (B, E, d). Other stages send ``enc_hidden`` (B, E, d).
    A stage that starts in the encoder (or at the seam) receives ``enc_hidden``; one that starts in
    the decoder receives ``dec_hidden`` + ``enc_out``.
    """

    parameter_map: dict[str, str]
    """Stage parameter name -> the original model's parameter name (tied copies map to the canonical
    names ``shared.weight`` and ``{encoder,decoder}.block.0.layer.0.SelfAttention.relative_attention_bias.weight``);
    filled by :func:`dynabatch.models.split.build_stage`."""

    def __init__(self, model: nn.Module, layout, stage_index: int, moving_boundaries: bool = False) -> None:
        super().__init__()
        kinds = self._place(layout, stage_index, moving_boundaries)
        self.config = model.config
        self.has_seam = "decoder_embedding" in kinds
        self.is_decoder_role = any(k in DECODER_KINDS for k in kinds)
        self.starts_in_decoder = kinds[0] in ("t5_decoder", "lm_head")
        self.tied_head = model.lm_head.weight is model.shared.weight
        if self.has_embedding or self.has_seam or self.has_head and self.tied_head:
            self.shared = model.shared
        # Relative-bias tables are registered before the blocks: on the stage holding layer 0 the
        # table is layer 0's own module, and the stage-level name is the one named_parameters keeps.
        first_dec, num_dec = _blocks_before(layout, stage_index, "t5_decoder"), kinds.count("t5_decoder")
        if any(k in ENCODER_ATTENTION_KINDS for k in self.held_kinds):  # a held copy's attention needs it too
            self.encoder_relative_bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias
        if num_dec:
            self.decoder_relative_bias = model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias
        if self.has_embedding or self.has_seam:
            self.encoder_dropout = model.encoder.dropout
        self.encoder_blocks = nn.ModuleList(encoder_parts(model, layout, stage_index))
        hold_copies(self, lambda i: encoder_parts(model, layout, i))  # units move within the encoder only
        if self.has_seam:
            self.encoder_final_layer_norm = model.encoder.final_layer_norm
        if self.has_seam or self.has_head:
            self.decoder_dropout = model.decoder.dropout
        self.decoder_blocks = nn.ModuleList(model.decoder.block[first_dec : first_dec + num_dec])
        if self.has_head:
            self.decoder_final_layer_norm = model.decoder.final_layer_norm
            self.lm_head = model.lm_head

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """The stage's copies of ``shared_embedding``, ``encoder_relative_bias``, ``decoder_relative_bias``; under
        moving boundaries also the encoder units either side of a boundary may run (by original parameter name)."""
        out = boundary_tied_parameters(self)
        for group in t5_tied_groups(self.held_kinds, self.tied_head):
            if group == SHARED_EMBEDDING:
                out[group] = self.shared.weight
            elif group == ENCODER_RELATIVE_BIAS:
                out[group] = self.encoder_relative_bias.weight
            else:
                out[group] = self.decoder_relative_bias.weight
        return out

    def movable_units(self) -> nn.ModuleList:
        """The encoder units (units never cross the encoder/decoder seam)."""
        return self.encoder_blocks

    def forward(self, received: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], *,
                moves: tuple[int, int] = (0, 0)) -> StageOutput:
        """``moves``: the micro-batch's moves at the boundaries below and above the stage (which encoder units run,
        :func:`~dynabatch.models.boundary_copies.units_to_run`)."""
        device, dtype = self._device_dtype()
        enc_seg = loaded["segment_ids"]  # (B, E), host: masks are built from it
        dec_seg = loaded["decoder_segment_ids"] if self.is_decoder_role else None  # (B, D), host
        enc_hidden = received.get("enc_hidden")  # (B, E, d) on stages that start in the encoder
        dec_hidden = received.get("dec_hidden")  # (B, D, d) on stages that start in the decoder
        enc_out = received.get("enc_out")  # (B, E, d) likewise
        if self.has_embedding:
            input_ids = loaded["input_ids"].to(device, non_blocking=True)  # (B, E)
            enc_hidden = self.encoder_dropout(self.shared(input_ids))  # (B, E, d)
        encoder_units = units_to_run(self, moves)
        if encoder_units:
            enc_hidden = self._run_encoder(encoder_units, enc_hidden, enc_seg, dtype)
        if self.has_seam:
            enc_out = self.encoder_dropout(self.encoder_final_layer_norm(enc_hidden))  # (B, E, d)
            decoder_input_ids = loaded["decoder_input_ids"].to(device, non_blocking=True)  # (B, D)
            dec_hidden = self.decoder_dropout(self.shared(decoder_input_ids))  # (B, D, d)
        if self.decoder_blocks:
            dec_hidden = self._run_decoder(dec_hidden, enc_out, dec_seg, enc_seg, dtype)
        if self.has_head:
            return self._loss(dec_hidden, loaded["labels"].to(device, non_blocking=True), dec_seg.to(device))
        if not self.is_decoder_role:
            return StageOutput(sends={"enc_hidden": enc_hidden})
        if self.starts_in_decoder:  # relay the received enc_out through an identity node (module docstring)
            enc_out = enc_out.view_as(enc_out)
        return StageOutput(sends={"dec_hidden": dec_hidden, "enc_out": enc_out})

    def _run_encoder(self, units, hidden: torch.Tensor, enc_seg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Encoder ``units`` (blocks or halves) on (B, E, d) with the bidirectional segment mask (or Segments) and
        the stack's bias, both built only when a unit run here has self-attention."""
        attention = None
        for block in units:
            if isinstance(block, EncoderFeedForwardHalf):
                hidden = run_block(block, hidden)[0]  # (B, E, d)
                continue
            if attention is None:
                mask = self.self_attention_mask("bidirectional", enc_seg, dtype, hidden.device)
                n = mask.max_len if isinstance(mask, Segments) else hidden.shape[1]  # Segments: the longest window
                bias = relative_position_bias(self.encoder_relative_bias, self.config, n, n, bidirectional=True)
                attention = (mask, bias)  # bias: (1, H, n, n)
            hidden = run_block(block, hidden, *attention)[0]  # (B, E, d)
        return hidden

    def _run_decoder(self, hidden, enc_out, dec_seg, enc_seg, dtype: torch.dtype) -> torch.Tensor:
        """Decoder blocks on (B, D, d): causal self-attention with position bias, cross-attention to enc_out."""
        device = hidden.device
        self_mask = self.self_attention_mask("causal", dec_seg, dtype, device)
        cross_bias = None  # dense: the first block builds zeros (1, H, D, E), as HF's decoder layer 0 does
        if isinstance(self_mask, Segments):
            cross_mask = build_segments("cross", dec_seg, enc_seg, device=device)
            n = self_mask.max_len
            # per-segment cross-attention drops the (zero) bias: skip HF's (1, H, D, E) zeros, which for one long
            # packed row cost more than the attention itself
            cross_bias = hidden.new_zeros((1, self.config.num_heads, 1, 1))
        else:
            cross_mask = cross_segment_mask(dec_seg.to(device), enc_seg.to(device), dtype)  # (B, 1, D, E)
            n = hidden.shape[1]
        bias = relative_position_bias(self.decoder_relative_bias, self.config, n, n, bidirectional=False)  # (1, H, n, n)
        for block in self.decoder_blocks:
            hidden, _, cross_bias = run_block(block, hidden, self_mask, bias, enc_out, cross_mask, cross_bias)
        return hidden  # (B, D, d)

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor, segment_ids: torch.Tensor) -> StageOutput:
        """Final norm, dropout, tied-head rescale, lm_head and the fp32 token-loss sum."""
        hidden = self.decoder_dropout(self.decoder_final_layer_norm(hidden))  # (B, D, d)
        if getattr(self.config, "scale_decoder_outputs", False):  # tied T5 (not mT5): as T5ForConditionalGeneration
            hidden = hidden * (self.config.d_model**-0.5)
        return loss_output(self.lm_head(hidden), labels, segment_ids)  # logits (B, D, V)
