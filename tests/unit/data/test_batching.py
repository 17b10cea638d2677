"""Global batches by token budget: determinism, resume, over-long policies."""

from __future__ import annotations

import numpy as np
import pytest

from dynabatch.data.batching import GlobalBatcher, LengthLimits, OverlongSampleError


def _limits(family, n=64):
    return LengthLimits(family, max_input_len=n, max_target_len=n // 2, max_seq_len=n)


def _ids(batch):
    return [(s.source_index, s.row_index) for s in batch.samples]


def test_batches_respect_budget_and_limits(toy_data):
    limits = _limits(toy_data.family)
    batcher = GlobalBatcher(toy_data, limits, token_budget=2000)
    for _ in range(5):
        b = batcher.next_batch()
        assert 0 < b.num_tokens <= 2000
        assert not any(limits.is_overlong(s.input_len, s.target_len) for s in b.samples)
        # The batch is full: the held-over sample would not have fitted.
        assert b.num_tokens > 2000 - limits.max_tokens
    assert batcher.num_truncated > 0  # toy data has samples over 64 tokens


def test_deterministic_and_resumable(toy_data):
    limits = _limits(toy_data.family)
    a = GlobalBatcher(toy_data, limits, token_budget=1500)
    for _ in range(3):
        a.next_batch()
    state = a.state_dict()
    expected = [_ids(a.next_batch()) for _ in range(4)]
    b = GlobalBatcher(toy_data, limits, token_budget=1500)
    b.load_state_dict(state)
    assert [_ids(b.next_batch()) for _ in range(4)] == expected
    fresh = GlobalBatcher(toy_data, limits, token_budget=1500)
    assert [_ids(fresh.next_batch()) for _ in range(7)][3:] == expected


def test_a_position_saved_over_other_data_is_refused(toy_data):
    """A state names rows of the data it was saved over: the same rows with one row fewer in a source (a data file
    edited between runs) are refused, naming the source (both, when another source took its place), before any row is
    read."""
    import json

    limits = _limits(toy_data.family)
    a = GlobalBatcher(toy_data, limits, token_budget=1500)
    a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # as a checkpoint manifest keeps it
    GlobalBatcher(toy_data, limits, token_budget=1500).load_state_dict(state)  # the same data: accepted
    shrunk = state["data"][0][:1] + [state["data"][0][1] - 1] + state["data"][0][2:]
    with pytest.raises(ValueError, match=r"the data changed since this position was saved \(source "
                                         + repr(state["data"][0][0]) + r" had \d+ rows"):
        GlobalBatcher(toy_data, limits, token_budget=1500).load_state_dict(
            state | {"data": [shrunk, *state["data"][1:]]})
    renamed = ["other_task", *state["data"][0][1:]]  # another source in its place: each named with its own name
    name = state["data"][0][0]
    with pytest.raises(ValueError, match=r"\(source 'other_task' \(\d+ rows of \d+ tokens\) then, "
                                         + repr(name) + r" \(\d+ rows of \d+ tokens\) now\); resume on the same data "
                                         r"files, or start a new run in another output folder$"):
        GlobalBatcher(toy_data, limits, token_budget=1500).load_state_dict(
            state | {"data": [renamed, *state["data"][1:]]})
    old = {k: v for k, v in state.items() if k != "data"}  # saved before the count was recorded: not checked
    GlobalBatcher(toy_data, limits, token_budget=1500).load_state_dict(old)


def test_truncation_keeps_eos_and_start(toy_data):
    limits = _limits(toy_data.family, 32)
    batch = GlobalBatcher(toy_data, limits, token_budget=4000).next_batch()
    eos = toy_data.tokens.eos_id
    for s in batch.samples:
        raw = toy_data.sample(s.source_index, s.row_index)
        assert s.target_ids[-1] == eos
        assert np.array_equal(s.input_ids[: max(0, s.input_len - 1)], raw.input_ids[: max(0, s.input_len - 1)])
        assert not limits.is_overlong(s.input_len, s.target_len)


def test_drop_policy_counts(toy_data):
    limits = _limits(toy_data.family, 32)
    batcher = GlobalBatcher(toy_data, limits, token_budget=4000, overlong="drop")
    b = batcher.next_batch()
    assert b.num_dropped > 0 and batcher.num_dropped == b.num_dropped
    assert all(not limits.is_overlong(s.input_len, s.target_len) for s in b.samples)


def test_error_policy_names_the_sample(toy_data):
    batcher = GlobalBatcher(toy_data, _limits(toy_data.family, 32), token_budget=4000, overlong="error")
    with pytest.raises(OverlongSampleError, match=r"row \d+ of source '\w+' has \d+ input and \d+ target tokens"):
        for _ in range(10):
            batcher.next_batch()


def test_gpt_truncation_rule():
    limits = LengthLimits("gpt2", max_seq_len=100)
    assert limits.truncated_lengths(30, 20) == (30, 20)
    assert limits.truncated_lengths(300, 20) == (80, 20)
    assert limits.truncated_lengths(10, 300) == (10, 90)
    assert limits.truncated_lengths(300, 300) == (50, 50)


def test_budget_smaller_than_a_sample_is_an_error(toy_data):
    with pytest.raises(ValueError, match=r"^token_budget 100 cannot hold one maximal sample \(.*; raise it to at least"):
        GlobalBatcher(toy_data, _limits(toy_data.family, 512), token_budget=100)
