"""The bottom layer: names and registries every other layer shares, torch-free and import-cheap.

Each name is registered once, here, and every choice list, help text and check elsewhere reads it:

- :mod:`~dynabatch.core.methods`: batching methods (``dynamic`` and the baseline batchers);
- :mod:`~dynabatch.core.policies`: schedule, placed-schedule and recomputation policies;
- :mod:`~dynabatch.core.placements`: how stages sit on devices;
- :mod:`~dynabatch.core.sequence`: sequence kinds (causal, seq2seq);
- :mod:`~dynabatch.core.dtypes`: compute precisions;
- :mod:`~dynabatch.core.devices`: device names (``--device``);
- :mod:`~dynabatch.core.attention` and :mod:`~dynabatch.core.packing`: attention paths and kernels, row packing.

:class:`~dynabatch.core.registry.Registry` is the tuple of a kind's names with a help line each. Nothing here
imports another part of dynabatch (``scripts/check_layers.py`` checks it).
"""
