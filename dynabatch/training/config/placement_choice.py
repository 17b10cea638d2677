"""``--placement auto``: the candidates and the rule that picks one, shared by ``train`` and ``simulate``.

The choice needs predicted step times of the run's own batches (``train`` plans its first global batches at start,
:mod:`dynabatch.training.run_layout`; ``simulate`` simulates its batches on each candidate), so the resolver
(:mod:`dynabatch.training.config.resolve`) leaves it to them, but both take the candidates and the rule from here: linear,
and the model family's virtual stages (``cyclic`` for encoder-decoders, ``interleaved:2`` for decoder-only
models) with at least 2 stages; linear wins unless a virtual placement is predicted more than
:data:`VIRTUAL_MARGIN` shorter, then the shortest wins.
"""

from __future__ import annotations

VIRTUAL_MARGIN = 0.05
"""``--placement auto`` takes virtual stages only when they are predicted more than this fraction faster than
linear: their chunks' fixed costs and extra hand-offs are not in the cost model (docs/configuration.md)."""


def check_placement(placement: str, stages: int) -> None:
    """A one-line ``ValueError`` naming every accepted form (``auto`` too) when ``placement`` is none of them."""
    if placement == "auto":
        return
    from dynabatch.schedule.placement import Placement  # lazy: keeps numba/scipy out of `dynabatch --help`

    try:
        Placement.parse(placement, max(stages, 1))
    except ValueError as e:
        if "unknown placement" not in str(e):
            raise
        raise ValueError(f"{e}, or auto (the placement with the shortest predicted step)") from None


def placement_candidates(placement: str, stages: int, seq2seq: bool) -> list[str]:
    """The placements ``placement`` allows: itself, or for ``auto`` linear and the family's virtual stages."""
    if placement != "auto":
        check_placement(placement, stages)
        return [placement]
    if stages < 2:
        return ["linear"]
    return ["linear", "cyclic" if seq2seq else "interleaved:2"]


def pick_placement(predicted_s: dict[str, float], chunks_per_device: dict[str, int]) -> str:
    """The placement ``auto`` runs: the shortest predicted step (seconds per candidate), a virtual placement
    (more than one chunk per device) handicapped by :data:`VIRTUAL_MARGIN`; a tie keeps fewer chunks."""
    def handicapped(name: str) -> tuple[float, int]:
        seconds = predicted_s[name]
        virtual = chunks_per_device[name] > 1
        return (seconds / (1 - VIRTUAL_MARGIN) if virtual else seconds, chunks_per_device[name])

    return min(predicted_s, key=handicapped)
