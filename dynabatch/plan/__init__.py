"""Micro-batch planning: order the samples of a global batch and cut them into micro-batches.

numpy + numba only (no torch, no torch.distributed, no transformers). Entry point:
:func:`dynabatch.plan.partition.plan_partition`; cost interface: :mod:`dynabatch.plan.costs`;
orderings: :mod:`dynabatch.plan.order`; data-parallel split: :mod:`dynabatch.plan.replicas`;
in-row packing and fill/drain order: :mod:`dynabatch.plan.rowpack`; token slicing (TeraPipe):
:mod:`dynabatch.plan.slicing`, its slice cost models :mod:`dynabatch.plan.slice_costs`.
"""

from dynabatch.plan.costs import MicroBatchCostModel, PolynomialCostModel
from dynabatch.plan.order import order_samples
from dynabatch.plan.partition import PartitionPlan, plan_partition
from dynabatch.plan.replicas import ReplicaPlan, assign_micro_batches, plan_replicas
from dynabatch.plan.slice_costs import AnalyticSliceCostModel, PolynomialSliceCostModel, SliceCostModel
from dynabatch.plan.slicing import SliceDecision, SlicePlan, plan_slices, slice_long_samples
from dynabatch.plan.rowpack import (
    PackedUnits,
    RowPackedPlan,
    RowPacking,
    apply_row_packing,
    order_for_fill_drain,
    pack_rows,
    pack_units,
)

__all__ = [
    "AnalyticSliceCostModel",
    "PolynomialSliceCostModel",
    "SliceCostModel",
    "SliceDecision",
    "SlicePlan",
    "plan_slices",
    "slice_long_samples",
    "MicroBatchCostModel",
    "PackedUnits",
    "PartitionPlan",
    "PolynomialCostModel",
    "ReplicaPlan",
    "RowPackedPlan",
    "RowPacking",
    "apply_row_packing",
    "assign_micro_batches",
    "order_for_fill_drain",
    "order_samples",
    "pack_rows",
    "pack_units",
    "plan_partition",
    "plan_replicas",
]
