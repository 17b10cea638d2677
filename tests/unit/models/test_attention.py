"""Padding-free attention (dynabatch.models.attention) against the dense-mask reference.

Segments are read correctly from segment ids (runs, groups, token-slice context, cross-attention); for
GPT-2, Llama (GQA) and T5 a stage built with ``attention="segments"`` gives the loss and gradients of the
same stage built with ``attention="dense"`` on padded, packed and (causal) token-sliced micro-batches; in a
packed row one sample's loss has exactly zero gradient with respect to another sample's input embeddings.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynabatch.data.collate import collate_causal, collate_seq2seq
from dynabatch.data.microbatch import IGNORE_INDEX, token_slices
from dynabatch.data.sample import TokenizedSample
from dynabatch.cost import pairs
from dynabatch.models import attention
from dynabatch.models.attention import SEGMENT_ATTENTION, build_segments
from dynabatch.models.forward import forward_loss
from dynabatch.models.presets import PAD_ID, build_model
from dynabatch.models.split import build_stage, build_stages, layout_for, micro_batch_inputs, pipeline_spec_for
from family_configs import build, decoder_config, t5_config
from test_stage_split import _run_pipeline, _summed_stage_grads

ROWS = {"padded": [[0], [1], [2], [3], [4]], "packed": [[0, 1, 2], [3, 4]], "mixed": [[0], [1, 2, 3], [4]]}


def _samples(seed: int = 0, num: int = 5) -> list[TokenizedSample]:
    rng = np.random.default_rng(seed)
    return [TokenizedSample("t", rng.integers(3, 500, int(rng.integers(2, 12))).astype(np.int32),
                            rng.integers(3, 500, int(rng.integers(2, 8))).astype(np.int32)) for _ in range(num)]


MODELS = {
    "gpt2": lambda: build_model("gpt2-tiny", vocab_size=512, dropout=0.0, seed=0).train(),
    "llama": lambda: build(decoder_config("llama")),
    "t5": lambda: build(t5_config("gated")),
}


def _micro_batch(family: str, rows):
    if family == "t5":
        return collate_seq2seq(_samples(), rows, pad_id=PAD_ID, decoder_start_id=PAD_ID)
    return collate_causal(_samples(), rows, pad_id=PAD_ID)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    atol = max(1e-5, 2e-6 * float(want.detach().abs().max()))  # unnormalised loss sums: gradients up to ~50
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=atol, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------------------------------ layouts


def test_segments_are_read_from_segment_ids():
    ids = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1], [1, 1, 2, 2, 3, 0]])
    seg = build_segments("causal", ids)
    spans = sorted((int(r), int(s), g.query_len) for g in seg.groups for r, s in zip(g.rows, g.query_starts))
    assert spans == [(0, 0, 3), (0, 3, 2), (1, 0, 6), (2, 0, 2), (2, 2, 2), (2, 4, 1)]
    assert sorted(g.query_len for g in seg.groups) == [1, 2, 3, 6]  # one SDPA call per distinct length
    assert seg.max_len == 6 and not seg.is_dense_rows
    assert seg.num_pairs == 9 + 4 + 36 + 4 + 4 + 1  # the dense mask would cover 3 x 6 x 6 = 108 pairs
    assert build_segments("bidirectional", torch.ones(4, 5, dtype=torch.long)).is_dense_rows


def test_slice_and_cross_segments_find_their_keys():
    context = torch.tensor([[1, 1, 1, 1], [1, 1, 2, 2]])
    ids = torch.tensor([[1, 1, 2], [2, 3, 3]])  # row 0: sample 1 continues, sample 2 starts; row 1 likewise
    seg = build_segments("causal", ids, context_segment_ids=context)
    found = {(int(r), int(q)): (g.query_len, int(k), g.key_len)
             for g in seg.groups for r, q, k in zip(g.rows, g.query_starts, g.key_starts)}
    assert found == {(0, 0): (2, 0, 6), (0, 2): (1, 6, 1), (1, 0): (1, 2, 3), (1, 1): (2, 5, 2)}
    cross = build_segments("cross", torch.tensor([[1, 1, 2, 0]]), torch.tensor([[1, 2, 2, 2, 0]]))
    found = {int(q): (g.query_len, int(k), g.key_len) for g in cross.groups for q, k in zip(g.query_starts, g.key_starts)}
    assert found == {0: (2, 0, 1), 2: (1, 1, 3)}
    with pytest.raises(ValueError, match="segment 3 of row 0 has queries but no keys"):
        build_segments("cross", torch.tensor([[1, 3]]), torch.tensor([[1, 2]]))


def test_near_equal_lengths_share_one_padded_call(monkeypatch):
    ids = torch.tensor([[1] * 8 + [2] * 7 + [3] * 3, [1] * 6 + [0] * 12])
    seg = build_segments("causal", ids)  # samples alone in their rows are grouped apart from packed ones
    assert [(g.size, g.query_len, g.uniform, g.whole_rows) for g in seg.groups] == [
        (1, 6, True, True), (2, 8, False, False), (1, 3, True, False)]
    lone = build_segments("bidirectional", torch.tensor([[1] * 8, [1] * 7 + [0], [1] * 8]))
    assert [(g.size, g.uniform, g.all_rows) for g in lone.groups] == [(3, False, True)]
    assert lone.groups[0].rows.tolist() == [0, 1, 2] and not lone.is_dense_rows
    monkeypatch.setattr(pairs, "PAD_TOLERANCE", 0.0)
    assert [g.size for g in build_segments("causal", ids).groups] == [1, 1, 1, 1]


def test_segment_attention_returns_sdpas_dtype_under_autocast():
    """Under bf16 autocast SDPA computes in bf16 even when the queries are fp32 (Llama's rotary embedding leaves
    them so): the output takes SDPA's dtype. It was allocated like the queries, and index_put refused the bf16
    groups, so Llama could not train in bf16 on the padding-free path."""
    from dynabatch.models.attention import segment_attention

    torch.manual_seed(0)
    ids = torch.tensor([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])  # a packed row and a padded one
    q, k, v = (torch.randn(2, 2, 6, 8) for _ in range(3))
    seg = build_segments("causal", ids)
    reference = segment_attention(q, k, v, seg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = segment_attention(q, k, v, seg)
    assert out.dtype == torch.bfloat16 and reference.dtype == torch.float32
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_switched_model_still_runs_dense_masks_and_generation(implementation):
    model = MODELS["gpt2"]().eval()
    model.config._attn_implementation = implementation
    mb = _micro_batch("gpt2", ROWS["packed"])
    with torch.no_grad():
        want = forward_loss(model, mb).loss_sum
        ids = torch.tensor([[5, 6, 7]])
        generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID)
        attention.use_segment_attention(model)
        assert model.config._attn_implementation == SEGMENT_ATTENTION
        assert attention._DENSE_IMPLEMENTATION[id(model.config)] == implementation
        torch.testing.assert_close(forward_loss(model, mb).loss_sum, want)  # 4-D masks: the old implementation
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD_ID), generated)


@pytest.mark.parametrize("family", list(MODELS))
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_switched_model_called_the_hf_way_keeps_its_padding_mask(family, implementation):
    """After ``forward_loss(model, mb, "segments")`` (and so after ``DynaBatchTrainer``) the model's config names
    the padding-free implementation, for which transformers built no mask: ``model(ids, attention_mask=...)`` and
    ``generate`` on a padded batch attended to the padding (T5's encoder outputs off by ~1 on real tokens)."""
    import copy

    model = MODELS[family]().eval()
    for sub in model.modules():
        if getattr(sub, "config", None) is not None:
            sub.config._attn_implementation = implementation
    reference = copy.deepcopy(model)
    attention.use_segment_attention(model)
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])  # a left-padded row, as decoder-only generation pads
    mask = (ids != 0).long()
    extra = {"decoder_input_ids": torch.tensor([[0, 5, 6], [0, 7, 8]])} if family == "t5" else {}
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, **extra).logits
        want = reference(input_ids=ids, attention_mask=mask, **extra).logits
        real = torch.ones(got.shape[:2], dtype=torch.bool) if family == "t5" else mask.bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
        kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=PAD_ID)
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))


@pytest.mark.parametrize("family", list(MODELS))
def test_whole_model_padding_free_loss_equals_the_dense_one(family):
    model = MODELS[family]()
    mb = _micro_batch(family, ROWS["mixed"])
    want = forward_loss(model, mb)
    want.loss_sum.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = forward_loss(model, mb, attention="segments")
    got.loss_sum.backward()
    _close(got.loss_sum, want.loss_sum, "loss")
    assert got.num_loss_tokens == want.num_loss_tokens
    _close(got.token_losses.detach(), want.token_losses.detach(), "token losses")
    for name, p in model.named_parameters():
        _close(p.grad, want_grads[name], name)


# ------------------------------------------------------------------------------------------ equality


@pytest.mark.parametrize("rows,tolerance", [("mixed", None), ("mixed", 0.0), ("mixed", 1.0)])
@pytest.mark.parametrize("family", list(MODELS))
def test_segments_equal_the_dense_path(family, rows, tolerance, monkeypatch):
    """Padded-only and packed-only micro-batches against the whole-model dense reference:
    tests/unit/models/test_stage_split.py and test_llama_family.py (their stages are padding-free)."""
    if tolerance is not None:  # 0: one SDPA call per exact length; 1: every sample padded into one call
        monkeypatch.setattr(pairs, "PAD_TOLERANCE", tolerance)
    model = MODELS[family]()
    layout = layout_for(model, 2)
    spec, mb = pipeline_spec_for(model, layout), _micro_batch(family, ROWS[rows])
    results = {}
    for path in ("dense", "segments"):
        stages = build_stages(model, layout, path)
        assert all(s.attention == path for s in stages)
        loss, _ = _run_pipeline(stages, spec, mb)
        results[path] = (loss.detach(), _summed_stage_grads(stages))
    configs = [m.config for m in stages[0].modules() if hasattr(m, "config")]
    assert configs and all(c._attn_implementation == SEGMENT_ATTENTION for c in configs)
    assert model.config._attn_implementation != SEGMENT_ATTENTION  # the model itself is not modified
    _close(results["segments"][0], results["dense"][0], "loss")
    for name, grad in results["dense"][1].items():
        _close(results["segments"][1][name], grad, name)


def _sliced_grads(stage, spec, mb, bounds):
    stage.zero_grad(set_to_none=True)
    outs, context = [], None
    for piece in token_slices(mb, bounds):
        out = stage({}, micro_batch_inputs(piece, spec, 0), context, sliced=True)
        context = out.slice_record.extend()
        outs.append(out)
    carried = None
    for out in reversed(outs):
        extra, grads = out.slice_record.backward_roots(carried)
        torch.autograd.backward([out.loss_sum, *extra], [None, *grads])
        carried = out.slice_record.context_grads(carried)
    loss = sum(o.loss_sum.detach() for o in outs)
    return loss, {n: p.grad.clone() for n, p in stage.named_parameters()}


@pytest.mark.parametrize("tolerance", [None, 1.0])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sliced_segments_equal_the_unsliced_dense_stage(family, tolerance, monkeypatch):
    if tolerance is not None:  # every sample of a slice padded into one call: per-sample bottom-right offsets
        monkeypatch.setattr(pairs, "PAD_TOLERANCE", tolerance)
    model = MODELS[family]()
    layout = layout_for(model, 1)
    spec, mb = pipeline_spec_for(model, layout), _micro_batch(family, ROWS["mixed"])
    dense = build_stage(model, layout, 0, "dense")
    want = dense({}, micro_batch_inputs(mb, spec, 0))
    want.loss_sum.backward()
    want_grads = {n: p.grad for n, p in dense.named_parameters()}
    width = mb.shape[1]
    stage = build_stage(model, layout, 0, "segments")
    for bounds in ([0, 1, 4, 9, width], [0, width // 2, width]):  # slices cut inside samples and between them
        loss, grads = _sliced_grads(stage, spec, mb, bounds)
        _close(loss, want.loss_sum.detach(), f"loss {bounds}")
        for name, grad in want_grads.items():
            _close(grads[name], grad, f"{name} {bounds}")


# ------------------------------------------------------------------------------------------ isolation


def _embedding_outputs(stage) -> list[torch.Tensor]:
    """Capture (and keep the gradients of) every output of the stage's token embedding."""
    captured: list[torch.Tensor] = []

    def hook(_module, _inputs, output):
        output.retain_grad()
        captured.append(output)

    stage.get_submodule({"gpt2": "wte", "llama": "embed_tokens", "t5": "shared"}[stage.family]).register_forward_hook(hook)
    return captured


@pytest.mark.parametrize("tolerance", [None, 1.0])
@pytest.mark.parametrize("family", list(MODELS))
def test_one_samples_loss_has_zero_gradient_on_other_samples_inputs(family, tolerance, monkeypatch):
    if tolerance is not None:  # one padded call: a causal sample's window holds the next sample's keys
        monkeypatch.setattr(pairs, "PAD_TOLERANCE", tolerance)
    model = MODELS[family]()
    layout = layout_for(model, 1)
    spec, mb = pipeline_spec_for(model, layout), _micro_batch(family, [[0, 1, 2]])
    stage = build_stage(model, layout, 0, "segments")
    stage.family = family
    captured = _embedding_outputs(stage)
    loaded = micro_batch_inputs(mb, spec, 0)
    seg_of_labels = loaded["decoder_segment_ids"] if family == "t5" else loaded["segment_ids"]
    loaded["labels"] = torch.where(seg_of_labels == 2, loaded["labels"], IGNORE_INDEX)  # sample 2's loss only
    out = stage({}, loaded)
    assert out.num_loss_tokens > 0
    out.loss_sum.backward()
    id_rows = [loaded["segment_ids"]] + ([loaded["decoder_segment_ids"]] if family == "t5" else [])
    for emb, ids in zip(captured, id_rows):
        grad = emb.grad[0]  # (T, d) of the one packed row
        others = (ids[0] != 2) & (ids[0] > 0)
        assert torch.count_nonzero(grad[others]) == 0  # exactly zero, not merely small
        assert torch.count_nonzero(grad[ids[0] == 2]) > 0
