"""Small wording helpers the commands' lines share (torch-free)."""

from __future__ import annotations


def counted(count: int, noun: str) -> str:
    """``1 source``, ``2 sources``: a count and its noun, plural unless one."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
