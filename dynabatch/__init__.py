"""dynabatch: dynamic variable-size micro-batching for multi-task T5/GPT training.

Layers, bottom to top (each imports only from below; docs/architecture.md, checked by
``scripts/check_layers.py``): ``core`` (names and registries) -> ``data`` -> ``cost`` -> ``plan`` ->
``schedule`` -> ``models`` -> the pipeline engine (``engine``) -> the training application (``training``) ->
``integrations`` -> ``commands`` -> ``cli``.
"""

__version__ = "0.1.0"
