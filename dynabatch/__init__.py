"""dynabatch: dynamic variable-size micro-batching for multi-task T5/GPT training.

Layers (one-way imports): ``data`` -> ``cost`` -> ``plan`` -> ``schedule`` -> ``runtime``;
``models`` wraps Hugging Face models; ``cli`` is the ``dynabatch`` command.
"""

__version__ = "0.1.0"
