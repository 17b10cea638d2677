"""Shared fixtures. Everything is offline: datasets cache in a temp dir, hub access disabled."""

from __future__ import annotations

import json
import os
import socket
import tempfile

os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="dynabatch-hf-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread in the test process and every process it launches (torchrun sets the same): the
# models are tiny and dispatch-bound, and two OpenMP threads on a busy 2-core machine spin in barriers
# (an unsplit T5 reference run measured 1 s with one thread, 32 s with two while other jobs ran).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def child_pids(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (read from /proc)."""
    kids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(name))
    return kids


LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1", "::1")
"""Loopback addresses as :func:`listening_sockets` writes them."""


def _proc_ip(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} (little-endian 32-bit words) as text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(words) == 4 else socket.AF_INET6, words)


def listening_sockets(pids=None) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets in LISTEN state, owned by ``pids`` (default: every process)."""
    inodes = None
    if pids is not None:
        inodes = set()
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and (inodes is None or fields[9] in inodes):  # 0A: LISTEN
                    addr, port = fields[1].split(":")
                    out.append((_proc_ip(addr), int(port, 16)))
    return out


def spy_freed_tensors_kept(monkeypatch, module) -> list[tuple[bool, bool]]:
    """Replace ``module.freed_tensors_kept`` by the real one that also records ``(enabled, applied)`` of every use,
    in the list returned."""
    import contextlib

    from dynabatch.core import allocator

    seen: list[tuple[bool, bool]] = []

    @contextlib.contextmanager
    def spy(enabled=True):
        with allocator.freed_tensors_kept(enabled) as applied:
            seen.append((enabled, applied))
            yield applied

    monkeypatch.setattr(module, "freed_tensors_kept", spy)
    return seen


def random_rows(task: str, n: int, seed: int, mean_in: int, mean_tg: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        k_in = max(1, int(rng.lognormal(np.log(mean_in), 0.6)))
        k_tg = max(1, int(rng.lognormal(np.log(mean_tg), 0.4)))
        rows.append(
            {
                "task": task,
                "inputs": " ".join(rng.choice(WORDS, k_in)),
                "targets": " ".join(rng.choice(WORDS, k_tg)),
            }
        )
    return rows


def write_mixture(folder, name: str, sources: dict[str, tuple[int, int, int, int]]) -> str:
    """A mixture spec ``folder/mix.json`` over one JSONL file per task, each of :func:`random_rows` ``(n, seed,
    mean input words, mean target words)``; returns the spec's path."""
    for task, (n, seed, mean_in, mean_tg) in sources.items():
        write_jsonl(os.path.join(folder, f"{task}.jsonl"), random_rows(task, n, seed, mean_in, mean_tg))
    spec = {"name": name, "sources": [{"task": t, "data_files": f"{t}.jsonl"} for t in sources]}
    path = os.path.join(folder, "mix.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


@pytest.fixture(scope="session")
def toy_mixture_dir(tmp_path_factory) -> str:
    """Three local jsonl tasks of 40, 150 and 600 rows with different length profiles, plus a spec."""
    d = tmp_path_factory.mktemp("mixture")
    write_jsonl(d / "short.jsonl", random_rows("short", 40, 1, 4, 2))
    write_jsonl(d / "classify.jsonl", random_rows("classify", 150, 2, 30, 1))
    write_jsonl(d / "summarize.jsonl", random_rows("summarize", 600, 3, 60, 12))
    spec = {
        "name": "toy",
        "rule": "examples_proportional",
        "cap": 300,
        "seed": 7,
        "sources": [
            {"task": "short", "data_files": "short.jsonl"},
            {"task": "classify", "data_files": "classify.jsonl"},
            {"task": "summarize", "data_files": "summarize.jsonl"},
        ],
    }
    with open(d / "toy.json", "w") as f:
        json.dump(spec, f)
    return str(d)


@pytest.fixture(scope="session")
def byt5():
    from dynabatch.data.tokenize import load_tokenizer

    return load_tokenizer("byt5")


@pytest.fixture(scope="session", params=["t5", "gpt2"])
def toy_data(request, toy_mixture_dir, byt5):
    from dynabatch.data.mixture import MixtureSpec
    from dynabatch.data.pipeline import MixtureData

    spec = MixtureSpec.from_file(os.path.join(toy_mixture_dir, "toy.json"))
    return MixtureData.load(spec, byt5, request.param)


@pytest.fixture
def one_torch_thread():
    """Tiny models are dispatch-bound: one thread is several times faster than two on a busy machine (a module takes
    it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
