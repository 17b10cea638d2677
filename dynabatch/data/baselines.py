"""The batching methods users pick today, each cutting a global batch into micro-batches.

Every batcher first *groups* sample indices into rows and micro-batches using lengths only
(:meth:`Batcher.group`, cheap and tensor-free, used for statistics and by later planners), then
collates the groups into model-ready tensors (:meth:`Batcher.__call__`).

- ``padding``: fixed samples per micro-batch in stream order, padded to the micro-batch max.
- ``length_grouped``: like HF ``group_by_length``: sort the global batch by length, then chunk.
- ``token_budget``: like fairseq ``max_tokens``: sorted, each micro-batch holds as many samples as
  fit ``max_tokens`` *padded* tokens.
- ``packing``: fixed-length rows filled best-fit-decreasing, several samples per row with
  positions restarting and attention confined to each sample. GPT: one row length for
  inputs + targets. T5 (seqio-style): inputs pack into encoder rows and targets into decoder rows
  of the same row, a sample fits a row only if both fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynabatch.data.batching import LengthLimits
from dynabatch.data.collate import collate_causal, collate_seq2seq
from dynabatch.data.microbatch import MicroBatch
from dynabatch.data.sample import GlobalBatch
from dynabatch.data.tokenize import TokenizerInfo
from dynabatch.sequence import is_seq2seq


@dataclass(frozen=True)
class RowGroup:
    """One micro-batch as rows of sample indices, with fixed row lengths (packing) or ``None``."""

    rows: tuple[tuple[int, ...], ...]
    encoder_len: int | None = None
    """Fixed encoder row length (T5) or sequence row length (GPT); ``None`` pads to the longest row."""
    decoder_len: int | None = None
    """Fixed decoder row length (T5 only)."""


@dataclass(frozen=True)
class BatchStats:
    """Token accounting of one batching of a global batch."""

    num_micro_batches: int
    real_tokens: int
    computed_tokens: int
    """Tokens the model computes on, padding included."""

    @property
    def efficiency(self) -> float:
        """Padding efficiency: real / computed tokens."""
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0


@dataclass(frozen=True)
class Batcher:
    """Base class: subclasses implement :meth:`group`."""

    limits: LengthLimits
    tokens: TokenizerInfo
    loss_on_inputs: bool = False
    """Decoder-only: also take loss on input tokens."""

    @property
    def family(self) -> str:
        return self.limits.family

    def group(self, batch: GlobalBatch) -> list[RowGroup]:
        raise NotImplementedError

    def __call__(self, batch: GlobalBatch) -> list[MicroBatch]:
        return [self.collate(batch, g) for g in self.group(batch)]

    def collate(self, batch: GlobalBatch, g: RowGroup) -> MicroBatch:
        if is_seq2seq(self.family):
            return collate_seq2seq(
                batch.samples, g.rows, self.tokens.pad_id, self.tokens.decoder_start_id, g.encoder_len, g.decoder_len
            )
        return collate_causal(batch.samples, g.rows, self.tokens.pad_id, g.encoder_len, self.loss_on_inputs)

    def stats(self, batch: GlobalBatch) -> BatchStats:
        """Real and computed tokens of this batching, from lengths alone."""
        groups = self.group(batch)
        computed = 0
        for g in groups:
            rows, e, d = group_shape(batch, g, self.family)
            computed += rows * (e + d)
        return BatchStats(num_micro_batches=len(groups), real_tokens=batch.num_tokens, computed_tokens=computed)

    def _sort_key(self, batch: GlobalBatch):
        """Longest first: by total length (GPT) or by (input, target) length (T5); ties by index."""
        if is_seq2seq(self.family):
            return lambda i: (-batch.input_lens[i], -batch.target_lens[i], i)
        return lambda i: (-(batch.input_lens[i] + batch.target_lens[i]), i)


def group_shape(batch: GlobalBatch, g: RowGroup, family: str) -> tuple[int, int, int]:
    """Computed shape ``(rows, E, D)`` of a row group (GPT: ``E`` = row length, ``D`` = 0)."""
    e, d = batch.input_lens, batch.target_lens
    if is_seq2seq(family):
        enc = g.encoder_len or max(int(sum(e[i] for i in r)) for r in g.rows)
        dec = g.decoder_len or max(int(sum(d[i] for i in r)) for r in g.rows)
        return len(g.rows), int(enc), int(dec)
    seq = g.encoder_len or max(int(sum(e[i] + d[i] for i in r)) for r in g.rows)
    return len(g.rows), int(seq), 0


def _chunks(indices: list[int], size: int) -> list[RowGroup]:
    return [RowGroup(rows=tuple((i,) for i in indices[k : k + size])) for k in range(0, len(indices), size)]


@dataclass(frozen=True)
class Padding(Batcher):
    samples_per_micro_batch: int = 8

    def group(self, batch: GlobalBatch) -> list[RowGroup]:
        return _chunks(list(range(len(batch))), self.samples_per_micro_batch)


@dataclass(frozen=True)
class LengthGrouped(Batcher):
    samples_per_micro_batch: int = 8

    def group(self, batch: GlobalBatch) -> list[RowGroup]:
        return _chunks(sorted(range(len(batch)), key=self._sort_key(batch)), self.samples_per_micro_batch)


@dataclass(frozen=True)
class TokenBudget(Batcher):
    max_tokens: int = 8192
    """Padded tokens per micro-batch (rows x padded length)."""

    def __post_init__(self) -> None:
        if self.max_tokens < self.limits.max_tokens:
            raise ValueError(
                f"token_budget max_tokens={self.max_tokens} cannot hold one maximal sample "
                f"({self.limits.max_tokens} tokens); raise it"
            )

    def group(self, batch: GlobalBatch) -> list[RowGroup]:
        groups: list[RowGroup] = []
        current: list[int] = []
        max_e = max_d = 0
        for i in sorted(range(len(batch)), key=self._sort_key(batch)):
            e, d = int(batch.input_lens[i]), int(batch.target_lens[i])
            if not is_seq2seq(self.family):  # one sequence: inputs + targets
                e, d = e + d, 0
            new_e, new_d = max(max_e, e), max(max_d, d)
            if current and (len(current) + 1) * (new_e + new_d) > self.max_tokens:
                groups.append(RowGroup(rows=tuple((j,) for j in current)))
                current, new_e, new_d = [], e, d
            current.append(i)
            max_e, max_d = new_e, new_d
        if current:
            groups.append(RowGroup(rows=tuple((j,) for j in current)))
        return groups


@dataclass(frozen=True)
class Packing(Batcher):
    rows_per_micro_batch: int = 4

    def group(self, batch: GlobalBatch) -> list[RowGroup]:
        t5 = is_seq2seq(self.family)
        cap_e = self.limits.max_input_len if t5 else self.limits.max_seq_len
        cap_d = self.limits.max_target_len if t5 else 0
        rows: list[list[int]] = []
        free: list[tuple[int, int]] = []  # remaining (encoder, decoder) capacity per row
        for i in sorted(range(len(batch)), key=self._sort_key(batch)):
            e, d = int(batch.input_lens[i]), int(batch.target_lens[i])
            if not t5:
                e, d = e + d, 0
            best, best_left = -1, None
            for r, (fe, fd) in enumerate(free):
                if e <= fe and d <= fd:
                    left = (fe - e) / cap_e + ((fd - d) / cap_d if t5 else 0.0)
                    if best_left is None or left < best_left:
                        best, best_left = r, left
            if best < 0:
                rows.append([])
                free.append((cap_e, cap_d))
                best = len(rows) - 1
            rows[best].append(i)
            free[best] = (free[best][0] - e, free[best][1] - d)
        n = self.rows_per_micro_batch
        return [
            RowGroup(rows=tuple(tuple(r) for r in rows[k : k + n]), encoder_len=cap_e, decoder_len=cap_d if t5 else None)
            for k in range(0, len(rows), n)
        ]


BATCHERS: dict[str, type[Batcher]] = {
    "padding": Padding,
    "length_grouped": LengthGrouped,
    "token_budget": TokenBudget,
    "packing": Packing,
}


@dataclass(frozen=True)
class BaselineOptions:
    """Micro-batch sizes of the baselines (what a user would tune)."""

    samples_per_micro_batch: int = 8
    """``padding`` and ``length_grouped``."""
    token_budget_tokens: int = 8192
    """``token_budget``: padded tokens per micro-batch (raised to one maximal sample if smaller)."""
    packing_rows: int = 4
    """``packing``: rows per micro-batch."""

    def batcher_options(self, name: str, limits: LengthLimits) -> dict:
        """The fields :func:`make_batcher` takes for baseline ``name``."""
        if name in ("padding", "length_grouped"):
            return {"samples_per_micro_batch": self.samples_per_micro_batch}
        if name == "token_budget":
            return {"max_tokens": max(self.token_budget_tokens, limits.max_tokens)}
        if name == "packing":
            return {"rows_per_micro_batch": self.packing_rows}
        raise ValueError(f"unknown batching method {name!r}; valid: {', '.join(BATCHERS)}")


def make_batcher(name: str, limits: LengthLimits, tokens: TokenizerInfo, **options) -> Batcher:
    """A baseline batcher by name; ``options`` are its fields (e.g. ``samples_per_micro_batch``)."""
    if name not in BATCHERS:
        raise ValueError(f"unknown batching method {name!r}; valid: {', '.join(BATCHERS)}")
    return BATCHERS[name](limits=limits, tokens=tokens, **options)
