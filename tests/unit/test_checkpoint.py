"""Atomic, verified checkpoints: crash during save, corruption, fallback, weights-only loading."""

from __future__ import annotations

import os

import pytest
import torch

from dynabatch.runtime.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_shard,
    prune,
    save_shard,
    step_dir,
    verify,
    write_manifest,
)


def _save(root, step, ranks=2, value=0.0):
    shards = [save_shard(root, step, r, {"w": torch.full((3,), value + r), "step": step}) for r in range(ranks)]
    write_manifest(str(root), step, shards, {"data": {"pending": None}})


def test_round_trip_and_latest(tmp_path):
    _save(tmp_path, 10, value=1.0)
    _save(tmp_path, 20, value=2.0)
    info = latest_checkpoint(str(tmp_path))
    assert info.step == 20 and info.manifest["data"] == {"pending": None}
    assert torch.equal(load_shard(info, 1)["w"], torch.full((3,), 3.0))


def test_crash_before_manifest_falls_back(tmp_path):
    _save(tmp_path, 10)
    save_shard(tmp_path, 20, 0, {"w": torch.zeros(2)})  # rank 1 never wrote, no manifest
    with pytest.warns(UserWarning, match="incomplete"):
        info = latest_checkpoint(str(tmp_path))
    assert info.step == 10
    with pytest.raises(CheckpointError, match="incomplete"):
        latest_checkpoint(str(tmp_path), fallback=False)


def test_crash_while_writing_leaves_previous_file(tmp_path):
    _save(tmp_path, 10, value=5.0)

    class Boom(Exception):
        pass

    def exploding_save(obj, f):
        f.write(b"partial bytes")
        raise Boom

    real = torch.save
    torch.save = exploding_save
    try:
        with pytest.raises(Boom):
            save_shard(tmp_path, 10, 0, {"w": torch.zeros(3)})
    finally:
        torch.save = real
    assert not [n for n in os.listdir(step_dir(tmp_path, 10)) if n.startswith(".tmp-")]
    info = verify(step_dir(tmp_path, 10))  # the old shard is intact
    assert torch.equal(load_shard(info, 0)["w"], torch.full((3,), 5.0))


def test_truncated_shard_detected(tmp_path):
    _save(tmp_path, 10)
    _save(tmp_path, 20)
    shard = os.path.join(step_dir(tmp_path, 20), "rank-00001.pt")
    with open(shard, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        verify(step_dir(tmp_path, 20))
    with pytest.warns(UserWarning):
        assert latest_checkpoint(str(tmp_path)).step == 10


class NotATensor:
    """A pickled class instance: weights-only loading must refuse it."""


def test_weights_only_refuses_code(tmp_path):
    shards = [save_shard(tmp_path, 1, 0, {"obj": NotATensor()})]
    write_manifest(str(tmp_path), 1, shards, {})
    with pytest.raises(Exception, match="[Ww]eights only"):
        load_shard(verify(step_dir(tmp_path, 1)), 0)


def test_missing_rank_and_prune(tmp_path):
    for s in (1, 2, 3):
        _save(tmp_path, s)
    with pytest.raises(CheckpointError, match="no shard for rank 5"):
        load_shard(latest_checkpoint(str(tmp_path)), 5)
    prune(str(tmp_path), keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step-000003"]
