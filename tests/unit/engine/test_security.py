"""Security: rendezvous stores accept connections on 127.0.0.1 only; a checkpoint manifest cannot make
``verify`` read a file outside its folder."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time

import pytest
import torch

from conftest import LOOPBACK, child_pids, listening_sockets as _listening

from dynabatch.engine.checkpoint import MANIFEST, CheckpointError, file_entry, step_dir, verify, write_manifest

SHARD = "shard-00001-model-00001-of-00001.safetensors"

needs_proc = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux /proc/net/tcp")


@needs_proc
def test_loopback_store_listens_on_127_0_0_1_only():
    import torch.distributed as dist

    from dynabatch.cost.p2p import loopback_store

    store = loopback_store(2, timeout_s=10)
    assert [addr for addr, port in _listening() if port == store.port] == ["127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", store.port, 2, False)
    client.set("k", "v")
    assert store.get("k") == b"v"


@needs_proc
def test_single_process_train_world_listens_on_loopback_only(monkeypatch):
    from dynabatch.training.config import TrainConfig
    from dynabatch.engine.dist import shutdown
    from dynabatch.training.trainer import connect

    monkeypatch.delenv("RANK", raising=False)
    before = set(_listening([os.getpid()]))
    ctx = connect(TrainConfig(timeout_s=30))
    try:
        opened = set(_listening([os.getpid()])) - before
        assert ctx.world_size == 1 and opened
        # The store (and, where the host name resolves to loopback, gloo's own sockets): never a wildcard address.
        assert not [a for a, _ in opened if a in ("0.0.0.0", "::")], opened
        assert any(a == "127.0.0.1" for a, _ in opened), opened
    finally:
        shutdown()


@pytest.mark.slow  # ~10 s of spawning; test_loopback_store_listens_on_127_0_0_1_only covers the store it uses
@needs_proc
def test_p2p_profiler_rendezvous_listens_on_loopback_only():
    from dynabatch.cost.p2p import measure_p2p

    result, seen = {}, set()
    worker = threading.Thread(target=lambda: result.update(r=measure_p2p(
        "gloo", sizes=(1024, 1 << 20), warmup=1, repeats=30, timeout_s=90)))
    worker.start()
    while worker.is_alive():
        seen.update(_listening(child_pids(os.getpid())))
        time.sleep(0.02)
    worker.join()
    assert result["r"].send_s and seen, seen
    assert all(addr in LOOPBACK for addr, _ in seen), seen


def _checkpoint_with_shard_name(tmp_path, name: str) -> str:
    """A complete one-shard checkpoint whose manifest names ``name``, with the size and checksum of a
    file outside the folder (so only the name check can refuse it)."""
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"secret outside the checkpoint")
    root = tmp_path / "run" / "checkpoints"
    from safetensors.torch import save_file

    os.makedirs(step_dir(str(root), 1))
    save_file({"model/w": torch.zeros(1)}, os.path.join(step_dir(str(root), 1), SHARD))
    entry = file_entry(step_dir(str(root), 1), SHARD)
    entry.update(file=name, bytes=outside.stat().st_size, sha256=hashlib.sha256(outside.read_bytes()).hexdigest())
    write_manifest(str(root), 1, [entry], {})
    return step_dir(str(root), 1)


@pytest.mark.parametrize("name", ["../../../outside.txt", "ABSOLUTE", "./../../../outside.txt", "..", ""])
def test_manifest_shard_names_are_confined_to_the_folder(tmp_path, name):
    if name == "ABSOLUTE":
        name = str(tmp_path / "outside.txt")
    folder = _checkpoint_with_shard_name(tmp_path, name)
    with pytest.raises(CheckpointError, match="which is not a file inside the checkpoint folder"):
        verify(folder)


def test_symlinked_shard_pointing_outside_is_refused(tmp_path):
    folder = _checkpoint_with_shard_name(tmp_path, SHARD)
    os.remove(os.path.join(folder, SHARD))
    os.symlink(tmp_path / "outside.txt", os.path.join(folder, SHARD))
    with pytest.raises(CheckpointError, match="not a file inside the checkpoint folder"):
        verify(folder)


def test_malformed_shard_list_is_a_checkpoint_error(tmp_path):
    folder = _checkpoint_with_shard_name(tmp_path, SHARD)
    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["shards"] = [{"file": SHARD}]
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match="malformed manifest"):
        verify(folder)
