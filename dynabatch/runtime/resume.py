"""``--resume``: what may change between the run that wrote a checkpoint and the run that continues it.

:func:`compare_configs` checks the new :class:`~dynabatch.config.TrainConfig` against the one stored
in the checkpoint's manifest. Fields in :data:`~dynabatch.config.FIXED_ON_RESUME` decide the model,
the data stream or the world shape; changing one is a ``ValueError`` that names every such field with
its old and new value. Every other change is allowed and returned as a note for the log. After the
optimizer and scheduler states are restored, :func:`apply_hyperparameters` makes the new ``learning_rate`` and
``weight_decay`` take effect (a restored optimizer state would otherwise silently keep the old ones)
and recomputes the current learning rate under the new schedule (``max_steps``, ``warmup_steps``,
``lr_scheduler_type``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dynabatch.config import FIXED_ON_RESUME, TrainConfig, canonical

_NOT_COMPARED = ("resume_from_checkpoint", "output_dir", "overwrite_output_dir")


def compare_configs(old: dict[str, Any], new: TrainConfig, where: str) -> list[str]:
    """Raise ``ValueError`` if a fixed field differs; return ``"name: old -> new"`` for the others."""
    current = new.to_dict()
    old = canonical(old)  # a checkpoint of an older version stores older names (``lr``, ``steps``)
    fixed, notes = [], []
    for name, value in current.items():
        if name in _NOT_COMPARED or name not in old or old[name] == value:
            continue
        change = f"{name}: {old[name]!r} -> {value!r}"
        (fixed if name in FIXED_ON_RESUME else notes).append(change)
    if fixed:
        raise ValueError(
            f"--resume: checkpoint {where} was written with other settings that cannot change ({'; '.join(fixed)}); "
            "use the checkpoint's values, or start a new run in another --output-dir"
        )
    return notes


def apply_hyperparameters(optimizer, scheduler, cfg: TrainConfig, lr_lambda: Callable[[int], float]) -> None:
    """Make ``cfg.learning_rate`` / ``cfg.weight_decay`` and the LR schedule of ``cfg`` current after a restore."""
    scheduler.base_lrs = [cfg.learning_rate for _ in optimizer.param_groups]
    factor = lr_lambda(scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.learning_rate
        group["weight_decay"] = cfg.weight_decay
        group["lr"] = cfg.learning_rate * factor
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
