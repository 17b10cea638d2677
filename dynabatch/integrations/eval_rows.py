"""Small pieces of :class:`~dynabatch.integrations.trainer.DynaBatchTrainer`'s evaluation loop: the generation
settings, stepping through a loader knowing the last step (``batch_eval_metrics``' ``compute_result``) and the
padded id arrays of ``EvalPrediction``."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def generation_settings(args, module, gen_kwargs: dict) -> tuple[int, int, dict]:
    """``(max_new_tokens, num_beams, other generate keywords)`` of one evaluation, as ``Seq2SeqTrainer`` takes them:
    the call's ``gen_kwargs`` first, then ``args.generation_max_length`` / ``generation_num_beams``, then the model's
    generation config where ``args.generation_config`` made it the model's (its ``do_sample`` too), else 32 tokens,
    greedy. Other ``gen_kwargs`` go to ``model.generate`` as given."""
    config = {}
    if getattr(args, "generation_config", None) is not None:
        config = module.generation_config.to_diff_dict()
    max_new = (gen_kwargs.get("max_new_tokens") or gen_kwargs.get("max_length")
               or getattr(args, "generation_max_length", None)
               or config.get("max_new_tokens") or config.get("max_length") or 32)
    beams = gen_kwargs.get("num_beams") or getattr(args, "generation_num_beams", None) or config.get("num_beams") or 1
    extra = {k: v for k, v in gen_kwargs.items() if k not in ("max_new_tokens", "max_length", "num_beams")}
    if "do_sample" in config:
        extra.setdefault("do_sample", config["do_sample"])
    return int(max_new), int(beams), extra


def with_last(iterable) -> Iterator[tuple]:
    """``(item, is_last)`` for each item of ``iterable``, looking one ahead."""
    it = iter(iterable)
    try:
        item = next(it)
    except StopIteration:
        return
    for following in it:
        yield item, False
        item = following
    yield item, True


def padded(rows: list[list[int]], pad: int) -> np.ndarray:
    """Rows of ids as one (N, longest) int64 array, right-padded with ``pad``."""
    out = np.full((len(rows), max((len(r) for r in rows), default=0)), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out
