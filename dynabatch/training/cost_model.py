"""The training run's cost model: the :class:`~dynabatch.cost.stages.StageCostModel` its planner prices with.

Shared by the training loop (:mod:`dynabatch.training.trainer`), the start-up layout choice
(:mod:`dynabatch.training.run_layout`) and ``dynabatch bench``, which price one configuration the same way;
``dynabatch plan`` and ``simulate`` read a ``--cost-profile`` through :func:`profiled_layer_model` too.
"""

from __future__ import annotations

from dynabatch.core.sequence import is_seq2seq
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
        layer_model = profiled_layer_model(cfg, model_config)
    else:
        layer_model = run_cost_model(model_config, device_type(cfg.device), dtype=cfg.dtype,
                                     attention_path=cfg.attention_path, dropout=cfg.dropout > 0)
    recompute = lower("recompute", decide(cfg, "recompute"))  # the resolver's rule (a profile: none)
    return StageCostModel(layer_model, layout, cfg.memory_gib * 2**30, memory_margin=0.0, recompute=recompute,
                          zero=cfg.zero, replicas=cfg.replicas, moving_boundaries=cfg.moving_boundaries)


def profiled_layer_model(cfg, model_config) -> ProfiledLayerModel:
    """``cfg.cost_profile``'s tables as the planner's layer model, after the two checks that make them this run's
    prices, each one ``ValueError`` line: the profile's model config is ``model_config`` (``cfg.model`` names it;
    :func:`~dynabatch.cost.tables.check_profile_config`) and its grid reaches the length limits
    (:func:`check_profile_covers`). ``cfg``: a :class:`TrainConfig`, or a command's parsed flags with the same
    fields (``plan`` and ``simulate``)."""
    tables = CostTables.load(cfg.cost_profile)
    check_profile_config(tables.meta.get("config") or {}, model_config.to_dict(), cfg.cost_profile, model=cfg.model,
                         profile_model=(tables.meta.get("model") or {}).get("name") or "")
    check_profile_covers(tables, cfg)
    return ProfiledLayerModel(tables)


def _reaching(axis, need: int) -> str:
    """A grid axis that reaches ``need``: ``axis`` doubled from its last value until it does."""
    values = [int(v) for v in axis]
    while values[-1] < need:
        values.append(min(2 * values[-1], need))
    return ",".join(map(str, values))


def check_profile_covers(tables: CostTables, cfg) -> None:
    """One ``ValueError`` line when the lengths of ``cfg.cost_profile``'s grid stop below the run's length limits
    (``--max-input-len``; T5 also ``--max-target-len``): a sample beyond the grid has no price, and the planner
    would find it needs "infinite" memory only once the data is loaded. Said before anything loads."""
    seq2seq = is_seq2seq(tables.family)
    axes = [("encoder lengths" if seq2seq else "lengths", "--seq-lengths", tables.axis_e, cfg.max_input_len,
             "--max-input-len")]
    if seq2seq:
        axes.append(("decoder lengths", "--dec-lengths", tables.axis_d, cfg.max_target_len, "--max-target-len"))
    short = [(what, flag, axis, need, limit) for what, flag, axis, need, limit in axes if axis[-1] < need]
    if not short:
        return
    covers = " and ".join(f"{what} up to {int(axis[-1])}" for what, _, axis, _, _ in short)
    needs = " and ".join(f"{limit} {need}" for _, _, _, need, limit in short)
    redo = " ".join(f"{flag} {_reaching(axis, need)}" for _, flag, axis, need, _ in short)
    lower_to = " and ".join(f"{limit} to {int(axis[-1])}" for _, _, axis, _, limit in short)
    raise ValueError(f"cost profile {cfg.cost_profile} covers {covers} (batch sizes up to {int(tables.axis_b[-1])}), "
                     f"but this run's samples reach {needs}; re-profile with `dynabatch profile ... {redo}` covering "
                     f"them, or lower {lower_to}")
