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
    """``{name: cache}`` with the KV-cache keyword that ``block``'s forward takes."""
    return {_cache_name(type(block)): cache}
