"""``dynabatch bench``'s pipeline layouts: the placements of ``--placements``, the layer split of each
(``--layer-split``, chosen on rank 0 and broadcast) and the chunks each rank builds for them."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from dynabatch.commands.bench_report import PEER
from dynabatch.cost.model_specs import layer_kinds
from dynabatch.models.families import analytic_spec
from dynabatch.models.split import build_device_stages, layout_for, pipeline_spec_for
from dynabatch.training.cost_model import planner_cost_model
from dynabatch.training.planner import StepPlanner
from dynabatch.training.run_layout import RunLayout, SAMPLED_BATCHES, choose_run_layout
from dynabatch.schedule.placement import Placement


class ListBatcher:
    """The batcher interface :class:`StepPlanner` needs, over a fixed list of global batches."""

    def __init__(self, batches, limits) -> None:
        self.batches, self.limits, self.step = batches, limits, 0

    def next_batch(self):
        batch = self.batches[self.step % len(self.batches)]
        self.step += 1
        return batch

    def state_dict(self) -> dict:
        return {"step": self.step}


def placements(args) -> list:
    """The :class:`~dynabatch.schedule.placement.Placement` of every entry of ``--placements`` but linear."""
    placements = [Placement.parse(t.strip(), args.stages) for t in args.placements.split(",")]
    return [p for p in placements if p.kind != "linear"]


def placed_methods(args, methods) -> dict:
    """``METHOD@PLACEMENT`` -> ``(Placement, METHOD)`` for every non-linear placement of ``--placements``."""
    return {f"{m}@{p.describe()}": (p, m) for p in placements(args) for m in methods if m != PEER}


def choose_layouts(args, methods, cfgs, base, model, batches, limits, info, ctx) -> dict:
    """Collective: ``linear`` and every placement of ``--placements`` -> its
    :class:`~dynabatch.training.run_layout.RunLayout`, chosen on rank 0 and broadcast. ``--layer-split data``
    balances each placement's chunks over the micro-batches every method (the peer as packing) cuts the first
    global batches into, so all methods run on the same stage modules and none on a split tuned for it alone.
    ``base`` is the dynamic method's configuration, whose cost model prices the layers each split balances."""
    texts: list = [None]
    if ctx.is_planner:
        sampled = batches[:SAMPLED_BATCHES]
        planned = list(dict.fromkeys(cfgs[m] for m in methods))  # the peer is planned as packing

        def preview(own, layout) -> list:
            out = []
            for cfg in planned:
                cfg = dataclasses.replace(cfg, placement=own.placement)
                planner = StepPlanner(ListBatcher(sampled, limits), cfg, planner_cost_model(cfg, model.config, layout), info)
                out += [planner.preview(b) for b in sampled]
            return out

        if any(cfgs[m].cost_profile for m in methods):  # a profile times whole blocks: every method's split keeps them
            base = dataclasses.replace(base, split_blocks="off")
        layer_model = planner_cost_model(base, model.config, layout_for(model, 1)).model
        texts[0] = {p: choose_run_layout(dataclasses.replace(base, placement=p), model, layer_model, preview).encode()
                    for p in ["linear", *(q.describe() for q in placements(args))]}
    dist.broadcast_object_list(texts, src=0, group=ctx.delivery_group)
    kinds = layer_kinds(analytic_spec(model.config))
    return {p: RunLayout.decode(t, kinds, args.stages) for p, t in texts[0].items()}


def placed_chunks(layouts: dict, model, device: int) -> dict:
    """Per non-linear placement of ``layouts``: its chunk layout, pipeline spec and the chunks ``device`` holds."""
    out = {}
    for name, run in layouts.items():
        if run.placement.kind == "linear":
            continue
        chunks = build_device_stages(model, run.layout, device, run.placement.num_devices)
        out[name] = (run.layout, pipeline_spec_for(model, run.layout, "float32"), chunks)
    return out
