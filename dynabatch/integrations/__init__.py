"""Integrations with other training stacks. Nothing in dynabatch imports this package.

``from dynabatch.integrations import DynaBatchDataLoader, StepBatch`` needs torch only;
``DynaBatchTrainer`` is imported on first use, since it pulls in ``transformers`` and ``accelerate``.
"""

from dynabatch.integrations.dataloader import DynaBatchDataLoader, StepBatch, StepStats

__all__ = ["DynaBatchDataLoader", "DynaBatchTrainer", "StepBatch", "StepStats"]


def __getattr__(name: str):
    if name == "DynaBatchTrainer":
        from dynabatch.integrations.trainer import DynaBatchTrainer  # lazy: optional, needs transformers' Trainer

        return DynaBatchTrainer
    raise AttributeError(f"module 'dynabatch.integrations' has no attribute {name!r}")
