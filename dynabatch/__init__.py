"""dynabatch: dynamic variable-size micro-batching for multi-task T5/GPT training.

Layers, bottom to top (each imports only from below; docs/architecture.md, checked by
``scripts/check_layers.py``): ``core`` (names and registries) -> ``data`` -> ``cost`` -> ``plan`` ->
``schedule`` -> ``models`` -> the pipeline engine (``engine``) -> the training application (``training``) ->
``integrations`` -> ``commands`` -> ``cli``.

This package exports nothing but ``__version__`` (it is the bottom layer, so it cannot import ``integrations``).
The library API, as ``docs/huggingface.md`` uses it::

    from dynabatch.integrations import DynaBatchDataLoader, DynaBatchTrainer, StepBatch
    from dynabatch.data.batching import LengthLimits
    from dynabatch.data.tokenize import load_tokenizer
    from dynabatch.models.forward import forward_loss
"""

__version__ = "0.1.0"
