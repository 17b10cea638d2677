"""From a mixture spec to tokenized samples you can index in O(1).

``MixtureData.load(spec, tokenizer, family)`` loads and validates every source, tokenizes it
(cached ``datasets.map``), computes the mixing rates and keeps each source's token columns as
flat Arrow-backed numpy arrays with offsets, so fetching a sample costs two slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynabatch.data.mixture import MixtureSampler, MixtureSpec, mixture_rates
from dynabatch.data.sample import TokenizedSample
from dynabatch.data.sources import load_source
from dynabatch.data.tokenize import TokenizerInfo, tokenize_dataset, tokenizer_info
from dynabatch.sequence import sequence_kind


@dataclass(frozen=True)
class TokenColumn:
    """A list-of-ints Arrow column as flat values + offsets."""

    values: np.ndarray
    offsets: np.ndarray

    @staticmethod
    def from_dataset(ds, name: str) -> "TokenColumn":
        col = ds.data.column(name).combine_chunks()
        offsets = np.asarray(col.offsets, dtype=np.int64)
        values = np.asarray(col.values, dtype=np.int32)
        return TokenColumn(values=values, offsets=offsets)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass(frozen=True)
class TokenizedSource:
    """One tokenized source of a mixture."""

    name: str
    tasks: list[str]
    input_ids: TokenColumn
    target_ids: TokenColumn
    num_skipped: int = 0
    """Malformed rows dropped under ``bad_rows: skip``."""

    def __len__(self) -> int:
        return len(self.tasks)

    def sample(self, source_index: int, row_index: int) -> TokenizedSample:
        return TokenizedSample(
            task=self.tasks[row_index],
            input_ids=self.input_ids[row_index],
            target_ids=self.target_ids[row_index],
            source_index=source_index,
            row_index=row_index,
        )


@dataclass(frozen=True)
class MixtureData:
    """Every source of a mixture, tokenized, with its rates."""

    spec: MixtureSpec
    family: str
    sources: tuple[TokenizedSource, ...]
    rates: np.ndarray
    tokens: TokenizerInfo

    @staticmethod
    def load(spec: MixtureSpec, tokenizer, family: str, bad_rows: str = "error", num_proc: int | None = None) -> "MixtureData":
        sources = []
        for s in spec.sources:
            ds, skipped = load_source(s, bad_rows=bad_rows)
            ds = tokenize_dataset(ds, tokenizer, family, num_proc=num_proc, desc=f"tokenize {s.task}")
            sources.append(
                TokenizedSource(
                    name=s.task,
                    tasks=ds.data.column("task").to_pylist(),
                    input_ids=TokenColumn.from_dataset(ds, "input_ids"),
                    target_ids=TokenColumn.from_dataset(ds, "target_ids"),
                    num_skipped=skipped,
                )
            )
        rates = mixture_rates(spec, [len(s) for s in sources])
        return MixtureData(spec=spec, family=sequence_kind(family), sources=tuple(sources), rates=rates, tokens=tokenizer_info(tokenizer))

    def sampler(self) -> MixtureSampler:
        return MixtureSampler(rates=self.rates, num_examples=[len(s) for s in self.sources], seed=self.spec.seed)

    def sample(self, source_index: int, row_index: int) -> TokenizedSample:
        return self.sources[source_index].sample(source_index, row_index)
