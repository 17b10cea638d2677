"""The global batches a ``dynabatch bench`` run measures, and its methods' planned steps.

:func:`load_batches` reads ``--data`` (with ``--columns``) as ``dynabatch train`` reads it, the built-in mixture, or
a ``--lengths`` file (random token ids of each sample's exact lengths), so every method runs on the same global
batches. :class:`LazyPlans` plans a calibrated method's steps one at a time, as the measurements they need arrive.
"""

from __future__ import annotations

import numpy as np

from dynabatch.data.batching import GlobalBatcher
from dynabatch.data.builtin import default_mixture_path
from dynabatch.data.inputs import load_data
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.data.tokenize import load_tokenizer, resolve_tokenizer
from dynabatch.training.workload import global_batches, is_mixture_spec


class LazyPlans:
    """A calibrated method's planned steps, planned on first access in step order (the online fit a step is
    planned with needs the measurements of the steps before it); indexable and iterable like a list."""

    def __init__(self, planner, num_steps: int) -> None:
        self.planner, self.num_steps, self._plans = planner, num_steps, []

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self.num_steps))]
        while len(self._plans) <= k:
            self._plans.append(self.planner())
        return self._plans[k]

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self):
        return (self[i] for i in range(self.num_steps))


def load_batches(args, family: str, limits, info, num_batches: int) -> list:
    """``num_batches`` global batches of the workload (``--data`` with ``--columns``, read as ``train`` reads it,
    or ``--lengths``); lengths files get random ids of their exact lengths."""

    tokenizer = resolve_tokenizer(args.tokenizer, args.model)
    if args.data is not None:
        return _data_batches(args, family, limits, tokenizer, num_batches)
    path = args.lengths or default_mixture_path()
    batches = global_batches(path, family, limits, args.global_batch_tokens, num_batches, tokenizer=tokenizer)
    if not batches:
        raise ValueError(f"{path}: no global batch could be formed")
    if is_mixture_spec(path):
        return batches
    rng = np.random.default_rng(args.seed)
    special = max(info.pad_id, info.eos_id, info.decoder_start_id) + 1
    low = min(special, info.vocab_size - 1)

    def ids(n: int) -> np.ndarray:
        return rng.integers(low, info.vocab_size, size=n, dtype=np.int64).astype(np.int32)

    out = []
    for b in batches:
        samples = tuple(TokenizedSample(s.task, ids(s.input_len), ids(s.target_len), s.source_index, s.row_index)
                        for s in b.samples)
        out.append(GlobalBatch(step=b.step, samples=samples, num_truncated=b.num_truncated))
    return out


def _data_batches(args, family: str, limits, tokenizer: str, num_batches: int) -> list:
    """The first ``num_batches`` global batches of ``--data`` (:func:`~dynabatch.data.inputs.load_data`, as
    ``dynabatch train`` reads it: the same columns, task column and row order)."""

    data = load_data(load_tokenizer(tokenizer), family, data=args.data, columns=args.columns, seed=args.seed)
    batcher = GlobalBatcher(data, limits, token_budget=args.global_batch_tokens)
    return [batcher.next_batch() for _ in range(num_batches)]
