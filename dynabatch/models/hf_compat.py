"""Keyword names that changed within transformers 5.x, resolved against the installed version.

A block's KV-cache argument is ``past_key_values`` in transformers 5.17 and ``cache`` in 5.24 (GPT-2,
Llama, T5 blocks). Our token slices hand a :class:`~dynabatch.models.slice_kv.SliceCache` to every
attention block through that argument, so the name must be the installed version's: a misspelt keyword
lands in ``**kwargs`` and is silently ignored. GPU images often lag the newest release (the lent H200
machine has 5.17), so both spellings are supported.
"""

from __future__ import annotations

import functools
import inspect


@functools.lru_cache(maxsize=None)
def _cache_name(block_type: type) -> str:
    params = inspect.signature(block_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(block, cache) -> dict:
    """``{name: cache}`` with the KV-cache keyword that ``block``'s forward takes, or for a module that hands its
    keywords on (a block's attention half: ``cache_target``) the keyword of the module they reach. Resolved against
    the half itself, whose forward names none, it was ``past_key_values``: under 5.25 a FutureWarning on every stage
    cut inside a block, and from 5.40, where the alias goes, a slice's context silently unused."""
    return {_cache_name(type(getattr(block, "cache_target", block))): cache}
