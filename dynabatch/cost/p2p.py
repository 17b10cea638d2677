"""Point-to-point send time versus message size for the torch.distributed backend in use.

Two processes (``torch.multiprocessing`` spawn, localhost TCP rendezvous) ping-pong a float32 tensor of
each size: rank 0 sends and waits for the echo, rank 1 receives and sends back. One-way time is half
the round trip; the median over ``repeats`` (after ``warmup`` untimed round trips) is reported.
gloo on CPU tensors; nccl needs two CUDA devices and is skipped otherwise. On a 2-core machine the two
processes share the cores with whatever else runs there; measured on a shared 2-core VM the median
one-way latency was 0.17-2 ms depending on load (the minimum ~0.1 ms) and ~1.7 GB/s at 16 MiB, so
the minimum is recorded too.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch

DEFAULT_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
"""Message sizes in bytes (1 KiB .. 16 MiB)."""


@dataclass(frozen=True)
class P2PResult:
    """Measured one-way send times."""

    backend: str
    sizes_bytes: tuple[int, ...]
    send_s: tuple[float, ...]
    """Median one-way time per size (what the cost tables use)."""
    send_min_s: tuple[float, ...]
    """Fastest one-way time per size: the loopback cost when neither process was descheduled."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, backend: str, sizes, warmup: int, repeats: int, queue) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=2)
    try:
        medians, minima = [], []
        for nbytes in sizes:
            buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
            times = []
            for i in range(warmup + repeats):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) / 2)
            medians.append(statistics.median(times))
            minima.append(min(times))
        if rank == 0:
            queue.put((medians, minima))
    finally:
        dist.destroy_process_group()


def default_backend(device: torch.device) -> str | None:
    """gloo for CPU, nccl when two CUDA devices exist, else ``None`` (not measurable here)."""
    if device.type == "cpu":
        return "gloo"
    return "nccl" if torch.cuda.device_count() >= 2 else None


def measure_p2p(backend: str = "gloo", sizes: tuple[int, ...] = DEFAULT_SIZES, warmup: int = 3,
                repeats: int = 20, timeout_s: float = 120.0) -> P2PResult:
    """Spawn two local processes and measure one-way send time per message size."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown p2p backend {backend!r}; valid: gloo, nccl")
    if not sizes or any(s <= 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"sizes must be positive and strictly increasing, got {sizes}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, backend, sizes, warmup, repeats, queue)) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    if alive or any(p.exitcode != 0 for p in procs) or queue.empty():
        raise RuntimeError(f"p2p measurement failed (exit codes {[p.exitcode for p in procs]})")
    medians, minima = queue.get()
    return P2PResult(backend, tuple(sizes), tuple(medians), tuple(minima))
