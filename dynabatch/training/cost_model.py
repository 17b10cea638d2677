"""The training run's cost model: the :class:`~dynabatch.cost.stages.StageCostModel` its planner prices with.

Shared by the training loop (:mod:`dynabatch.training.trainer`), the start-up layout choice
(:mod:`dynabatch.training.run_layout`) and ``dynabatch bench``, which price one configuration the same way.
"""

from __future__ import annotations

from dynabatch.training.config import TrainConfig, decide, lower
from dynabatch.cost.planner_model import ProfiledLayerModel
from dynabatch.cost.stages import StageCostModel
from dynabatch.cost.tables import CostTables, check_profile_config
from dynabatch.models.families import run_cost_model
from dynabatch.engine.dist import device_type


def planner_cost_model(cfg: TrainConfig, model_config, layout):
    """The planner's ``StageCostModel``: profiled tables when ``cfg.cost_profile`` is set (their model config
    must match ``model_config``), else the analytic model with the preset of the run's device (the rough
    ``cpu`` one on CPU, the GPU's on CUDA: :func:`~dynabatch.cost.hardware.device_hardware`). Activation
    recomputation as ``cfg.recompute`` says (``auto``: as :mod:`dynabatch.training.config.resolve` decides: per micro-batch
    for the dynamic planner, none for a baseline or with profiled tables, which do not price it; an explicit
    ``selective`` / ``full`` with a profile is refused with one line)."""
    if cfg.cost_profile:
        tables = CostTables.load(cfg.cost_profile)
        check_profile_config(tables.meta.get("config") or {}, model_config.to_dict(), cfg.cost_profile)
        layer_model = ProfiledLayerModel(tables)
    else:
        layer_model = run_cost_model(model_config, device_type(cfg.device), dtype=cfg.dtype,
                                     attention_path=cfg.attention_path, dropout=cfg.dropout > 0)
    recompute = lower("recompute", decide(cfg, "recompute"))  # the resolver's rule (a profile: none)
    return StageCostModel(layer_model, layout, cfg.memory_gib * 2**30, memory_margin=0.0, recompute=recompute,
                          zero=cfg.zero, replicas=cfg.replicas)
