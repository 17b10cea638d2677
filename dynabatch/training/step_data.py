"""Every rank collates its own micro-batches: a step's layout, and the micro-batches a rank makes of it.

The planner ships plans, not data (:mod:`dynabatch.training.planner_process`), and rank 0 delivers plans, not
tensors: every rank of a run whose data comes from its configuration loads and tokenizes the same data
(:func:`dynabatch.training.trainer.build_run`, rank 0 first, the others then from the tokenizing cache), so a
sample is named by its ``(source, row)`` and any rank rebuilds it. :class:`StepData` is that shared knowledge:

* rank 0 turns a :class:`~dynabatch.training.planned_step.PlannedStep` into one *layout* per replica
  (:meth:`StepData.layouts`): the ``(source, row)`` ids of the global batch, its counts, and the replica's
  units (rows of sample indices, fixed row lengths, token-slice bounds), a few KB of plain integers, plus the
  step's loss-token count from lengths alone (:meth:`StepData.loss_tokens`);
* every rank, rank 0 included, makes its replica's micro-batches of its layout (:meth:`StepData.micro_batches`:
  the batch rebuilt as the planner drew and prepared it, :meth:`~dynabatch.data.batching.GlobalBatcher.resolve`
  and :func:`~dynabatch.training.planner.prepared_batch`, then collated as the planner laid it out), which the
  engine cuts for the rank's stages (``collate`` of :func:`~dynabatch.engine.step.train_step`).

The engine carries a layout as opaque bytes (:attr:`~dynabatch.engine.delivery.StepInputs.layout`). A layout is
pickled plain tuples, integers and bytes (no class is named in it), versioned by :data:`LAYOUT_VERSION`.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from dynabatch.data.baselines import RowGroup
from dynabatch.data.batching import GlobalBatcher
from dynabatch.data.collate import loss_token_count
from dynabatch.data.microbatch import MicroBatch
from dynabatch.data.sample import BatchRows, GlobalBatch
from dynabatch.data.tokenize import TokenizerInfo
from dynabatch.engine.dist import DistContext, PipelineError
from dynabatch.engine.step import receive_failure
from dynabatch.training.config import TrainConfig
from dynabatch.training.planned_step import PlannedStep
from dynabatch.training.planner import prepared_batch
from dynabatch.training.units import Unit, collate_group, micro_batches_of

LAYOUT_VERSION = 1
"""The layout's format: ``(version, step, ids bytes, truncated, dropped, units)``."""
_MODE_TAG, _READY_TAG = 11, 12
"""Tags of the start-up handshake on the delivery group (delivery uses 0 and 1, the run layout 9)."""


def announce_data(ctx: DistContext, collates: bool, timeout_s: float) -> bool:
    """Collective at start-up, once rank 0 has loaded its data: rank 0 tells every rank whether it loads the data
    too and collates its own micro-batches (``collates``: the data comes from the run's configuration, which every
    rank reads alike; data given in memory is rank 0's, whose tensors are delivered); returns the answer. The
    others wait up to ``timeout_s`` (the start-up timeout: rank 0 may be tokenizing)."""
    if ctx.world_size == 1:
        return collates
    flag = torch.tensor([int(collates)], dtype=torch.int64)
    if ctx.is_planner:
        for w in [dist.isend(flag, dst=r, group=ctx.delivery_group, tag=_MODE_TAG) for r in range(1, ctx.world_size)]:
            w.wait(timedelta(seconds=timeout_s))
        return collates
    try:
        dist.irecv(flag, src=0, group=ctx.delivery_group, tag=_MODE_TAG).wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:  # rank 0 still loading, or gone
        raise PipelineError(receive_failure(ctx.rank, 0, timeout_s, e)) from e
    return bool(flag.item())


def data_ready(ctx: DistContext, timeout_s: float) -> None:
    """Collective after :func:`announce_data` said the ranks collate: each other rank tells rank 0 it has loaded the
    data; rank 0 waits up to ``timeout_s`` for all of them, before anything that waits on them with the run's
    shorter ``--timeout-s``."""
    if ctx.world_size == 1:
        return
    flag = torch.ones(1, dtype=torch.int64)
    wait = timedelta(seconds=timeout_s)
    if not ctx.is_planner:
        dist.isend(flag, dst=0, group=ctx.delivery_group, tag=_READY_TAG).wait(wait)
        return
    for r in range(1, ctx.world_size):
        try:
            dist.irecv(flag, src=r, group=ctx.delivery_group, tag=_READY_TAG).wait(wait)
        except RuntimeError as e:
            raise PipelineError(f"rank 0: rank {r} did not report the data loaded within startup_timeout_s="
                                f"{timeout_s:g} s (it may have failed: see its own line; {e})") from e


@dataclass
class StepData:
    """A run's data as every rank holds it: its batcher (data, limits and over-long policy; its position is not
    used), the configuration (the method, whose baseline may cut samples) and the tokenizer's ids."""

    batcher: GlobalBatcher
    cfg: TrainConfig
    tokens: TokenizerInfo
    _recent: dict[int, GlobalBatch] = field(default_factory=dict, repr=False)
    """The batches of the latest steps this rank rebuilt or planned (rank 0 collates from the planner's)."""

    @property
    def family(self) -> str:
        return self.batcher.limits.family

    def batch(self, rows: BatchRows) -> GlobalBatch:
        """The global batch of ``rows``, as the planner drew and prepared it (its units index this batch)."""
        batch = self._recent.get(rows.step)
        if batch is None:
            batch = prepared_batch(self.cfg, self.batcher.limits, self.tokens, self.batcher.resolve(rows))
            self._remember(batch)
        return batch

    def _remember(self, batch: GlobalBatch) -> None:
        self._recent[batch.step] = batch
        for step in [s for s in self._recent if s < batch.step - 1]:
            del self._recent[step]

    def layouts(self, planned: PlannedStep) -> tuple[bytes, ...]:
        """Per replica, the layout of its micro-batches in ``planned`` (what rank 0 sends the replica's ranks)."""
        if isinstance(planned.batch, GlobalBatch):
            self._remember(planned.batch)
        rows = planned.drawn
        head = (LAYOUT_VERSION, int(rows.step), np.ascontiguousarray(rows.ids, dtype=np.int64).tobytes(),
                int(rows.num_truncated), int(rows.num_dropped))
        return tuple(pickle.dumps((*head, tuple((u.group.rows, u.group.encoder_len, u.group.decoder_len, u.bounds)
                                                for u in units)), protocol=pickle.HIGHEST_PROTOCOL)
                     for units in planned.replica_units)

    def loss_tokens(self, planned: PlannedStep) -> int:
        """The loss tokens of every micro-batch of every replica of ``planned``, from the lengths alone (the
        collated micro-batches' ``num_loss_tokens`` add up to it; token slices share their sample's)."""
        ids = [i for units in planned.replica_units for u in units for row in u.group.rows for i in row]
        batch = planned.batch
        return loss_token_count(batch.input_lens[ids], batch.target_lens[ids], self.family) if ids else 0

    def micro_batches(self, layout: bytes) -> list[MicroBatch]:
        """The micro-batches of one replica's ``layout``, in execution order (token slices cut)."""
        version, step, ids, truncated, dropped, units = pickle.loads(layout)
        if version != LAYOUT_VERSION:
            raise ValueError(f"a step layout of format {version}, this dynabatch reads {LAYOUT_VERSION}: every rank "
                             "must run the same dynabatch")
        rows = BatchRows(step, np.frombuffer(ids, dtype=np.int64).reshape(-1, 2), truncated, dropped)
        batch = self.batch(rows)
        units = [Unit(RowGroup(r, e, d), b) for r, e, d, b in units]
        return micro_batches_of(units, lambda g: collate_group(batch, g, self.family, self.tokens))[0]
