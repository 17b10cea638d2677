"""Hugging Face integration: the dataloader for any PyTorch loop and the ``Trainer`` subclass.

``DynaBatchDataLoader`` (:mod:`dynabatch.integrations.dataloader`) needs torch only;
``DynaBatchTrainer`` (:mod:`dynabatch.integrations.trainer`) needs ``transformers`` and ``accelerate``.
"""

from dynabatch.integrations.dataloader import (
    METHODS,
    DynaBatchDataLoader,
    StepBatch,
    StepStats,
    default_cost_model,
    sample_loss_tokens,
)
from dynabatch.integrations.trainer import LOADER_STATE_NAME, DynaBatchTrainer

__all__ = [
    "LOADER_STATE_NAME",
    "METHODS",
    "DynaBatchDataLoader",
    "DynaBatchTrainer",
    "StepBatch",
    "StepStats",
    "default_cost_model",
    "sample_loss_tokens",
]
