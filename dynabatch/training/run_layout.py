"""The run's layer split and placement, chosen once at start on rank 0 and sent to every rank.

``--layer-split data`` (the default) balances the pipeline chunks over the run's own length distribution
instead of one reference shape, and ``--placement auto`` picks the placement of those chunks on the devices
by simulating the run's own global batches (issue 17). Rank 0 alone holds the data, so it decides and every
other rank receives the decision before it builds its stage modules.

The choice (:func:`choose_run_layout`):

1. **Sample.** The first :data:`SAMPLED_BATCHES` global batches of the run's stream, drawn by a fresh
   batcher over the same data: the training stream does not move, and a resumed run samples the same
   batches, so it gets the same split and placement as the run it continues.
2. **Split.** For each candidate placement, the run's planner (its method, flags and base cost model: the
   analytic preset or ``--cost-profile``, never a calibration) plans the sampled batches on the reference
   split (``models.split.layout_for``), and the chunks are re-cut to balance the summed per-layer time of
   those micro-batches (:func:`~dynabatch.cost.layer_split.balanced_layout`, :func:`~dynabatch.cost.layer_split.cyclic_layout`
   for T5's cyclic placement). A baseline's micro-batches do not depend on the split: one round. The dynamic
   planner's do (it keeps the DP's plan or a baseline's, whichever is predicted faster on the split), so its split
   is balanced again over the plans made on the new one, up to :data:`~dynabatch.cost.layer_split.SPLIT_ROUNDS`
   splits, and the one its steps are predicted shortest on is kept. Where that split cuts
   inside a block (``--split-blocks``), the whole-block split is planned too and kept when its steps are predicted
   no longer: the cut balances the stages' summed compute, and on a pipeline whose lighter stage hid the bubble,
   balancing it can bring the bubble out (T5 at 2,048 tokens on this CPU, docs/algorithms/runtime.md, "Cutting inside a block").
3. **Placement** (``auto`` only). The sampled batches are planned again on each candidate's split and every
   step predicted as the runtime will run it (linear: the ``--policy`` schedule's simulation; virtual
   stages: the placement's shortest order, :func:`~dynabatch.schedule.virtual.placed_step`). Linear wins unless a
   virtual placement's summed predicted step is more than
   :data:`~dynabatch.training.config.placement_choice.VIRTUAL_MARGIN` shorter; then the shortest
   wins. Candidates: linear, and ``cyclic`` for encoder-decoder models or ``interleaved:2``
   for decoder-only ones, when the model has the blocks (and at least 2 devices).

The decision travels as one short text (``placement;chunk sizes``) over rank 0's delivery group, each
other rank waiting up to ``--startup-timeout-s`` (rank 0 may still be loading the data).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from dynabatch.training.config.placement_choice import VIRTUAL_MARGIN, pick_placement, placement_candidates  # noqa: F401
from dynabatch.core.sequence import is_seq2seq
from dynabatch.core.methods import is_planner
from dynabatch.cost.model_specs import join_halves, split_halves
from dynabatch.cost.stages import StageLayout
from dynabatch.cost.layer_split import placement_layout, rebalanced_layout
from dynabatch.data.batching import GlobalBatcher
from dynabatch.models.families import family_for_config
from dynabatch.models.split import layout_for
from dynabatch.training.cost_model import planner_cost_model
from dynabatch.engine.dist import PipelineError
from dynabatch.training.planner import StepPlanner
from dynabatch.engine.step import receive_failure
from dynabatch.schedule.placement import Placement

logger = logging.getLogger(__name__)

SAMPLED_BATCHES = 4
"""Global batches of the run's own stream the start-up choice plans."""
_LAYOUT_TAG = 9
_MAX_TEXT = 4096


@dataclass(frozen=True)
class RunLayout:
    """Where the model's layers run: the placement and the chunks' layer kinds, chunk ``c`` on device
    ``placement.device(c)``."""

    placement: Placement
    layout: StageLayout
    predicted_step_s: dict[str, float] = field(default_factory=dict)
    """``--placement auto``: each candidate's summed predicted step over the sampled batches (empty otherwise)."""
    split: str = "reference"
    """``data`` when the chunks are balanced over the sampled micro-batches."""

    def encode(self) -> str:
        """``placement;n0,n1,...;split``: the placement and each chunk's number of layer kinds, blocks counted as
        their two halves where they have them (so a cut inside a block travels too)."""
        sizes = ",".join(str(len(split_halves(s))) for s in self.layout.stages)
        return f"{self.placement.describe()};{sizes};{self.split}"

    @staticmethod
    def decode(text: str, kinds: list[str], num_devices: int) -> "RunLayout":
        """Inverse of :meth:`encode` for a model whose layer kinds are ``kinds``."""
        placement, sizes, split = text.split(";")
        halves = split_halves(kinds)
        stages, start = [], 0
        for n in (int(x) for x in sizes.split(",")):
            stages.append(join_halves(halves[start:start + n]))
            start += n
        if start != len(halves):
            raise ValueError(f"layout {text!r} covers {start} of the model's {len(halves)} layers and block halves")
        return RunLayout(Placement.parse(placement, num_devices), StageLayout(tuple(stages)), split=split)

    def describe(self) -> str:
        return f"placement {self.placement.describe()}, {self.split} split {self.layout.describe()}"


def candidate_placements(cfg, seq2seq: bool) -> list[Placement]:
    """The placements ``cfg.placement`` allows: itself, or with ``auto`` linear and the model family's virtual
    stages where the flags allow them."""
    return [Placement.parse(name, cfg.stages) for name in placement_candidates(cfg.placement, cfg.stages, seq2seq)]


def choose_run_layout(cfg, model, layer_model, preview: Callable[[object, StageLayout], list]) -> RunLayout:
    """Rank 0: the split and placement of the run (module docstring). ``preview(cfg, layout)`` plans the sampled
    batches with ``cfg``'s method and its base cost model over ``layout`` and returns the
    :class:`~dynabatch.training.planned_step.PlannedStep` of each; ``layer_model`` (that cost model's per-layer
    model) prices the layers the split balances."""
    seq2seq = is_seq2seq(family_for_config(model.config).sequence_kind)
    planned: dict = {}

    def plans(own, layout: StageLayout) -> list:  # each (placement, layout) is planned once
        key = (own.placement, layout)
        if key not in planned:
            planned[key] = preview(own, layout)
        return planned[key]

    def predicted_s(own, layout: StageLayout) -> float:
        return sum(p.predicted_makespan_s for p in plans(own, layout))

    options = []
    for placement in candidate_placements(cfg, seq2seq):
        try:
            reference = layout_for(model, placement.num_stages, placement, cfg.cuts_inside_blocks)
        except ValueError:
            if cfg.placement != "auto":
                raise
            continue  # auto: a model too small for this candidate's chunks
        own = replace(cfg, placement=placement.describe())
        layout, split = reference, "reference"
        if cfg.layer_split == "data":
            layout, split = _data_split(own, reference, placement, layer_model, plans, predicted_s), "data"
        options.append((own, RunLayout(placement, layout, split=split)))
    if len(options) == 1:
        return options[0][1]
    predicted = {run.placement.describe(): predicted_s(own, run.layout) for own, run in options}
    name = pick_placement(predicted, {run.placement.describe(): run.placement.chunks_per_device for _, run in options})
    best = next(run for _, run in options if run.placement.describe() == name)
    return replace(best, predicted_step_s=predicted)


def _data_split(own, reference: StageLayout, placement, layer_model, plans, predicted_s) -> StageLayout:
    """The ``data`` split of ``placement`` (module docstring, 2): balanced over the micro-batches ``plans(own,
    layout)`` makes on the reference split; the whole-block split instead where a cut inside a block is not
    predicted faster. A baseline's micro-batches do not depend on the split: one round. The dynamic planner's do,
    so its split is balanced again over the plans made on the new one, up to
    :data:`~dynabatch.cost.layer_split.SPLIT_ROUNDS` splits, and the one its steps are predicted shortest on is kept
    (the first on a tie)."""
    def balance(sampled) -> StageLayout:
        layout = placement_layout(layer_model, placement, sampled, split_blocks=own.cuts_inside_blocks)
        if own.cuts_inside_blocks and layout != (whole := placement_layout(layer_model, placement, sampled)):
            layout = min((whole, layout), key=lambda candidate: predicted_s(own, candidate))  # whole on a tie
        return layout

    return rebalanced_layout(reference, lambda layout: _micro_batches(plans(own, layout)), balance,
                             (lambda layout: predicted_s(own, layout)) if is_planner(own.method) else None)


def sampled_run_layout(cfg, model, data, batcher) -> RunLayout:
    """Rank 0: :func:`choose_run_layout` over the first :data:`SAMPLED_BATCHES` global batches of the run's stream
    (``data``, drawn by a fresh batcher like ``batcher``), each planned by a
    :class:`~dynabatch.training.planner.StepPlanner` with the run's base cost model (no calibration)."""
    fresh = GlobalBatcher(data, batcher.limits, token_budget=batcher.token_budget, overlong=batcher.overlong)
    sampled = [fresh.next_batch() for _ in range(SAMPLED_BATCHES)]

    def preview(own, layout) -> list:
        planner = StepPlanner(batcher, own, planner_cost_model(own, model.config, layout), data.tokens)
        return [planner.preview(b) for b in sampled]

    layer_model = planner_cost_model(cfg, model.config, layout_for(model, 1)).model
    return choose_run_layout(cfg, model, layer_model, preview)


def _micro_batches(planned: list) -> list:
    """``(shapes, pairs)`` of replica 0's micro-batches of each planned step (what the split is balanced over)."""
    return [(p.shapes[0], p.pairs[0] if p.pairs else None) for p in planned]


def share_run_layout(ctx, run_layout: RunLayout | None, kinds: list[str], timeout_s: float) -> RunLayout:
    """Collective over the delivery group: rank 0 sends ``run_layout`` to every rank; the others return it."""
    if ctx.world_size == 1:
        return run_layout
    buffer = torch.zeros(_MAX_TEXT, dtype=torch.uint8)
    if ctx.is_planner:
        raw = run_layout.encode().encode()
        buffer[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        for w in [dist.isend(buffer, dst=r, group=ctx.delivery_group, tag=_LAYOUT_TAG) for r in range(1, ctx.world_size)]:
            w.wait()
        return run_layout
    try:
        dist.irecv(buffer, src=0, group=ctx.delivery_group, tag=_LAYOUT_TAG).wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:  # rank 0 still loading (the first step's message), or gone
        raise PipelineError(receive_failure(ctx.rank, 0, timeout_s, e)) from e
    text = bytes(buffer.numpy()).rstrip(b"\0").decode()
    return RunLayout.decode(text, kinds, ctx.num_stages)
