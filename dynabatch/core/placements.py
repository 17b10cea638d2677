"""Placement kinds: how pipeline stages sit on devices (:class:`dynabatch.schedule.placement.Placement`)."""

from __future__ import annotations

from dynabatch.core.registry import Registry

PLACEMENTS = Registry("placement", [
    ("linear", "one chunk per device"),
    ("cyclic", "2 chunks per device; T5: device d holds encoder chunk d and decoder chunk d"),
    ("interleaved", "interleaved:V, V chunks per device dealt round robin"),
])
"""``--placement`` kinds; ``interleaved`` takes ``:V`` chunks per device."""
