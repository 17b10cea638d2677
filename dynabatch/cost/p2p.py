"""Point-to-point send time versus message size for the torch.distributed backend in use.

Two processes (``torch.multiprocessing`` spawn, a rendezvous store that listens on 127.0.0.1 only,
:func:`loopback_store`) ping-pong a float32 tensor of
each size: rank 0 sends and waits for the echo, rank 1 receives and sends back. One-way time is half
the round trip; the median over ``repeats`` (after ``warmup`` untimed round trips) is reported.
gloo on CPU tensors; nccl needs two CUDA devices and is skipped otherwise. On a 2-core machine the two
processes share the cores with whatever else runs there; measured on a shared 2-core VM the median
one-way latency was 0.17-2 ms depending on load (the minimum ~0.1 ms) and ~1.7 GB/s at 16 MiB, so
the minimum is recorded too.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

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


def loopback_store(world_size: int, timeout_s: float):
    """A ``TCPStore`` server for a rendezvous of processes on this machine that accepts connections on
    127.0.0.1 only (its port: ``store.port``). A plain ``TCPStore(is_master=True)`` listens on every
    interface (``::``), unauthenticated, whatever host name it is given; here the listening socket is
    bound to loopback first and handed to the store (``master_listen_fd``), which then owns it."""
    import torch.distributed as dist

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], world_size, True, timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
        sock.detach()  # the store closes the socket
    return store


def _worker(rank: int, ports, backend: str, sizes, warmup: int, repeats: int, timeout_s: float, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if rank == 0:  # serves the rendezvous on loopback and tells rank 1 its port
        store = loopback_store(2, timeout_s)
        ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(), 2, False, timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s))
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


def check_backend(backend: str) -> None:
    """``ValueError`` unless this machine can measure p2p over ``backend``: gloo, or nccl with two CUDA devices."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown p2p backend {backend!r}; valid: auto, gloo, nccl, none")
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise ValueError(f"p2p backend nccl needs two CUDA devices, found {torch.cuda.device_count()}; "
                         "use --p2p gloo or --p2p none")


def measure_p2p(backend: str = "gloo", sizes: tuple[int, ...] = DEFAULT_SIZES, warmup: int = 3,
                repeats: int = 20, timeout_s: float = 120.0) -> P2PResult:
    """Spawn two local processes and measure one-way send time per message size."""
    check_backend(backend)
    if not sizes or any(s <= 0 for s in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"sizes must be positive and strictly increasing, got {sizes}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, ports = ctx.SimpleQueue(), ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, ports, backend, sizes, warmup, repeats, timeout_s, queue))
             for r in range(2)]
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
