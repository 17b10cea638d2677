"""Token-slice chains: the order constraints that slices of the same samples add to a step.

TeraPipe (arXiv 2102.07988) cuts long decoder-only samples into token slices that enter the pipeline
one after another. Slice ``j`` attends to the keys and values that slices ``< j`` of the same rows
computed on the same stage, so in a step's micro-batch list a slice is an ordinary micro-batch plus
one *link*: ``links[m]`` is the micro-batch whose keys/values ``m`` extends (its previous slice), or
``-1``. Links form disjoint chains ``m_1 <- m_2 <- ... <- m_k``. On every stage:

* ``F(m_j)`` runs after ``F(m_{j-1})`` (it needs that slice's keys and values), and
* ``B(m_{j-1})`` runs after ``B(m_j)`` (the gradient of ``m_{j-1}``'s keys and values is complete only
  once every later slice ran its backward), so a chain's backwards run in reverse slice order.

Both are same-rank constraints, met by the order of each stage's op list; nothing crosses ranks that
ordinary micro-batches do not already send. The policies (:mod:`.policies`) build orders that respect
them, :func:`check_schedule` checks a compute schedule and the plan validator checks the lowered
instructions. ``links = ()`` (or all ``-1``) means no slices: every function here is then a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence

from dynabatch.schedule.compute import ComputeSchedule, Phase


def check_links(links: Sequence[int], num_micro_batches: int) -> tuple[int, ...]:
    """``links`` as a tuple after checking it describes disjoint chains over ``num_micro_batches``.

    Empty means no slices. Raises ``ValueError`` naming the first problem: wrong length, a link out
    of range or to itself, two slices extending the same one, a cycle.
    """
    links = tuple(int(x) for x in links)
    if not links:
        return ()
    if len(links) != num_micro_batches:
        raise ValueError(f"slice links must have one entry per micro-batch ({num_micro_batches}), got {len(links)}")
    successor: dict[int, int] = {}
    for m, p in enumerate(links):
        if p == -1:
            continue
        if not 0 <= p < num_micro_batches or p == m:
            raise ValueError(f"micro-batch {m}: slice link {p} must be -1 or another micro-batch in [0, {num_micro_batches})")
        if p in successor:
            raise ValueError(f"micro-batches {successor[p]} and {m} both extend slice {p}; a slice has one successor")
        successor[p] = m
    for m in range(num_micro_batches):  # every chain must reach a head (link -1) within M hops
        p, hops = m, 0
        while p != -1:
            p, hops = links[p], hops + 1
            if hops > num_micro_batches:
                raise ValueError(f"slice links form a cycle through micro-batch {m}")
    return links


def successors(links: Sequence[int]) -> dict[int, int]:
    """Micro-batch -> the slice that extends it (only slices that have one)."""
    return {p: m for m, p in enumerate(links) if p >= 0}


def chains(links: Sequence[int]) -> list[list[int]]:
    """The chains of two or more slices, each in slice order, ordered by their first slice."""
    nxt = successors(links)
    out = []
    for m, p in enumerate(links):
        if p == -1 and m in nxt:
            chain = [m]
            while chain[-1] in nxt:
                chain.append(nxt[chain[-1]])
            out.append(chain)
    return out


def chain_order(order: Sequence[int], links: Sequence[int]) -> list[int]:
    """``order`` with each chain's slices moved together, in slice order, to where its first-listed
    slice stands (other micro-batches keep their relative order). Policies and order searches permute
    micro-batches freely; this makes any permutation a valid entry order for chains."""
    order = [int(m) for m in order]
    if not links or all(p == -1 for p in links):
        return order
    chain_of = {m: tuple(c) for c in chains(links) for m in c}
    out, placed = [], set()
    for m in order:
        c = chain_of.get(m)
        if c is None:
            out.append(m)
        elif c not in placed:
            placed.add(c)
            out.extend(c)
    return out


def backward_order(order: Sequence[int], links: Sequence[int]) -> list[int]:
    """``order`` (chains consecutive, see :func:`chain_order`) with each chain's slices reversed in place:
    the order in which a stage that ran its forwards in ``order`` may run the backwards."""
    out = list(order)
    for c in chains(links):
        pos = sorted(out.index(m) for m in c)
        for i, m in zip(pos, reversed(c)):
            out[i] = m
    return out


def check_schedule(schedule: ComputeSchedule, links: Sequence[int]) -> None:
    """Raise ``ValueError`` if some stage runs a slice's forward before its previous slice's, or a
    slice's backward before the backward of the slice that extends it."""
    links = check_links(links, schedule.num_micro_batches)
    if not links:
        return
    nxt = successors(links)
    for s, ops in enumerate(schedule.stages):
        done_f, done_b = set(), set()
        for op in ops:
            m = op.micro_batch
            if op.phase is Phase.FORWARD:
                if links[m] >= 0 and links[m] not in done_f:
                    raise ValueError(f"stage {s}: F{m} runs before F{links[m]}, the slice whose keys/values it extends")
                done_f.add(m)
            else:
                if m in nxt and nxt[m] not in done_b:
                    raise ValueError(
                        f"stage {s}: B{m} runs before B{nxt[m]}; a slice's backward needs the key/value gradients "
                        "of every later slice of its rows"
                    )
                done_b.add(m)


def links_for(piece_counts) -> tuple[int, ...]:
    """Links of a micro-batch list built unit by unit: a unit of ``n`` pieces is a chain of ``n``
    consecutive slices (``n = 1``: an ordinary micro-batch). ``links_for([1, 3, 1]) == (-1, -1, 1, 2, -1)``."""
    out: list[int] = []
    for n in piece_counts:
        n = int(n)
        if n < 1:
            raise ValueError(f"a unit needs at least one piece, got {n}")
        start = len(out)
        out += [-1] + [start + i for i in range(n - 1)]
    return tuple(out)
