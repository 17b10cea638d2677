"""Per-segment (padding-free) attention pricing: the analytic model and the profiled tables scale the
attention cores with the score pairs they compute; without pairs nothing changes; micro-batches know
their pairs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.pairs import AttentionPairs, groups_pairs, row_pairs, sample_pairs
from dynabatch.cost.planner_model import ProfiledCostModel, ProfiledLayerModel
from dynabatch.cost.segments import equivalent_shape
from dynabatch.cost.stages import StageCostModel
from dynabatch.cost.layer_split import balanced_layout
from dynabatch.cost.tables import CostTables
from test_cost_tables import B, D, E, synthetic_profile  # tests/unit is on sys.path (pytest's prepend import)

FIELDS = ("fwd_time_s", "bwd_time_s", "fwd_flops", "stored_activation_bytes", "peak_extra_bytes")

# Whole-model stage costs computed by the analytic model before per-segment pricing existed (git b31e33e),
# as float.hex: the default (no pairs) must reproduce them bit for bit. The peak_extra values where the LM head
# is the stage's peak were updated when its backward's fp32 logit gradients were priced (H200 runs of 2026-12-04);
# T5's and Llama's stored bytes when RMSNorm's fp32 normalised copy was counted (twenty-fourth: +4 bytes per element
# of each norm's input, 2,084,044,800 bytes on t5-large's (8, 1000, 200)).
GOLDEN = {
    ("t5-large", False, (8, 1000, 200)): ["0x1.61200bec29e78p-4", "0x1.60337379b7466p-3", "0x1.c8a4000000000p+42",
                                          "0x1.c755eb0000000p+34", "0x1.03c4000000000p+29"],
    ("t5-large", True, (8, 1000, 200)): ["0x1.99ca6b6cd5cecp-5", "0x1.a6f6a03570f30p-4", "0x1.c8a4000000000p+42",
                                         "0x1.578e960000000p+33", "0x1.8b50000000000p+28"],
    ("gpt-1.3b", False, (4, 2048, None)): ["0x1.7cb8ae975187fp-3", "0x1.7cb8ae975187fp-2", "0x1.688a200000000p+44",
                                           "0x1.62e5300000000p+35", "0x1.8ca2000000000p+31"],
    ("gpt-1.3b", True, (4, 2048, None)): ["0x1.1c8734399a19dp-3", "0x1.289e5127357eap-2", "0x1.688a200000000p+44",
                                          "0x1.cbf4c00000000p+33", "0x1.8ca2000000000p+31"],
    ("llama3-8b", False, (2, 777, None)): ["0x1.0e0345e5b0c04p-3", "0x1.0e0345e5b0c04p-2", "0x1.5ca0c50000000p+44",
                                           "0x1.dccdf04800000p+33", "0x1.7f30400000000p+30"],
    ("llama3-8b", True, (2, 777, None)): ["0x1.f23d1489bddc0p-4", "0x1.f70504112bc5cp-3", "0x1.5ca0c50000000p+44",
                                          "0x1.24c02c4800000p+33", "0x1.7f30400000000p+30"],
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: f"{k[0]}-flash{k[1]}")
def test_default_is_bitwise_what_it_was(key):
    preset, flash, shape = key
    model = AnalyticCostModel.from_names(preset, "a100-40gb", flash_attention=flash)
    cost = model.stage_cost(model.layer_kinds(), *shape)
    assert [float(getattr(cost, f)).hex() for f in FIELDS] == GOLDEN[key]


@pytest.mark.parametrize("preset", ["gpt-1.3b", "t5-large"])
@pytest.mark.parametrize("flash", [False, True])
def test_dense_pairs_price_as_no_pairs(preset, flash):
    model = AnalyticCostModel.from_names(preset, "a100-40gb", flash_attention=flash)
    rng = np.random.default_rng(0)
    b, e, d = (rng.integers(1, hi, 50).astype(float) for hi in (32, 2048, 512))
    d = d if model.spec.family == "seq2seq" else None
    dense, paired = (model.stage_cost(model.layer_kinds(), b, e, d, pairs=p) for p in (None, AttentionPairs.dense(b, e, d)))
    for f in FIELDS:
        np.testing.assert_allclose(getattr(paired, f), getattr(dense, f), rtol=1e-12)


def _core(model, kind, b, e, d, pairs):
    """Attention-core FLOPs and stored bytes of one layer: the part that grows with the pairs."""
    zero = AttentionPairs(0.0, 0.0, 0.0)
    full, none = model.layer_cost(kind, b, e, d, pairs), model.layer_cost(kind, b, e, d, zero)
    return (full.fwd_flops - none.fwd_flops, full.stored_activation_bytes - none.stored_activation_bytes,
            full.fwd_time_s - none.fwd_time_s)


def test_packed_row_pays_the_sum_of_its_samples_attention():
    """One row of 32 samples x 64 tokens: the attention core is that of 32 one-sample rows of 64 tokens,
    1/32 of the dense 2048^2 row's, and the layer is much cheaper than the dense row."""
    model = AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb")
    packed = AttentionPairs(32 * 64.0**2, 0.0, 0.0)
    flops, stored, _ = _core(model, "gpt", 1, 2048, None, packed)
    one_flops, one_stored, _ = _core(model, "gpt", 1, 64, None, AttentionPairs(64.0**2, 0.0, 0.0))
    dense_flops, dense_stored, _ = _core(model, "gpt", 1, 2048, None, AttentionPairs.dense(1, 2048))
    assert flops == pytest.approx(32 * one_flops, rel=1e-12) and stored == pytest.approx(32 * one_stored, rel=1e-12)
    assert flops == pytest.approx(dense_flops / 32, rel=1e-12) and stored == pytest.approx(dense_stored / 32, rel=1e-12)
    # the dense 4 b T^2 d attention FLOPs are 1/6 of a 2048-token GPT-1.3B block; per segment they vanish
    dense_layer = model.layer_cost("gpt", 1, 2048)
    packed_layer = model.layer_cost("gpt", 1, 2048, pairs=packed)
    assert packed_layer.fwd_flops < 0.87 * dense_layer.fwd_flops
    assert packed_layer.fwd_time_s < dense_layer.fwd_time_s and packed_layer.peak_extra_bytes <= dense_layer.peak_extra_bytes
    # T5: encoder, decoder and cross-attention each follow their own pairs
    t5 = AnalyticCostModel.from_names("t5-large", "a100-40gb")
    rows = AttentionPairs(16 * 64.0**2, 16 * 16.0**2, 16 * 64.0 * 16)
    flops, stored, _ = _core(t5, "t5_decoder", 1, 1024, 256, rows)
    one = _core(t5, "t5_decoder", 1, 64, 16, AttentionPairs(64.0**2, 16.0**2, 64.0 * 16))
    assert flops == pytest.approx(16 * one[0], rel=1e-12) and stored == pytest.approx(16 * one[1], rel=1e-12)


def test_stage_model_takes_pairs_and_rejects_bad_ones():
    model = AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb")
    stages = StageCostModel(model, balanced_layout(model, 4), model.hardware.memory_bytes)
    b, e = np.array([1.0, 4.0]), np.array([2048.0, 512.0])
    dense = stages.evaluate(b, e, np.zeros(2))
    packed = stages.evaluate(b, e, np.zeros(2), pairs=AttentionPairs([32 * 64.0**2, 4 * 512.0**2], 0.0, 0.0))
    assert packed[0][0] < dense[0][0] and packed[0][1] == pytest.approx(dense[0][1], rel=1e-12)
    assert np.all(packed[1] <= dense[1]) and np.all(packed[2] <= dense[2])
    per_stage = stages.per_stage(b, e, np.zeros(2), AttentionPairs.dense(b, e))
    np.testing.assert_allclose(per_stage.fwd_s, stages.per_stage(b, e, np.zeros(2)).fwd_s, rtol=1e-12)
    with pytest.raises(ValueError, match="AttentionPairs"):
        model.layer_cost("gpt", 1, 64, pairs=(1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="broadcast"):
        model.layer_cost("gpt", b, e, pairs=AttentionPairs(np.ones(3), 0.0, 0.0))
    with pytest.raises(ValueError, match=">= 0"):
        AttentionPairs(-1.0, 0.0, 0.0)


# ----------------------------------------------------------------------------- profiled tables

A_BLOCK, A_CORE, C_PAIR, K_BLOCK, K_CORE = 1e-6, 2e-7, 1e-9, 1e-4, 3e-5


def _pairs_cost(kind, b, e, d):
    """Blocks and their cores share the per-pair term; a core also has per-token and per-call terms."""
    if kind.endswith("_attention"):
        if "cross" in kind:
            pairs, tokens = b * d * e, b * (d + e)
        elif "self" in kind:
            pairs, tokens = b * d * d, b * d
        else:
            pairs, tokens = b * e * e, b * e
        fwd = K_CORE + A_CORE * tokens + C_PAIR * pairs
        return fwd, 2 * fwd, 100.0 * tokens + 4.0 * pairs, 200.0 * tokens + 8.0 * pairs
    n = e + d
    pairs = b * (e * e + d * d + e * d) if "block" in kind else 0.0
    fwd = K_BLOCK + A_BLOCK * b * n + C_PAIR * pairs
    return fwd, 2 * fwd, 1000.0 * b * n + 4.0 * pairs, 2000.0 * b * n + 8.0 * pairs


def _tables(family: str, cores: bool = True) -> CostTables:
    profile = synthetic_profile(family, fn=_pairs_cost)
    if cores:
        if family == "gpt2":
            extra, roles = {"gpt2_block_attention": ("b", "E")}, {"gpt2_block": {"encoder": "gpt2_block_attention"}}
        else:
            extra = {"t5_encoder_block_attention": ("b", "E"), "t5_decoder_block_self_attention": ("b", "D"),
                     "t5_decoder_block_cross_attention": ("b", "E", "D")}
            roles = {"t5_encoder_block": {"encoder": "t5_encoder_block_attention"},
                     "t5_decoder_block": {"decoder": "t5_decoder_block_self_attention",
                                          "cross": "t5_decoder_block_cross_attention"}}
        axes = {"b": B, "E": E, "D": D}
        for kind, dims in extra.items():
            grids = [axes[x] for x in dims]
            vals = np.empty((4, *(len(g) for g in grids)))
            for idx in np.ndindex(*vals.shape[1:]):
                v = dict(zip(dims, (g[i] for g, i in zip(grids, idx))))
                vals[(slice(None), *idx)] = _pairs_cost(kind, v["b"], v.get("E", 0), v.get("D", 0))
            profile["layers"][kind] = {"dims": list(dims), "num_params": 0, "tied_params": 0,
                                       "status": np.full(vals.shape[1:], "ok", dtype=object).tolist(),
                                       **{m: vals[i].tolist() for i, m in
                                          enumerate(("fwd_s", "bwd_s", "stored_bytes", "peak_bytes"))}}
        profile["model"]["attention_cores"] = roles
    return CostTables.from_profile(json.loads(json.dumps(profile)))


def test_tables_price_a_packed_row_by_its_pairs():
    """block(b, E, P) = block(b, E) - core(b, E) + core(equivalent shape): exact here, where the per-pair
    term is shared and the equivalent shape (8 rows of 32 tokens) lies on the grid."""
    tables = _tables("gpt2")
    layer = ProfiledLayerModel(tables)
    pairs = AttentionPairs(8 * 32.0**2, 0.0, 0.0)  # one 256-token row of 8 samples
    assert equivalent_shape("encoder", 1.0, 256.0, 1.0, pairs.encoder) == (8.0, 32.0, 1.0)
    got = layer.stage_cost(["gpt"], 1.0, 256.0, pairs=pairs)
    dense = layer.stage_cost(["gpt"], 1.0, 256.0)
    saved = 256**2 - 8 * 32**2  # pairs not computed (the stage's context kind is priced dense either way)
    assert dense.fwd_time_s - got.fwd_time_s == pytest.approx(C_PAIR * saved, rel=1e-9)
    assert dense.bwd_time_s - got.bwd_time_s == pytest.approx(2 * C_PAIR * saved, rel=1e-9)
    assert dense.stored_activation_bytes - got.stored_activation_bytes == pytest.approx(4.0 * saved, rel=1e-9)
    block = layer.tables.layer_cost("gpt2_block", 1.0, 256.0)
    assert block.fwd_s == pytest.approx(K_BLOCK + A_BLOCK * 256 + C_PAIR * 256**2, rel=1e-9)
    # dense pairs and no pairs agree; a profile without cores prices pairs as dense
    again = layer.stage_cost(["gpt"], 1.0, 256.0, pairs=AttentionPairs.dense(1.0, 256.0))
    assert again.fwd_time_s == pytest.approx(dense.fwd_time_s, rel=1e-12)
    plain = ProfiledLayerModel(_tables("gpt2", cores=False)).stage_cost(["gpt"], 1.0, 256.0, pairs=pairs)
    assert plain.fwd_time_s == pytest.approx(dense.fwd_time_s, rel=1e-12)
    # beyond the grid's b (16): 2 rows of 32 x 8 tokens -> core(64, 8), priced as 4 x core(16, 16) (lengths
    # clamped up to the grid, linear in b): cheaper than dense, never below the exact per-pair price
    wide = layer.stage_cost(["gpt"], 2.0, 256.0, pairs=AttentionPairs(64 * 8.0**2, 0.0, 0.0))
    wide_dense = layer.stage_cost(["gpt"], 2.0, 256.0)
    assert wide_dense.fwd_time_s > wide.fwd_time_s > wide_dense.fwd_time_s - C_PAIR * (2 * 256**2 - 64 * 8**2)


def test_tables_price_the_context_on_the_longest_segment():
    """With the pairs' longest segment known, a stage's context kind (masks, position bias) is read at one row of
    that segment, not at the whole row: 8 samples of 32 tokens in one 256-token row."""
    layer = ProfiledLayerModel(_tables("gpt2"))
    plain = AttentionPairs(8 * 32.0**2, 0.0, 0.0)
    known = AttentionPairs(8 * 32.0**2, 0.0, 0.0, longest=(32.0, 0.0))
    row = layer.stage_cost(["gpt"], 1.0, 256.0, pairs=plain)
    segment = layer.stage_cost(["gpt"], 1.0, 256.0, pairs=known)
    assert row.fwd_time_s - segment.fwd_time_s == pytest.approx(A_BLOCK * (256 - 32), rel=1e-6)  # gpt2_context
    one = AttentionPairs(256.0**2, 0.0, 0.0, longest=(256.0, 0.0))  # one sample fills the row: as before
    assert layer.stage_cost(["gpt"], 1.0, 256.0, pairs=one).fwd_time_s == pytest.approx(
        layer.stage_cost(["gpt"], 1.0, 256.0, pairs=AttentionPairs(256.0**2, 0.0, 0.0)).fwd_time_s, rel=1e-12)


def test_tables_t5_roles_and_planner_view():
    tables = _tables("t5")
    model = ProfiledCostModel.even_split(tables, 2, 1e12)
    b, e, d = np.array([1.0, 4.0]), np.array([256.0, 128.0]), np.array([128.0, 32.0])
    pairs = AttentionPairs([8 * 32.0**2, 4 * 128.0**2], [8 * 16.0**2, 4 * 32.0**2], [8 * 32.0 * 16, 4 * 128.0 * 32])
    t, stored, peak = model.evaluate(b, e, d, pairs=pairs)
    t0, stored0, peak0 = model.evaluate(b, e, d)
    assert t[0] < t0[0] and stored[0] < stored0[0]
    assert t[1] == pytest.approx(t0[1], rel=1e-12) and stored[1] == pytest.approx(stored0[1], rel=1e-12)  # dense
    # a decoder block: dense minus the pairs its self- and cross-attention cores do not compute
    layer = ProfiledLayerModel(tables)
    four = AttentionPairs(4 * 64.0**2, 4 * 32.0**2, 4 * 64.0 * 32)  # 4 samples of (64, 32): grid shapes
    got = layer.stage_cost(["t5_decoder"], 1.0, 256.0, 128.0, pairs=four)
    dense = layer.stage_cost(["t5_decoder"], 1.0, 256.0, 128.0)
    saved = C_PAIR * ((128.0**2 - 4 * 32.0**2) + (128.0 * 256 - 4 * 64.0 * 32))
    assert dense.fwd_time_s - got.fwd_time_s == pytest.approx(saved, rel=1e-6)


# ----------------------------------------------------------------------------- pairs of micro-batches


def test_pairs_of_rows_by_hand():
    e, d = np.array([10, 3, 7, 100]), np.array([2, 1, 5, 20])
    # GPT: one sequence of inputs + targets per sample; row (0, 1) holds 12 + 4 tokens, row (2,) 12
    assert row_pairs([(0, 1), (2,)], e, d, "causal") == (12**2 + 4**2 + 12**2, 0.0, 0.0)
    # T5: encoder, decoder and cross blocks per sample
    assert row_pairs([(0, 1), (2,)], e, d, "seq2seq") == (100 + 9 + 49, 4 + 1 + 25, 20 + 3 + 35)
    got = groups_pairs([[(0, 1, 2)], [(3,)]], e, d, "seq2seq")
    np.testing.assert_array_equal(got.encoder, [158.0, 10000.0])
    np.testing.assert_array_equal(got.cross, [58.0, 2000.0])
    np.testing.assert_array_equal(sample_pairs(e, d, "causal")[:, 0], (e + d) ** 2)


def test_method_plans_carry_their_pairs():
    from dynabatch.data.baselines import RowGroup
    from dynabatch.data.batching import LengthLimits
    from dynabatch.data.sample import GlobalBatch, TokenizedSample
    from dynabatch.training.workload import method_micro_batches, micro_batch_pairs

    lens = [(30, 10), (5, 3), (12, 4), (60, 20), (7, 1)]
    batch = GlobalBatch(0, tuple(TokenizedSample("t", np.zeros(a, np.int32), np.zeros(b, np.int32), 0, i)
                                 for i, (a, b) in enumerate(lens)), 0)
    groups = [RowGroup(((0, 1), (2, 4)), 48, None), RowGroup(((3,),), 80, None)]
    pairs = micro_batch_pairs(batch, groups, "causal")
    np.testing.assert_array_equal(pairs.encoder, [40**2 + 8**2 + 16**2 + 8**2, 80.0**2])
    np.testing.assert_array_equal(pairs.calls[0], [3, 1])  # lengths 40, 8, 16, 8: three SDPA calls
    limits = LengthLimits("causal", max_input_len=128, max_target_len=32, max_seq_len=128)
    assert method_micro_batches("packing", batch, limits).pairs is None  # dense block-diagonal masks
    plan = method_micro_batches("packing_free", batch, limits)
    want = [sum((lens[i][0] + lens[i][1]) ** 2 for row in g.rows for i in row) for g in plan.groups]
    np.testing.assert_array_equal(plan.pairs.encoder, want)
    assert plan.pairs.encoder.sum() == sum((a + b) ** 2 for a, b in lens)


def test_attention_calls_add_their_fixed_cost():
    """One SDPA call per group of equal-length segments: each further call launches the core's kernels
    again (analytic) or pays the core table's intercept along b (profiled); the work is unchanged."""
    model = AnalyticCostModel.from_names("gpt-1.3b", "a100-40gb")
    one = model.layer_cost("gpt", 1, 2048, pairs=AttentionPairs(32 * 64.0**2, 0.0, 0.0))
    many = model.layer_cost("gpt", 1, 2048, pairs=AttentionPairs(32 * 64.0**2, 0.0, 0.0, (5.0, 1.0, 1.0)))
    assert many.fwd_flops == one.fwd_flops and many.stored_activation_bytes == one.stored_activation_bytes
    launches = 4 * model.hardware.kernel_launch_s  # QK^T, softmax, dropout, AV
    assert many.fwd_time_s - one.fwd_time_s == pytest.approx(4 * launches, rel=1e-9)
    layer = ProfiledLayerModel(_tables("gpt2"))
    base = layer.stage_cost(["gpt"], 1.0, 256.0, pairs=AttentionPairs(8 * 32.0**2, 0.0, 0.0))
    three = layer.stage_cost(["gpt"], 1.0, 256.0, pairs=AttentionPairs(8 * 32.0**2, 0.0, 0.0, (3.0, 1.0, 1.0)))
    assert three.fwd_time_s - base.fwd_time_s == pytest.approx(2 * K_CORE, rel=1e-6)
    assert three.bwd_time_s - base.bwd_time_s == pytest.approx(4 * K_CORE, rel=1e-6)


def test_groups_share_a_call_only_while_the_padding_is_small():
    """Short near-equal samples share one call; on CPU long ones within the 25% tolerance do not pad to each
    other (885 and 763 tokens: 201,000 wasted pairs, far above what a call costs), and cross-attention counts
    the waste over the keys. Without a bound (cost side, GPUs) the 25% rule alone groups."""
    from dynabatch.cost.pairs import attention_groups, group_waste_limit

    cpu = group_waste_limit("cpu")
    assert cpu < 1e4 and group_waste_limit("cuda") == float("inf")

    def sizes(q, k, limit=cpu):
        return sorted(len(m) for m, _ in attention_groups(q, k, np.zeros(len(q), dtype=bool), limit))

    assert sizes([30, 28, 25], [30, 28, 25]) == [3]
    assert sizes([885, 763], [885, 763]) == [1, 1]
    assert sizes([885, 763], [885, 763], float("inf")) == [2]
    assert sizes([885, 884], [885, 884]) == [2]  # 885 pairs of padding
    # Cross: keys of 500 each; padding the 30-token queries to 40 wastes 10 x 500 pairs.
    assert 10 * 500 > cpu
    assert sizes([30, 40], [500, 500]) == [1, 1]
    assert sizes([30, 31], [500, 500]) == [2]


def test_runtime_groups_follow_the_device_bound():
    """The CPU runtime puts two long samples of one packed row in two calls; the cost side counts one."""
    from dynabatch.cost.pairs import row_calls
    from dynabatch.models.attention import build_segments

    ids = np.array([[1] * 885 + [2] * 763])
    assert [g.size for g in build_segments("bidirectional", ids).groups] == [1, 1]
    assert row_calls([[0, 1]], [885, 763], [10, 10], "t5")[0] == 1


@pytest.mark.parametrize("seed", range(6))
def test_attention_groups_kernel_matches_twin(seed):
    """The numba greedy pass groups exactly as the pure-Python twin of the rule (random lengths with ties, rows
    alone and shared, with and without a padding bound), and row_calls counts those groups."""
    from dynabatch.cost.pairs import attention_groups, row_calls
    from reference import cost_reference as ref

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    q = rng.integers(1, [8, 200, 900][seed % 3], n)
    k = q if seed % 2 else rng.integers(1, 300, n)
    alone = rng.random(n) < 0.5
    for limit in (float("inf"), 2048.0, 0.0):
        got = [(sorted(m.tolist()), flag) for m, flag in attention_groups(q, k, alone, limit)]
        assert [m for m, _ in got] == ref.attention_groups(q, k, alone, limit)
        assert [flag for _, flag in got] == sorted((flag for _, flag in got), reverse=True)
    shared = np.flatnonzero(~alone).tolist()  # one packed row; the others alone in theirs
    rows = [[i] for i in np.flatnonzero(alone).tolist()] + ([shared] if shared else [])
    e, d = rng.integers(1, 500, n), rng.integers(1, 80, n)
    alone_of = np.array([len(r) == 1 for r in rows for _ in r])
    order = [i for r in rows for i in r]  # row_calls sees the samples in row order
    e, d = e[order], d[order]
    rows = [[order.index(i) for i in r] for r in rows]
    assert row_calls(rows, e, d, "t5") == tuple(len(ref.attention_groups(x, y, alone_of))
                                                for x, y in ((e, e), (d, d), (d, e)))


@pytest.mark.parametrize("preset", ["t5-large", "gpt-1.3b"])
@pytest.mark.parametrize("recompute", ["none", "auto", "full", "selective"])
def test_layer_costs_shared_over_stages_price_bitwise_as_stage_by_stage(preset, recompute):
    """A layer kind that several stages hold is priced once per call (the ``layers`` memo of
    :meth:`AnalyticCostModel.stage_cost`, reused by the recomputation terms): per-stage costs equal, bitwise, those
    of the same model priced stage by stage, dense and per segment."""
    import dataclasses

    model = AnalyticCostModel.from_names(preset, "a100-40gb")

    class StageByStage(AnalyticCostModel):
        shares_layer_costs = False

    plain = StageByStage(**{f.name: getattr(model, f.name) for f in dataclasses.fields(model)})
    rng = np.random.default_rng(0)
    lens = [(rng.integers(16, 900, n), rng.integers(1, 200, n)) for n in rng.integers(1, 7, 40)]
    e_all = np.concatenate([e for e, _ in lens])
    d_all = np.concatenate([d for _, d in lens])
    offsets = np.cumsum([0] + [len(e) for e, _ in lens])
    groups = [[[offsets[k] + i] for i in range(len(e))] for k, (e, _) in enumerate(lens)]  # one sample per row
    family = "t5" if preset.startswith("t5") else "gpt2"
    pairs = groups_pairs(groups, e_all, d_all, family)
    b = np.array([len(e) for e, _ in lens], dtype=float)
    E = np.array([e.max() for e, _ in lens], dtype=float)
    D = np.array([d.max() for _, d in lens], dtype=float) if family == "t5" else None
    layout = balanced_layout(model, 4, ref_shape=(4, 512, 128))
    assert any(len(set(a) & set(b_)) for a, b_ in zip(layout.stages, layout.stages[1:]))  # a kind on two stages
    memo = StageCostModel(model, layout, 40 * 2**30, recompute=recompute)
    object.__setattr__(memo, "programs", None)  # the methods with their memo (the compiled programs: test_symbolic.py)
    for work in (None, pairs):
        shared = memo.per_stage(b, E, D, work)
        alone = StageCostModel(plain, layout, 40 * 2**30, recompute=recompute).per_stage(b, E, D, work)
        for field in ("fwd_s", "bwd_s", "stored_bytes", "peak_bytes"):
            assert np.array_equal(getattr(shared, field), getattr(alone, field)), (field, work is None)


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_rows_work_is_row_work_of_each_micro_batch(family):
    """rows_work (all micro-batches in one numpy / numba pass) gives every micro-batch's pairs, calls and longest
    segments exactly as row_work does one by one (rows alone and packed, ties, one-sample micro-batches), and
    refuses a micro-batch without samples the same way."""
    from dynabatch.cost.pairs import row_work, rows_work

    rng = np.random.default_rng(11)
    for _ in range(60):
        n = int(rng.integers(1, 50))
        e, d = rng.integers(0, 900, n), rng.integers(1, 130, n)
        e[rng.random(n) < 0.3] = 300  # ties share attention calls
        perm, groups, k = rng.permutation(n).tolist(), [], 0
        while k < n:
            rows = []
            for _ in range(int(rng.integers(1, 5))):
                if k < n:
                    width = int(rng.integers(1, 4))
                    rows.append(tuple(perm[k:k + width]))
                    k += width
            groups.append(tuple(rows))
        got = rows_work(groups, e, d, family)
        want = [row_work(g, e, d, family) for g in groups]
        assert [tuple(map(tuple, w)) for w in got] == [tuple(map(tuple, w)) for w in want]
        assert all(isinstance(x, float) for w in got for x in w[0])
    for bad in ([()], [((),)]):
        with pytest.raises(ValueError, match="at least one sample"):
            rows_work(bad, [5], [5], family)


def test_call_counts_match_the_twin_few_and_many_samples():
    """``_kernels._count_groups`` (its own sort: insertion for few samples, numpy beyond) counts the groups of the
    pure-Python twin of the rule, with many ties, on micro-batches of one to a hundred samples."""
    from reference import cost_reference as ref

    from dynabatch.cost import _kernels as K
    from dynabatch.cost.pairs import PAD_TOLERANCE

    rng = np.random.default_rng(21)
    for n in [*range(1, 40), 63, 64, 65, 100]:
        for high in (4, 60, 900):
            q = rng.integers(1, high, n)
            k = q if n % 2 else rng.integers(1, high, n)
            alone = rng.random(n) < 0.5
            want = len(ref.attention_groups(q, k, alone))
            assert K._count_groups(q, k, alone, 1.0 - PAD_TOLERANCE) == want, (n, high)


@pytest.mark.parametrize("kinds", [3, 1])
def test_micro_batch_work_kernel_matches_the_twin(kinds):
    """``_work_kernels._micro_batch_work`` (every micro-batch's calls counted from one longest-first order of the
    samples) gives each micro-batch's pairs, calls and longest lengths as the pure-Python twin does one micro-batch at
    a time, on micro-batches laid out as the baseline candidates' are: every sample in several of them (one grouping
    after another), rows of one to three samples (alone or not), many ties, one-sample micro-batches, long ones."""
    from reference import cost_reference as ref

    from dynabatch.cost._work_kernels import _micro_batch_work
    from dynabatch.cost.pairs import PAD_TOLERANCE

    rng = np.random.default_rng(5 + kinds)
    for trial in range(40):
        n = int(rng.integers(1, 90))
        high = (6, 80, 1000)[trial % 3]
        e, d = rng.integers(0, high, n), rng.integers(1, high, n)
        if kinds == 1:  # a decoder-only model: one sequence, no targets
            e, d = e + d, np.zeros(n, dtype=np.int64)
        ids, alone, starts = [], [], [0]
        for _ in range(int(rng.integers(1, 4))):  # groupings of all the samples, one after another
            perm, k = rng.permutation(n), 0
            while k < n:
                for _ in range(int(rng.integers(1, 40))):
                    width = min(int(rng.integers(1, 4)), n - k)
                    ids.extend(perm[k:k + width])
                    alone.extend([width == 1] * width)
                    k += width
                    if k == n:
                        break
                starts.append(len(ids))
        ids, alone, starts = np.array(ids), np.array(alone), np.array(starts)
        got = [np.empty((len(starts) - 1, w), dtype=np.int64) for w in (3, 3, 2)]
        _micro_batch_work(e, d, ids, alone, starts, 1.0 - PAD_TOLERANCE, kinds, *got)
        want = ref.micro_batch_work(e, d, ids, alone, starts, kinds, PAD_TOLERANCE)
        assert tuple(g.tolist() for g in got) == want, trial
