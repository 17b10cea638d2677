"""The category of a warning that every rank of a run would give alike.

A check of the run's settings or model config (say, a length limit above a rotary model's trained positions)
runs on every rank and finds the same; :func:`dynabatch.engine.log.setup_logging` lets rank 0 alone say it, so
a run of several ranks prints it once. It is a ``UserWarning``: ``pytest.warns(UserWarning)`` and a user's
filters still see it.
"""

from __future__ import annotations


class EveryRankWarning(UserWarning):
    """A warning about the run's settings or model, the same on every rank: said by rank 0 only."""
