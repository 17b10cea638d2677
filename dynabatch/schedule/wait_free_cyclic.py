"""DynaPipe's own schedule on virtual stages: cyclic order, wait-free execution (Jiang et al. 2023, arXiv 2311.10418).

DynaPipe orders a step's ops on a cyclic placement (each device holds an encoder and a decoder chunk) in two
passes, and :func:`wait_free_cyclic_orders` is the first:

1. **Cycles.** Every op is a *flattened stage* ``f`` of ``2 V``: the forwards of chunks ``0 .. V - 1``, then the
   backwards of chunks ``V - 1 .. 0``; device ``d`` owns the flattened stages of its chunks, each with a queue of
   the micro-batches waiting there. All micro-batches start in the queue of flattened stage 0, in plan order.
   Time advances in lock-step cycles. In a cycle every device looks at the head of each of its queues, sorts the
   backwards and the forwards each by ``(micro-batch, flattened stage)``, and runs them alternately, a backward
   first (it frees memory): at most one op per flattened stage per cycle. An op run in cycle ``k`` puts the
   micro-batch in the next flattened stage's queue for cycle ``k + 1``. So a micro-batch advances one flattened
   stage per cycle, a new one enters every cycle, and in the steady state every device runs all of its chunks'
   forwards and backwards each cycle on ``4 S`` different micro-batches (``v = 2``): a systolic pipeline in which
   the encoder-heavy and decoder-heavy micro-batches in flight average out on every device.
2. **Wait-free.** The per-device orders the cycles produced are then run without the cycle barrier: each device
   runs its order, every op as soon as its input has arrived (:func:`~dynabatch.schedule.interleaved.replay`,
   which is also how the runtime runs any order).

Memory admission (a change from DynaPipe, which checks a device's current memory when a new micro-batch's forward
reaches it): a micro-batch enters flattened stage 0 only while every device keeps its reserved footprint (model
states plus the stored activations of every admitted, unfinished micro-batch on all its chunks) and the op's peak
within its limit, the list scheduler's :class:`~dynabatch.schedule.placement.Admission`; with nothing in flight a
micro-batch always enters, and so does a token slice whose chain has begun, so the cycles always finish.

Token-slice chains (``links``): a slice's forward waits in its queue until its previous slice's forward on that
chunk has run, and a slice's backward until its next slice's backward has (:func:`~dynabatch.schedule.placement.
chain_ready`). A queue offers its first micro-batch whose chain allows it, not only its head: a chain's slices reach
the backward queues first-slice first but must run there last-slice first.

The orders depend on the costs only through the admission (without a memory limit they are the costs-free cycle
pattern); the replay prices them. :func:`~dynabatch.schedule.virtual.placed_step` keeps them when their replay is
the shortest that fits memory. The orders serve any placement with several chunks per device (interleaved too).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from dynabatch.cost.stages import StageCosts
from dynabatch.schedule.chains import successors
from dynabatch.schedule.placement import Admission, Placement, chain_ready


def flattened_op(f: int, num_stages: int) -> tuple[str, int]:
    """``(phase, chunk)`` of flattened stage ``f`` of ``2 num_stages``: forwards up the chunks, backwards down."""
    return ("F", f) if f < num_stages else ("B", 2 * num_stages - 1 - f)


def wait_free_cyclic_orders(costs: StageCosts, placement: Placement, model_state_bytes=0.0,
                            memory_limit_bytes: float | None = None, links=()) -> list[list[tuple[str, int, int]]]:
    """Per device, ``(phase, chunk, micro-batch)`` in DynaPipe's cyclic order (module docstring). ``costs``:
    ``(V, M)`` per chunk with their message buffers; ``model_state_bytes``: ``(V,)`` or one value per chunk;
    ``links``: token-slice chains."""
    stored = np.asarray(costs.stored_bytes, dtype=np.float64)
    peak = np.asarray(costs.peak_bytes, dtype=np.float64)
    V, M = stored.shape
    if V != placement.num_stages:
        raise ValueError(f"costs have {V} stages but placement {placement.describe()} has {placement.num_stages} chunks")
    S = placement.num_devices
    dev = [placement.device(c) for c in range(V)]
    owned = [[f for f in range(2 * V) if dev[flattened_op(f, V)[1]] == d] for d in range(S)]
    device_states = np.zeros(S)
    np.add.at(device_states, dev, np.broadcast_to(np.asarray(model_state_bytes, dtype=np.float64), (V,)))
    limit = np.inf if memory_limit_bytes is None else float(memory_limit_bytes)
    queues = [deque() for _ in range(2 * V)]
    queues[0].extend(range(M))
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(S)]
    links, successor, done = tuple(links), successors(links), set()
    admission = Admission(stored, peak, dev, device_states, limit, links)

    def first_allowed(f: int):
        """The first micro-batch of flattened stage ``f``'s queue whose slice chain lets it run, or ``None``."""
        phase, chunk = flattened_op(f, V)
        return next((m for m in queues[f] if chain_ready(phase, chunk, m, links, successor, done)), None)

    finished = 0
    while finished < M:
        arrivals = []
        for d in range(S):
            heads = [(m, f) for f in owned[d] if (m := first_allowed(f)) is not None]
            backward = sorted(h for h in heads if h[1] >= V)
            forward = sorted(h for h in heads if h[1] < V)
            merged = [h for pair in zip(backward, forward) for h in pair]
            merged += backward[len(forward):] + forward[len(backward):]
            for m, f in merged:
                if f == 0:
                    if not admission.admits(m):
                        continue  # wait until the micro-batches in flight free their memory
                    admission.enter(m)
                queues[f].remove(m)
                phase, chunk = flattened_op(f, V)
                orders[d].append((phase, chunk, int(m)))
                done.add((phase, chunk, int(m)))
                if f + 1 < 2 * V:
                    arrivals.append((f + 1, m))
                else:
                    admission.leave(m)
                    finished += 1
        for f, m in arrivals:  # what ran in this cycle reaches its next flattened stage in the next one
            queues[f].append(m)
    return orders
