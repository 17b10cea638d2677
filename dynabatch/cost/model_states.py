"""Model-state bytes per rank under ``--zero``: what each data-parallel replica of a stage keeps.

A stage of ``N`` parameters keeps, on every replica without sharding (``--zero 0``), its weights, gradients and
optimizer states: the layer model's :meth:`model_state_bytes` (16 bytes a parameter for AdamW in fp32, 18 with a bf16
autocast copy). Sharding over the ``R`` replicas of the stage divides parts of it (DeepSpeed's ZeRO stages):

* ``--zero 1``: the optimizer states (AdamW's two fp32 moments, :data:`~dynabatch.cost.analytic.OPTIMIZER_STATE_BYTES`)
  are divided by ``R`` (:mod:`dynabatch.engine.zero`);
* ``--zero 2``: the gradients too (:data:`GRADIENT_BYTES` a parameter: the runtime's gradients are fp32 like its
  weights), reduced onto their owners as the backward produces them; during the backward a rank also holds the
  full gradient of the parameter being reduced (:func:`gradient_peak_bytes`).

So for Llama-3-70B in bf16 autocast on 8 stages x 8 replicas (about 8.8 B parameters a stage): 18, 4 + 2 + 4 + 8 / 8 =
11 and 4 + 2 + (4 + 8) / 8 = 7.5 bytes a parameter.
"""

from __future__ import annotations

from dynabatch.cost.analytic import OPTIMIZER_STATE_BYTES

ZERO_SETTINGS = (0, 1, 2)
"""``--zero`` settings the cost model prices."""
GRADIENT_BYTES = 4
"""Gradient bytes a parameter (fp32, as the runtime's weights)."""


def sharded_bytes_per_param(optimizer: str, zero: int) -> int:
    """Bytes a parameter that ``--zero`` divides across the replicas (0 without sharding)."""
    if zero not in ZERO_SETTINGS:
        raise ValueError(f"--zero must be one of {', '.join(map(str, ZERO_SETTINGS))}, got {zero}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid optimizers: {', '.join(OPTIMIZER_STATE_BYTES)}")
    return (OPTIMIZER_STATE_BYTES[optimizer] if zero >= 1 else 0) + (GRADIENT_BYTES if zero >= 2 else 0)


def per_rank_state_bytes(full_bytes: float, num_params: float, optimizer: str, zero: int, replicas: int) -> float:
    """One rank's model-state bytes: ``full_bytes`` (every state of ``num_params`` parameters, unsharded) with the
    part ``zero`` shards divided by ``replicas``."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    sharded = num_params * sharded_bytes_per_param(optimizer, zero)
    return float(full_bytes - sharded + sharded / replicas)


def gradient_peak_bytes(full_bytes: float, largest_bytes: float, shards: int) -> float:
    """The most gradient bytes a rank holds during the backward: every full gradient (``full_bytes``) unsharded
    (``shards == 1``: ``--zero 0`` and ``1`` keep them to the step boundary), else its ``1 / shards`` of them (its
    shard's summed gradients) plus the full gradient of the parameter being reduced (``largest_bytes`` at worst)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if shards == 1:
        return float(full_bytes)
    return float(full_bytes) / shards + float(largest_bytes)


def describe_zero(zero: int, replicas: int) -> str | None:
    """The line ``train``, ``plan`` and ``simulate`` warn with when ``--zero`` has nothing to shard: with one replica
    every stage keeps its whole states, as under ``--zero 0`` (the trainer shards only across two or more replicas);
    ``None`` otherwise."""
    if zero >= 1 and replicas == 1:
        return (f"--zero {zero} with one replica: there is nothing to shard across replicas, so every stage keeps its "
                "whole states (as --zero 0); pass --replicas 2 or more to shard them")
    return None
