"""Baseline batchers on T5 and GPT-2 layouts: coverage, shapes, masks, token accounting."""

from __future__ import annotations

import pytest
import torch

from dynabatch.core.methods import CAUSAL_ONLY
from dynabatch.data.baselines import BATCHERS, make_batcher
from dynabatch.data.batching import GlobalBatcher, LengthLimits
from dynabatch.data.microbatch import IGNORE_INDEX, CausalMicroBatch, Seq2SeqMicroBatch

OPTIONS = {
    "padding": {"samples_per_micro_batch": 4},
    "length_grouped": {"samples_per_micro_batch": 4},
    "token_budget": {"max_tokens": 512},
    "packing": {"rows_per_micro_batch": 2},
    "packing_free": {"rows_per_micro_batch": 2},
    "packing_free_split": {"row_tokens": 64},
}


@pytest.fixture(scope="module")
def batch_and_limits(toy_data):
    limits = LengthLimits(toy_data.family, max_input_len=128, max_target_len=64, max_seq_len=128)
    return toy_data, GlobalBatcher(toy_data, limits, token_budget=3000).next_batch(), limits


@pytest.mark.parametrize("name", list(BATCHERS))
def test_every_sample_exactly_once_and_tokens_accounted(batch_and_limits, name):
    data, batch, limits = batch_and_limits
    if name in CAUSAL_ONLY and data.family == "seq2seq":  # split rows cut decoder-only sequences: one clear line
        with pytest.raises(ValueError, match="decoder-only.*encoder-decoder"):
            make_batcher(name, limits, data.tokens, **OPTIONS[name])
        return
    batcher = make_batcher(name, limits, data.tokens, **OPTIONS[name])
    micro = batcher(batch)
    prepared = batcher.prepare(batch)  # packing_free_split: its chunks (the same tokens), else the batch itself
    seen = sorted(i for mb in micro for row in mb.sample_ids for i in row)
    assert seen == list(range(len(prepared)))
    assert prepared is batch or len(prepared) > len(batch)
    stats = batcher.stats(batch)
    assert stats.num_micro_batches == len(micro)
    assert stats.real_tokens == sum(mb.num_real_tokens for mb in micro) == batch.num_tokens
    assert stats.computed_tokens == sum(mb.num_computed_tokens for mb in micro)
    assert 0 < stats.efficiency <= 1
    if name == "token_budget":
        assert all(mb.num_computed_tokens <= 512 for mb in micro)
    if name in ("padding", "length_grouped"):
        assert all(len(mb.sample_ids) <= 4 for mb in micro)
    if name in ("packing", "packing_free"):
        assert any(len(row) > 1 for mb in micro for row in mb.sample_ids)  # rows really are packed
        for mb in micro:
            if isinstance(mb, Seq2SeqMicroBatch):
                assert mb.shape[1:] == (128, 64) if name == "packing" else mb.shape[1] <= 128 and mb.shape[2] <= 64
            else:
                assert mb.shape[1] == 128 if name == "packing" else mb.shape[1] <= 128


def test_length_grouping_beats_plain_padding(batch_and_limits):
    data, batch, limits = batch_and_limits
    plain = make_batcher("padding", limits, data.tokens, samples_per_micro_batch=4).stats(batch)
    grouped = make_batcher("length_grouped", limits, data.tokens, samples_per_micro_batch=4).stats(batch)
    assert grouped.efficiency > plain.efficiency


def test_micro_batch_tensors_match_samples(batch_and_limits):
    data, batch, limits = batch_and_limits
    for mb in make_batcher("packing", limits, data.tokens, rows_per_micro_batch=3)(batch):
        for r, row in enumerate(mb.sample_ids):
            for seg, i in enumerate(row, start=1):
                s = batch.samples[i]
                if isinstance(mb, Seq2SeqMicroBatch):
                    enc = mb.encoder_segment_ids[r] == seg
                    dec = mb.decoder_segment_ids[r] == seg
                    assert torch.equal(mb.input_ids[r][enc], torch.tensor(s.input_ids.tolist()))
                    assert torch.equal(mb.labels[r][dec], torch.tensor(s.target_ids.tolist()))
                    assert mb.decoder_input_ids[r][dec][0] == data.tokens.decoder_start_id
                    assert torch.equal(mb.decoder_input_ids[r][dec][1:], mb.labels[r][dec][:-1])
                    assert torch.equal(mb.encoder_position_ids[r][enc], torch.arange(s.input_len))
                else:
                    assert isinstance(mb, CausalMicroBatch)
                    m = mb.segment_ids[r] == seg
                    seq = torch.as_tensor(list(s.input_ids) + list(s.target_ids), dtype=torch.long)
                    assert torch.equal(mb.input_ids[r][m], seq)
                    assert torch.equal(mb.position_ids[r][m], torch.arange(len(seq)))
                    targets = mb.target_ids[r][m]
                    # Loss on target tokens only, shifted by one, never across the sample end.
                    assert torch.equal(targets[s.input_len - 1 : -1], seq[s.input_len :])
                    assert (targets[: s.input_len - 1] == IGNORE_INDEX).all() and targets[-1] == IGNORE_INDEX


def test_unknown_batcher_lists_options(batch_and_limits):
    data, _, limits = batch_and_limits
    with pytest.raises(ValueError, match="valid: padding, length_grouped, token_budget, packing"):
        make_batcher("pack", limits, data.tokens)
    with pytest.raises(ValueError, match="cannot hold one maximal sample"):
        make_batcher("token_budget", limits, data.tokens, max_tokens=10)


class _Lengths:
    """A lengths-only batch (``input_lens``, ``target_lens``), with the candidates' ``memo`` when given."""

    def __init__(self, e, d, memo=None):
        self.input_lens, self.target_lens = e, d
        if memo is not None:
            self.memo = memo

    def __len__(self):
        return len(self.input_lens)


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_vectorised_grouping_helpers_match_the_one_group_rules(family):
    """longest_first is the order of Batcher._sort_key, group_shapes is group_shape of each group (rows alone and
    packed, fixed row lengths), and a batch carrying a memo (the candidates' lengths view) is grouped by every
    batcher as a plain batch is, its derived order and rows computed once."""
    import numpy as np

    from dynabatch.data.baselines import RowGroup, group_shape, group_shapes, longest_first
    from dynabatch.data.tokenize import TokenizerInfo

    rng = np.random.default_rng(5)
    e, d = rng.integers(1, 400, 80), rng.integers(1, 60, 80)
    e[:20], d[:10] = 200, 30  # ties, broken by index
    limits = LengthLimits(family, max_input_len=400 if family == "t5" else 460, max_target_len=60)
    plain, memo = _Lengths(e, d), {}
    kept = _Lengths(e, d, memo)
    batcher = make_batcher("token_budget", limits, TokenizerInfo(0, 0, 1, 8), max_tokens=4096)
    assert longest_first(plain, family) == sorted(range(80), key=batcher._sort_key(plain))
    for name, extra in (("length_grouped", {}), ("token_budget", {"max_tokens": 4096}),
                        ("packing_free", {"rows_per_micro_batch": 3}), ("packing", {"rows_per_micro_batch": 2})):
        b = make_batcher(name, limits, TokenizerInfo(0, 0, 1, 8), **extra)
        groups = b.group(plain)
        assert b.group(kept) == groups
        assert group_shapes(plain, groups, family) == [group_shape(plain, g, family) for g in groups]
    assert set(k[0] for k in memo) == {"longest_first", "packed_rows"}
    fixed = [RowGroup(((0, 1), (2,)), 400, 60 if family == "t5" else None)]
    assert group_shapes(plain, fixed, family) == [group_shape(plain, fixed[0], family)]


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_rows_kernel_matches_twin(seed):
    """``_kernels._best_fit_rows`` (the packing batchers' and the planner's row packing) puts every sample where its
    pure-Python twin does."""
    import numpy as np
    from reference import batching_reference as ref  # tests/ is on sys.path via its conftest.py

    from dynabatch.data import _kernels as K

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    e = rng.integers(1, 300, n).astype(np.int64)
    two_d = seed % 2 == 0
    d = rng.integers(1, 80, n).astype(np.int64) if two_d else np.zeros(n, np.int64)
    cap_e, cap_d = int(rng.integers(100, 400)), (int(rng.integers(20, 100)) if two_d else 0)
    order = rng.permutation(n).astype(np.int64)
    assert K._best_fit_rows(e, d, order, cap_e, cap_d).tolist() == ref.best_fit_rows(e, d, order, cap_e, cap_d)


def test_token_budget_kernel_matches_its_python_twin():
    """``_kernels._budget_groups`` cuts where the pure-Python rule does: a new micro-batch when one more sample would
    pad past the budget."""
    import numpy as np
    from reference.batching_reference import budget_groups

    from dynabatch.data._kernels import _budget_groups

    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 150))
        e, d = rng.integers(1, 300, n), rng.integers(0, 60, n)
        order, budget = rng.permutation(n), int(rng.integers(360, 4000))
        assert _budget_groups(e, d, order, budget).tolist() == budget_groups(e.tolist(), d.tolist(), order.tolist(), budget)


def test_longest_rows_kernel_matches_its_python_twin():
    """``_kernels._longest_rows`` (FlatGroups.shapes' pass) finds each micro-batch's longest row sums as the
    pure-Python twin does, on rows of one to four samples and micro-batches of one to six rows."""
    import numpy as np
    from reference.batching_reference import longest_rows

    from dynabatch.data._kernels import _longest_rows

    def cut(total, most):
        """Bounds from 0 to ``total`` with parts of one to ``most`` each."""
        out = [0]
        while out[-1] < total:
            out.append(min(total, out[-1] + int(rng.integers(1, most + 1))))
        return np.array(out)

    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 120))
        e, d = rng.integers(0, 500, n), rng.integers(0, 90, n)
        ids = rng.permutation(n)
        row_bounds = cut(n, 4)
        group_bounds = cut(len(row_bounds) - 1, 6)
        got = _longest_rows(e, d, ids, row_bounds, group_bounds).tolist()
        assert got == longest_rows(e, d, ids, row_bounds, group_bounds)


def test_joined_bounds_kernel_matches_its_python_twin():
    """``_kernels._joined_bounds`` (FlatGroups.concatenated's bounds) joins parts' bounds as the pure-Python twin
    does, parts without entries (bounds ``[0]``) among them."""
    import numpy as np
    from reference.batching_reference import joined_bounds

    from dynabatch.data.groups import bounds, data_kernels

    rng = np.random.default_rng(8)
    for _ in range(50):
        parts = [bounds(rng.integers(0, 5, int(rng.integers(0, 7)))) for _ in range(int(rng.integers(1, 9)))]
        sizes = np.array([len(p) for p in parts])
        assert data_kernels()._joined_bounds(np.concatenate(parts), sizes).tolist() == joined_bounds(parts)


def test_concatenated_groups_are_the_parts_one_after_another():
    """FlatGroups.concatenated (the parts' bounds joined in a few numpy passes) holds the micro-batches of its parts in
    order, rows as they were, whatever the parts: packed rows, single rows, a part without micro-batches."""
    from dynabatch.data.baselines import FlatGroups

    parts = [FlatGroups.of([[(3, 1), (0,)], [(2,)]]), FlatGroups.of([]), FlatGroups.of([[(4,)], [(0, 1, 2), (3,)]]),
             FlatGroups.single_rows([2, 0, 1], [0, 2, 3])]
    joined = FlatGroups.concatenated(parts)
    assert [g.rows for g in joined.row_groups()] == [g.rows for p in parts for g in p.row_groups()]
    assert joined.rows_key() == FlatGroups.of(g.rows for p in parts for g in p.row_groups()).rows_key()
    assert len(FlatGroups.concatenated([FlatGroups.of([])])) == 0


def _length_cases(family):
    """(name, input lengths, target lengths, limits): random and heavy-tailed batches and the edge cases (one sample,
    all lengths equal, samples at the length limit)."""
    import numpy as np

    rng = np.random.default_rng(17)
    t5 = family == "t5"
    cap_e, cap_d = 512, 96
    limits = LengthLimits(family, max_input_len=cap_e, max_target_len=cap_d, max_seq_len=cap_e + cap_d)
    heavy_e = np.minimum(rng.lognormal(3.5, 1.1, 240).astype(np.int64) + 1, cap_e)
    heavy_d = np.minimum(rng.lognormal(2.0, 0.9, 240).astype(np.int64) + 1, cap_d)
    at_limit_e, at_limit_d = rng.integers(1, cap_e, 40), rng.integers(1, cap_d, 40)
    at_limit_e[[0, 7, 8]], at_limit_d[[0, 7, 9]] = cap_e, cap_d
    cases = [
        ("random", rng.integers(1, cap_e, 150), rng.integers(1, cap_d, 150)),
        ("heavy_tail", heavy_e, heavy_d),
        ("one_sample", np.array([37]), np.array([5])),
        ("all_equal", np.full(33, 64), np.full(33, 16)),
        ("at_the_limit", at_limit_e, at_limit_d),
        ("all_at_the_limit", np.full(9, cap_e), np.full(9, cap_d)),
    ]
    # GPT: inputs and targets are one sequence of at most max_seq_len tokens (cap_e + cap_d: the limit still reached)
    return [(name, e, d if t5 else np.minimum(d, cap_e + cap_d - e), limits) for name, e, d in cases]


@pytest.mark.parametrize("family", ["t5", "gpt2"])
def test_flat_grouping_is_the_reference_grouping(family):
    """Every candidate baseline's flat grouping (Batcher.flat_group, arrays without a Python object per row) gives,
    at every knob value of its grid, the micro-batches of the pure-Python reference built from the documented rules
    (tests/reference/batching_reference.py), on random and heavy-tailed lengths, one sample, equal lengths and
    samples at the length limit, with a lengths-only batch that carries the candidates' memo and one that does not;
    its shapes are group_shape's and equal rows_key means equal rows."""
    import numpy as np
    from reference.batching_reference import baseline_groups

    from dynabatch.data.baselines import (BASELINES, GROUPING_TOKENS, BaselineOptions, FlatGroups, group_shape,
                                          group_shapes)

    t5 = family == "t5"
    options = BaselineOptions()
    for case, e, d, limits in _length_cases(family):
        cap_e, cap_d = (limits.max_input_len, limits.max_target_len) if t5 else (limits.max_seq_len, 0)
        memo: dict = {}
        keys: dict[tuple, tuple] = {}
        for method in ("length_grouped", "token_budget", "packing_free"):
            for value in BASELINES[method].grid:
                fields = options.with_value(method, value).batcher_options(method, limits)
                batcher = make_batcher(method, limits, GROUPING_TOKENS, **fields)
                knob = next(iter(fields.values()))
                want = baseline_groups(method, e, d, t5, knob, cap_e, cap_d)
                for batch in (_Lengths(e, d, memo), _Lengths(e, d)):
                    flat = batcher.flat_group(batch)
                    groups = flat.row_groups()
                    assert [g.rows for g in groups] == want, (case, method, value)
                    assert batcher.group(batch) == groups
                    assert flat.shapes(e, d, family).tolist() == [list(group_shape(batch, g, family)) for g in groups]
                    assert group_shapes(batch, groups, family) == [group_shape(batch, g, family) for g in groups]
                    assert FlatGroups.of(want).rows_key() == flat.rows_key()
                keys.setdefault(flat.rows_key(), tuple(want))
                assert keys[flat.rows_key()] == tuple(want)  # equal keys: equal micro-batches
        assert len(set(keys.values())) == len(keys)  # distinct keys: distinct micro-batches
