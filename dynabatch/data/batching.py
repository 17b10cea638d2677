"""Global batches by token budget, with length limits and a policy for over-long samples.

A global batch is the set of samples of one optimizer step. It is formed by a *token budget*
(inputs + targets, default :data:`DEFAULT_GLOBAL_BATCH_TOKENS`), not a sample count: samples are drawn
from the mixture sampler and added while the batch stays within the budget; the first sample that does not fit opens the
next batch. The batcher's position (sampler state + that held-over sample) is its ``state_dict``,
so batches resume exactly at any step.

Length limits: encoder-decoder samples have separate input and target limits; decoder-only
samples have one limit on inputs + targets. An over-long sample is truncated (default; counted),
dropped (counted; a batcher whose every drawable sample is over-long refuses to start instead of
looping forever) or raises an error naming it (policy ``error``). Truncation keeps the start of
the text and the final EOS; for decoder-only samples the targets keep at least half the limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dynabatch.data.mixture import require_keys
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.sample import BatchRows, GlobalBatch, TokenizedSample
from dynabatch.core.sequence import is_seq2seq, sequence_kind

OVERLONG_POLICIES = ("truncate", "drop", "error")
DEFAULT_GLOBAL_BATCH_TOKENS = 8192
"""The one default global batch size in real tokens (``train``, ``bench``, ``data-report``, :class:`GlobalBatcher`);
``plan`` and ``simulate`` default to the papers' scale instead (``dynabatch.commands.common.PAPER_SCALE``)."""


MIN_LENGTH_LIMIT = 2
"""The smallest length limit every command and :class:`LengthLimits` accept (``--max-input-len``,
``--max-target-len``, ``data-report --max-lens``): a sample keeps its EOS and one token. Sample lengths in a lengths
file are another thing (a 1-token target is a sample; see ``dynabatch.training.workload.load_lengths``)."""


def check_length_limit_value(name: str, value: int) -> None:
    """One ``ValueError`` line when the length limit ``value``, given as ``name`` (a flag such as
    ``--max-input-len``, or a field), is below :data:`MIN_LENGTH_LIMIT`: the one rule, the one message."""
    if value < MIN_LENGTH_LIMIT:
        raise ValueError(f"{name} must be >= {MIN_LENGTH_LIMIT} (a sample keeps its EOS and one token), got {value}")


class OverlongSampleError(ValueError):
    """A sample exceeds the length limits under policy ``error``."""


@dataclass(frozen=True)
class LengthLimits:
    """Per-sample length limits in tokens (EOS included)."""

    family: str
    """Sequence kind: ``seq2seq`` (separate encoder/decoder limits) or ``causal`` (one limit on inputs +
    targets); the legacy names ``t5``/``gpt2`` are accepted and stored as the kind."""
    max_input_len: int = 1024
    """T5: encoder tokens."""
    max_target_len: int = 256
    """T5: decoder tokens."""
    max_seq_len: int = 1024
    """GPT-2: inputs + targets."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", sequence_kind(self.family))
        for name in ("max_input_len", "max_target_len", "max_seq_len"):
            check_length_limit_value(name, getattr(self, name))

    @property
    def max_tokens(self) -> int:
        """Most tokens a single sample can have after truncation."""
        return self.max_input_len + self.max_target_len if is_seq2seq(self.family) else self.max_seq_len

    def is_overlong(self, input_len: int, target_len: int) -> bool:
        return bool(self.overlong_mask(input_len, target_len))

    def overlong_mask(self, input_lens, target_lens):
        """Elementwise :meth:`is_overlong` of length arrays (or scalars)."""
        if is_seq2seq(self.family):
            return np.greater(input_lens, self.max_input_len) | np.greater(target_lens, self.max_target_len)
        return np.greater(np.add(input_lens, target_lens), self.max_seq_len)

    def truncated_lengths(self, input_len: int, target_len: int) -> tuple[int, int]:
        """Lengths after truncation (unchanged when within the limits)."""
        if is_seq2seq(self.family):
            return min(input_len, self.max_input_len), min(target_len, self.max_target_len)
        limit = self.max_seq_len
        keep_target = min(target_len, max(limit - input_len, limit // 2))
        return min(input_len, limit - keep_target), keep_target

    def describe(self) -> str:
        if is_seq2seq(self.family):
            return f"max_input_len={self.max_input_len}, max_target_len={self.max_target_len}"
        return f"max_seq_len={self.max_seq_len}"


def check_token_budget(budget: int, limits: LengthLimits, name: str = "token_budget") -> None:
    """One ``ValueError`` line when a global batch of ``budget`` tokens cannot hold one maximal sample of ``limits``
    (``name``: the argument or flag that gave it, e.g. ``--global-batch-tokens``). Never raised silently: a
    command refuses such a budget rather than use another."""
    if budget < limits.max_tokens:
        raise ValueError(f"{name} {budget} cannot hold one maximal sample ({limits.describe()}, {limits.max_tokens} "
                         f"tokens); raise it to at least {limits.max_tokens} or lower the length limits")


def replica_budget_problem(budget: int, replicas: int, limits: LengthLimits,
                           name: str = "--global-batch-tokens") -> str | None:
    """The one line when a global batch of ``budget`` tokens holds less than one maximal sample of ``limits`` per
    replica (a batch of long samples would leave a replica without one: a global batch holds at least
    ``budget // max_tokens`` samples); ``None`` when it holds enough, or with one replica."""
    if replicas <= 1 or budget >= replicas * limits.max_tokens:
        return None
    return (f"{name} {budget} holds less than one maximal sample ({limits.describe()}, {limits.max_tokens} tokens) "
            f"per replica ({replicas}): a batch of long samples would leave a replica without one; raise it to at "
            f"least {replicas * limits.max_tokens} or lower the length limits")


def _cut(ids: np.ndarray, n: int, eos: int) -> np.ndarray:
    """First ``n`` tokens, keeping a final EOS if the sequence had one."""
    if len(ids) <= n:
        return ids
    if n > 0 and len(ids) and ids[-1] == eos:
        return np.concatenate([ids[: n - 1], ids[-1:]])
    return ids[:n]


def truncate_sample(sample: TokenizedSample, limits: LengthLimits, eos: int) -> TokenizedSample:
    n_in, n_tg = limits.truncated_lengths(sample.input_len, sample.target_len)
    return replace(sample, input_ids=_cut(sample.input_ids, n_in, eos), target_ids=_cut(sample.target_ids, n_tg, eos))


@dataclass
class GlobalBatcher:
    """Endless, resumable stream of :class:`GlobalBatch` by token budget."""

    data: MixtureData
    limits: LengthLimits
    token_budget: int = DEFAULT_GLOBAL_BATCH_TOKENS
    """Real tokens (inputs + targets) per global batch."""
    overlong: str = "truncate"
    """``truncate`` | ``drop`` | ``error``."""
    _sampler: Any = field(init=False, repr=False)
    _pending: tuple[int, int] | None = field(init=False, default=None, repr=False)
    step: int = field(init=False, default=0)
    num_truncated: int = field(init=False, default=0)
    """Samples truncated so far."""
    num_dropped: int = field(init=False, default=0)
    """Samples dropped so far (policy ``drop``; kept in :meth:`state_dict`)."""
    _fingerprint: list | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {self.overlong!r}")
        if self.limits.family != self.data.family:
            raise ValueError(f"length limits are for {self.limits.family!r} but the data is tokenized for {self.data.family!r}")
        check_token_budget(self.token_budget, self.limits)
        if self.overlong == "drop":
            self._check_something_fits()
        self._sampler = self.data.sampler()

    def _prepare(self, source: int, row: int) -> TokenizedSample | None:
        """The sample ready for a batch, or ``None`` if the policy drops it."""
        sample = self.data.sample(source, row)
        if not self.limits.is_overlong(sample.input_len, sample.target_len):
            return sample
        if self.overlong == "error":
            raise OverlongSampleError(
                f"{self.data.sources[source].describe_row(row)} has {sample.input_len} input and "
                f"{sample.target_len} target tokens, over the limits ({self.limits.describe()}); "
                "raise the limits, or use --overlong truncate or drop (overlong='truncate' or 'drop' in Python)"
            )
        if self.overlong == "drop":
            return None
        return truncate_sample(sample, self.limits, self.data.tokens.eos_id)

    def _check_something_fits(self) -> None:
        """``ValueError`` when no sample the sampler can draw is within the limits (``drop`` would loop forever).

        Exact, from the length columns of the sources with a positive rate (vectorised: milliseconds for
        millions of rows), so a mixture where most but not all samples are over-long is never refused.
        """
        drawable = [(src, rate) for src, rate in zip(self.data.sources, self.data.rates) if rate > 0]
        usable = sum(int((~self.limits.overlong_mask(s.input_ids.lengths, s.target_ids.lengths)).sum()) for s, _ in drawable)
        if usable == 0:
            total = sum(len(s) for s, _ in drawable)
            min_in = min(int(s.input_ids.lengths.min()) for s, _ in drawable)
            min_tg = min(int(s.target_ids.lengths.min()) for s, _ in drawable)
            raise ValueError(
                f"every one of the {total} samples the mixture can draw is over the length limits "
                f"({self.limits.describe()}; the shortest input has {min_in} tokens, the shortest target {min_tg}, "
                "EOS included), so --overlong drop would drop them all; raise the limits or use --overlong truncate (overlong='truncate' in Python)"
            )

    def next_batch(self) -> GlobalBatch:
        samples: list[TokenizedSample] = []
        total = truncated = dropped = 0
        while True:
            source, row = self._pending if self._pending is not None else self._sampler.draw()
            self._pending = None
            sample = self._prepare(source, row)
            if sample is None:
                dropped += 1
                continue
            if samples and total + sample.num_tokens > self.token_budget:
                self._pending = (source, row)
                break
            samples.append(sample)
            total += sample.num_tokens
            truncated += sample.input_len + sample.target_len < self._raw_num_tokens(source, row)
        batch = GlobalBatch(step=self.step, samples=tuple(samples), num_truncated=truncated, num_dropped=dropped)
        self.step += 1
        self.num_truncated += truncated
        self.num_dropped += dropped
        return batch

    def resolve(self, rows: BatchRows) -> GlobalBatch:
        """The batch :meth:`next_batch` made, rebuilt from its :meth:`~dynabatch.data.sample.GlobalBatch.rows` on this
        batcher's data (its limits and over-long policy cut each sample as drawing it did); the position stays."""
        samples = tuple(self._prepare(int(source), int(row)) for source, row in rows.ids)
        if any(s is None for s in samples):
            raise ValueError(f"batch {rows.step} names a row this batcher drops; it was drawn from other data")
        return GlobalBatch(step=rows.step, samples=samples, num_truncated=rows.num_truncated,
                           num_dropped=rows.num_dropped)

    def _raw_num_tokens(self, source: int, row: int) -> int:
        src = self.data.sources[source]
        return int(src.input_ids.offsets[row + 1] - src.input_ids.offsets[row]) + int(
            src.target_ids.offsets[row + 1] - src.target_ids.offsets[row]
        )

    def __iter__(self) -> Iterator[GlobalBatch]:
        while True:
            yield self.next_batch()

    def data_fingerprint(self) -> list[list]:
        """Per source ``[name, rows, tokens]`` (inputs and targets as tokenized, before any truncation): a position
        saved by :meth:`state_dict` is only a position in these same rows. Computed once (the planner saves the
        position every step)."""
        if self._fingerprint is None:
            self._fingerprint = [[s.name, len(s), int(s.input_ids.lengths.sum()) + int(s.target_ids.lengths.sum())]
                                 for s in self.data.sources]
        return [list(x) for x in self._fingerprint]

    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self._sampler.state_dict(),
            "pending": list(self._pending) if self._pending is not None else None,
            "step": self.step,
            "num_truncated": self.num_truncated,
            "num_dropped": self.num_dropped,
            "data": self.data_fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the position of a :meth:`state_dict` (of a batcher or loader over the same mixture).
        ``ValueError`` when the state was saved over other data (another row or token count in a source; states
        saved before the count was recorded are not checked)."""
        require_keys("batcher state", state, ("sampler", "pending", "step", "num_truncated", "num_dropped"),
                     "a GlobalBatcher or DynaBatchDataLoader")
        saved, now = state.get("data"), self.data_fingerprint()
        if saved is not None and [list(x) for x in saved] != now:
            changed = next(((a, b) for a, b in zip(saved, now) if list(a) != b), None)
            what = f"{len(saved)} sources then, {len(now)} now"
            if changed is not None:
                (old_name, *old), (name, *new) = changed
                then = f"{old[0]} rows of {old[1]} tokens"
                what = (f"source {name!r} had {then} then, {new[0]} rows of {new[1]} tokens now" if old_name == name
                        else f"source {old_name!r} ({then}) then, {name!r} ({new[0]} rows of {new[1]} tokens) now")
            raise ValueError(f"the data changed since this position was saved ({what}); resume on the same data "
                             "files, or start a new run in another output folder")
        self._sampler.load_state_dict(state["sampler"])
        self._pending = tuple(state["pending"]) if state["pending"] is not None else None
        self.step = int(state["step"])
        self.num_truncated = int(state["num_truncated"])
        self.num_dropped = int(state["num_dropped"])


def evaluation_rows(data: MixtureData, per_task: int | None = None, seed: int = 0) -> list[tuple[int, int]]:
    """``(source, row)`` of every row of ``data`` once (``per_task``: at most that many rows of every task), each
    source's rows in the order of a permutation seeded with ``(seed, source index)``: deterministic, and a cap
    is not biased by the order of the files. What an evaluation covers (``dynabatch train --eval-samples`` and
    :class:`EveryRowBatcher`)."""
    if per_task is not None and per_task < 1:
        raise ValueError(f"per_task (eval samples) must be >= 1 or None (every row), got {per_task}")
    out: list[tuple[int, int]] = []
    taken: dict[str, int] = {}
    for k, source in enumerate(data.sources):
        for row in np.random.default_rng([seed, k]).permutation(len(source)):
            task = source.tasks[row]
            if per_task is None or taken.get(task, 0) < per_task:
                taken[task] = taken.get(task, 0) + 1
                out.append((k, int(row)))
    return out


@dataclass
class EveryRowBatcher:
    """Finite global batches that hold every row of ``data`` exactly once (:func:`evaluation_rows`; rows per
    task capped at ``per_task``), truncated to ``limits``, each at most ``token_budget`` real tokens: the
    evaluation counterpart of :class:`GlobalBatcher`'s endless mixture stream (which draws rows by rate and
    repeats them). :meth:`next_batch` goes round: after the last batch comes the first again."""

    data: MixtureData
    limits: LengthLimits
    token_budget: int = DEFAULT_GLOBAL_BATCH_TOKENS
    per_task: int | None = None
    """Rows per task at most (the same rows every pass); ``None``: every row."""
    seed: int = 0
    """Orders the rows (and picks them under ``per_task``); default: the mixture's seed."""
    min_samples: int = 1
    """Samples every global batch holds at least (a loader's data-parallel replicas, each of which needs one): a
    shorter last batch takes the last rows of the batch before it (still within ``token_budget`` when the budget
    holds ``min_samples`` maximal samples); fewer rows in all is a ``ValueError``."""
    batches: list[GlobalBatch] = field(init=False, repr=False)
    step: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.limits.family != self.data.family:
            raise ValueError(f"length limits are for {self.limits.family!r} but the data is tokenized for "
                             f"{self.data.family!r}")
        check_token_budget(self.token_budget, self.limits)
        eos = self.data.tokens.eos_id
        groups: list[list[tuple[TokenizedSample, bool]]] = [[]]  # per batch: (sample, whether it was truncated)
        total = 0
        for source, row in evaluation_rows(self.data, self.per_task, self.seed):
            raw = self.data.sample(source, row)
            sample = truncate_sample(raw, self.limits, eos)
            if groups[-1] and total + sample.num_tokens > self.token_budget:
                groups.append([])
                total = 0
            groups[-1].append((sample, sample.num_tokens < raw.num_tokens))
            total += sample.num_tokens
        num_rows = sum(len(g) for g in groups)
        if num_rows < self.min_samples:
            raise ValueError(f"the evaluation data has {num_rows} rows, fewer than the {self.min_samples} data-parallel "
                             "replicas that each need one; add rows, or evaluate on fewer replicas")
        while len(groups) > 1 and len(groups[-1]) < self.min_samples:  # the last batch: one row per replica
            groups[-1].insert(0, groups[-2].pop())
            if not groups[-2]:
                del groups[-2]
        self.batches = [GlobalBatch(k, tuple(s for s, _ in g), num_truncated=sum(cut for _, cut in g))
                        for k, g in enumerate(g for g in groups if g)]

    @property
    def num_rows(self) -> int:
        return sum(len(b) for b in self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    def next_batch(self) -> GlobalBatch:
        batch = self.batches[self.step % len(self.batches)]
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        require_keys("batcher state", state, ("step",), "an EveryRowBatcher")
        self.step = int(state["step"])
