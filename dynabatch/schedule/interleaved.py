"""Fixed per-device orders on virtual stages: interleaved 1F1B, and the replay that times any fixed order.

:func:`interleaved_1f1b_orders` is Megatron-LM's interleaved schedule (Narayanan et al. 2021;
``torch.distributed.pipelining.ScheduleInterleaved1F1B``) over a :class:`~dynabatch.schedule.placement.Placement`
of ``S`` devices with ``v`` chunks each (chunk ``c`` on device ``c mod S``). Device ``d`` runs ``M v``
forwards and as many backwards. Its ``k``-th forward is micro-batch ``(k // (S v)) S + k mod S`` on its local
chunk ``(k mod S v) // S``: micro-batches go through the device's chunks in rounds of ``S``. Its backwards walk
the local chunks in reverse. It first runs ``(S - d - 1) 2 + (v - 1) S`` forwards (warm-up), then alternates
one forward and one backward, then drains the backwards. The same orders serve T5's cyclic placement
(``v = 2``: encoder chunk ``d``, then decoder chunk ``d``). ``M`` must be a multiple of ``S``, as in Megatron-LM.

:func:`replay` times fixed per-device orders: a device runs its ops in order, each starting once the device is
free and its input has arrived (``F(c, m)`` after ``F(c - 1, m)``, ``B(c, m)`` after ``B(c + 1, m)``, the last
chunk's backward after its own forward, plus the send time when the two chunks are on different devices).
Memory is tracked per device as the list scheduler tracks it. Orders that cannot finish return ``None``.
"""

from __future__ import annotations

import numpy as np

from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.chains import successors
from dynabatch.schedule.placement import Placement, PlacedResult, chain_ready


def interleaved_1f1b_orders(placement: Placement, num_micro_batches: int) -> list[list[tuple[str, int, int]]] | None:
    """Per device, ``(phase, chunk, micro-batch)`` in interleaved-1F1B order; ``None`` when ``num_micro_batches``
    is not a multiple of the devices (the schedule's rounds need whole groups of ``S``)."""
    S, v, M = placement.num_devices, placement.chunks_per_device, num_micro_batches
    if M % S:
        return None
    total = M * v

    def op(phase: str, d: int, k: int) -> tuple[str, int, int]:
        g = k % (S * v)
        local = g // S if phase == "F" else v - 1 - g // S
        return phase, local * S + d, (k // (S * v)) * S + g % S

    orders = []
    for d in range(S):
        warmup = min((S - d - 1) * 2 + (v - 1) * S, total)
        ops = [op("F", d, k) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [op("F", d, warmup + i), op("B", d, i)]
        ops += [op("B", d, k) for k in range(total - warmup, total)]
        orders.append(ops)
    return orders


def replay(orders, costs: StageCosts, placement: Placement, send_s: np.ndarray, model_state_bytes,
           memory_limit_bytes: float | None = None, policy: str = "interleaved_1f1b", links=()) -> PlacedResult | None:
    """Time fixed per-device ``orders`` (module docstring); arguments as
    :func:`~dynabatch.schedule.placement.list_schedule`'s. ``None`` when the orders deadlock, token-slice chains
    (``links``) included: an order that runs a slice before the one its chain needs first never finishes."""
    fwd, bwd = np.asarray(costs.fwd_s, dtype=np.float64), np.asarray(costs.bwd_s, dtype=np.float64)
    stored, peak = np.asarray(costs.stored_bytes, dtype=np.float64), np.asarray(costs.peak_bytes, dtype=np.float64)
    num_stages, _ = fwd.shape
    S = placement.num_devices
    dev = [placement.device(c) for c in range(num_stages)]
    send = np.asarray(send_s, dtype=np.float64)
    live = np.zeros(S)
    np.add.at(live, dev, np.asarray(model_state_bytes, dtype=np.float64).reshape(num_stages))
    peak_mem = live.copy()
    done: dict[tuple[str, int, int], float] = {}
    free, busy, nxt = [0.0] * S, np.zeros(S), [0] * S
    timed: list[list] = [[] for _ in range(S)]
    links, successor = tuple(links), successors(links)

    def arrival(phase: str, c: int, m: int) -> float | None:
        """When the op's input is on its device (``None``: its producer has not run yet)."""
        if phase == "F":
            if c == 0:
                return 0.0
            src, link = ("F", c - 1, m), c - 1
        elif c == num_stages - 1:
            src, link = ("F", c, m), None
        else:
            src, link = ("B", c + 1, m), c
        if src not in done or not chain_ready(phase, c, m, links, successor, done):
            return None  # the same-device chain predecessor has run, so it ended before the device is free
        hop = link is not None and dev[src[1]] != dev[c]
        return done[src] + (send[link, m] if hop else 0.0)

    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(S):
            while nxt[d] < len(orders[d]):
                phase, c, m = orders[d][nxt[d]]
                ready = arrival(phase, c, m)
                if ready is None:
                    break
                start = max(free[d], ready)
                end = start + (fwd[c, m] if phase == "F" else bwd[c, m])
                if phase == "F":
                    live[d] += stored[c, m]
                peak_mem[d] = max(peak_mem[d], live[d] + peak[c, m])
                if phase == "B":
                    live[d] -= stored[c, m]
                free[d], busy[d] = end, busy[d] + end - start
                done[(phase, c, m)] = end
                timed[d].append((phase, c, m, start, end))
                nxt[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            return None
    makespan = max(free)
    limit = np.inf if memory_limit_bytes is None else float(memory_limit_bytes)
    bubble = 1.0 - float(busy.sum()) / (S * makespan) if makespan > 0 else 0.0
    return PlacedResult(placement, tuple(tuple(o) for o in timed), makespan, busy, bubble, peak_mem,
                        bool(np.all(peak_mem <= limit)), policy)
