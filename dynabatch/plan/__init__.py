"""Micro-batch planning: order the samples of a global batch and cut them into micro-batches.

numpy + numba only (no torch, no torch.distributed, no transformers). Entry point:
:func:`dynabatch.plan.partition.plan_partition`; cost interface: :mod:`dynabatch.plan.costs`;
orderings: :mod:`dynabatch.plan.order`.
"""

from dynabatch.plan.costs import MicroBatchCostModel, PolynomialCostModel
from dynabatch.plan.order import order_samples
from dynabatch.plan.partition import PartitionPlan, plan_partition

__all__ = ["MicroBatchCostModel", "PartitionPlan", "PolynomialCostModel", "order_samples", "plan_partition"]
