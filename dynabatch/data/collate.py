"""Turn rows of samples into model-ready micro-batches.

A *row* is a list of sample indices into a global batch. Padding batchers put one
sample in each row; packing batchers put several. Each row is laid out left to
right, segments numbered from 1, positions restarting per sample, then padded to
the micro-batch length (or to an explicit fixed length, for fixed-shape packing).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dynabatch.data.microbatch import IGNORE_INDEX, CausalMicroBatch, Seq2SeqMicroBatch
from dynabatch.data.sample import TokenizedSample
from dynabatch.core.sequence import is_seq2seq

Rows = Sequence[Sequence[int]]


def collate_rows(samples: Sequence[TokenizedSample], rows: Rows, family: str, tokens, encoder_len: int | None = None,
                 decoder_len: int | None = None, loss_on_inputs: bool = False):
    """Rows of ``samples`` as one micro-batch of the sequence kind ``family`` (:func:`collate_seq2seq` or
    :func:`collate_causal`, ``encoder_len`` the fixed row length there), padded with ``tokens``' ids
    (:class:`~dynabatch.data.tokenize.TokenizerInfo`)."""
    if is_seq2seq(family):
        return collate_seq2seq(samples, rows, tokens.pad_id, tokens.decoder_start_id, encoder_len, decoder_len)
    return collate_causal(samples, rows, tokens.pad_id, encoder_len, loss_on_inputs)


def sample_loss_tokens(input_lens, target_lens, family: str, loss_on_inputs: bool = False) -> np.ndarray:
    """(N,) int64: the loss tokens the collate functions lay out for each sample of these lengths (arrays), from
    the lengths alone: every target token of an encoder-decoder; a decoder-only sample's tokens after its first
    loss position (``max(input_len, 1)``, or 1 with ``loss_on_inputs``: its first token is never predicted)."""
    input_lens, target_lens = np.asarray(input_lens, dtype=np.int64), np.asarray(target_lens, dtype=np.int64)
    if is_seq2seq(family):
        return target_lens.copy()
    first = 1 if loss_on_inputs else np.maximum(input_lens, 1)
    return np.maximum(input_lens + target_lens - first, 0)


def loss_token_count(input_lens, target_lens, family: str, loss_on_inputs: bool = False) -> int:
    """The loss tokens of all these samples together (:func:`sample_loss_tokens`)."""
    return int(sample_loss_tokens(input_lens, target_lens, family, loss_on_inputs).sum())


def _check_length(needed: int, fixed: int | None, what: str) -> int:
    if fixed is None:
        return needed
    if needed > fixed:
        raise ValueError(f"{what}: a row needs {needed} tokens but the fixed row length is {fixed}")
    return fixed


def collate_causal(
    samples: Sequence[TokenizedSample],
    rows: Rows,
    pad_id: int,
    row_len: int | None = None,
    loss_on_inputs: bool = False,
) -> CausalMicroBatch:
    """Lay out rows of decoder-only samples (``inputs + targets``) into one micro-batch.

    Loss is taken on target tokens (and on inputs after the first token if ``loss_on_inputs``);
    the first token of a sample is never a target, so nothing is predicted across a boundary.
    """
    lengths = [sum(samples[i].num_tokens for i in row) for row in rows]
    width = _check_length(max(lengths), row_len, "causal collate")
    num_rows = len(rows)
    input_ids = np.full((num_rows, width), pad_id, dtype=np.int64)
    target_ids = np.full((num_rows, width), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((num_rows, width), dtype=np.int64)
    segment_ids = np.zeros((num_rows, width), dtype=np.int64)
    for r, row in enumerate(rows):
        offset = 0
        for seg, sample_index in enumerate(row, start=1):
            s = samples[sample_index]
            n_in, n = s.input_len, s.num_tokens
            seq = np.concatenate([s.input_ids, s.target_ids])
            span = slice(offset, offset + n)
            input_ids[r, span] = seq
            position_ids[r, span] = np.arange(n)
            segment_ids[r, span] = seg
            # Position t predicts token t+1 when t+1 is a loss token of the same sample.
            first_loss = 1 if loss_on_inputs else max(n_in, 1)
            target_ids[r, offset + first_loss - 1 : offset + n - 1] = seq[first_loss:]
            offset += n
    return CausalMicroBatch(
        input_ids=torch.from_numpy(input_ids),
        target_ids=torch.from_numpy(target_ids),
        position_ids=torch.from_numpy(position_ids),
        segment_ids=torch.from_numpy(segment_ids),
        sample_ids=tuple(tuple(row) for row in rows),
    )


def collate_seq2seq(
    samples: Sequence[TokenizedSample],
    rows: Rows,
    pad_id: int,
    decoder_start_id: int,
    encoder_len: int | None = None,
    decoder_len: int | None = None,
) -> Seq2SeqMicroBatch:
    """Lay out rows of encoder-decoder samples: inputs into encoder rows, targets into decoder rows.

    Segment k of a row's decoder belongs to segment k of its encoder, so cross-attention can be
    confined to the same sample. Each sample's decoder input is its targets shifted right behind
    ``decoder_start_id`` (T5 uses the pad id).
    """
    enc_lengths = [sum(samples[i].input_len for i in row) for row in rows]
    dec_lengths = [sum(samples[i].target_len for i in row) for row in rows]
    e = _check_length(max(enc_lengths), encoder_len, "encoder collate")
    d = _check_length(max(dec_lengths), decoder_len, "decoder collate")
    num_rows = len(rows)
    enc_ids = np.full((num_rows, e), pad_id, dtype=np.int64)
    enc_seg = np.zeros((num_rows, e), dtype=np.int64)
    enc_pos = np.zeros((num_rows, e), dtype=np.int64)
    dec_ids = np.full((num_rows, d), pad_id, dtype=np.int64)
    labels = np.full((num_rows, d), IGNORE_INDEX, dtype=np.int64)
    dec_seg = np.zeros((num_rows, d), dtype=np.int64)
    dec_pos = np.zeros((num_rows, d), dtype=np.int64)
    for r, row in enumerate(rows):
        e_off = d_off = 0
        for seg, sample_index in enumerate(row, start=1):
            s = samples[sample_index]
            ne, nd = s.input_len, s.target_len
            enc_ids[r, e_off : e_off + ne] = s.input_ids
            enc_seg[r, e_off : e_off + ne] = seg
            enc_pos[r, e_off : e_off + ne] = np.arange(ne)
            labels[r, d_off : d_off + nd] = s.target_ids
            dec_ids[r, d_off] = decoder_start_id
            dec_ids[r, d_off + 1 : d_off + nd] = s.target_ids[:-1]
            dec_seg[r, d_off : d_off + nd] = seg
            dec_pos[r, d_off : d_off + nd] = np.arange(nd)
            e_off += ne
            d_off += nd
    return Seq2SeqMicroBatch(
        input_ids=torch.from_numpy(enc_ids),
        encoder_segment_ids=torch.from_numpy(enc_seg),
        encoder_position_ids=torch.from_numpy(enc_pos),
        decoder_input_ids=torch.from_numpy(dec_ids),
        labels=torch.from_numpy(labels),
        decoder_segment_ids=torch.from_numpy(dec_seg),
        decoder_position_ids=torch.from_numpy(dec_pos),
        sample_ids=tuple(tuple(row) for row in rows),
    )
