"""``--full-determinism``: torch's deterministic settings for the length of a run (Hugging Face's
``enable_full_determinism``: seeds, ``torch.use_deterministic_algorithms``, cuDNN deterministic and no benchmark,
``CUBLAS_WORKSPACE_CONFIG``), put back as they were when the run ends, so a run in a process that goes on (a test,
a notebook) leaves no global switch behind. The other half of the switch is in the configuration: plans then come
from the base cost model (:mod:`dynabatch.training.config.resolve`), so the micro-batches do not follow measured times.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

_ENV = ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "ASCEND_LAUNCH_BLOCKING", "HCCL_DETERMINISTIC",
        "FLASH_ATTENTION_DETERMINISTIC")
"""The environment variables ``enable_full_determinism`` sets."""


@contextlib.contextmanager
def full_determinism(enabled: bool, seed: int) -> Iterator[None]:
    """Within the block, torch runs deterministically (``enabled``; else nothing changes)."""
    if not enabled:
        yield
        return
    from transformers.trainer_utils import enable_full_determinism

    env = {name: os.environ.get(name) for name in _ENV}
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    enable_full_determinism(seed)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
