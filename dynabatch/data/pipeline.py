"""From a mixture spec to tokenized samples you can index in O(1).

``MixtureData.load(spec, tokenizer, family)`` loads and validates every source, tokenizes it
(cached ``datasets.map``), computes the mixing rates and keeps each source's token columns as
flat Arrow-backed numpy arrays with offsets, so fetching a sample costs two slices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from dynabatch.data.mixture import MixtureSampler, MixtureSpec, mixture_rates
from dynabatch.data.sample import GlobalBatch, TokenizedSample
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
    source_rows: np.ndarray | None = None
    """Row in the source's files of each kept row (``None``: the same index, nothing was skipped)."""

    def __len__(self) -> int:
        return len(self.tasks)

    def source_row(self, row_index: int) -> int:
        """The row of the source's files that row ``row_index`` of this tokenized source came from."""
        return int(self.source_rows[row_index]) if self.source_rows is not None else row_index

    def describe_row(self, row_index: int) -> str:
        """``row R of source 'S'``, for error messages (``R`` counts rows of the source's files from 0)."""
        return f"row {self.source_row(row_index)} of source {self.name!r}"

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
    def load(
        spec: MixtureSpec, tokenizer, family: str, bad_rows: str | None = None, num_proc: int | None = None
    ) -> "MixtureData":
        """Load, validate and tokenize every source of ``spec``.

        ``bad_rows`` (``error`` | ``skip``) overrides the spec for every source (e.g. ``--bad-rows``);
        ``None`` uses each source's ``bad_rows``, else the mixture's (default ``error``).
        """
        sources = []
        for s in spec.sources:
            ds, skipped = load_source(s, bad_rows=bad_rows or s.bad_rows or spec.bad_rows)
            ds = tokenize_dataset(ds, tokenizer, family, num_proc=num_proc, desc=f"tokenize {s.task}")
            rows = ds.data.column("source_row").to_numpy() if "source_row" in ds.column_names else None
            sources.append(
                TokenizedSource(
                    name=s.task,
                    tasks=ds.data.column("task").to_pylist(),
                    input_ids=TokenColumn.from_dataset(ds, "input_ids"),
                    target_ids=TokenColumn.from_dataset(ds, "target_ids"),
                    num_skipped=skipped,
                    source_rows=rows,
                )
            )
        rates = mixture_rates(spec, [len(s) for s in sources])
        return MixtureData(spec=spec, family=sequence_kind(family), sources=tuple(sources), rates=rates, tokens=tokenizer_info(tokenizer))

    def sampler(self) -> MixtureSampler:
        return MixtureSampler(rates=self.rates, num_examples=[len(s) for s in self.sources], seed=self.spec.seed)

    def sample(self, source_index: int, row_index: int) -> TokenizedSample:
        return self.sources[source_index].sample(source_index, row_index)


def locate_sample_error(err: ValueError, batch: GlobalBatch, data: MixtureData | None = None) -> ValueError:
    """A planner error about ``sample K`` (a position in ``batch``), reworded to name the batch and the row.

    The planner only sees lengths, so it says ``sample K (input_len=..)``; this returns
    ``sample K of global batch B, row R of source 'S' (input_len=..)`` (the row only with ``data``),
    or ``err`` itself when it names no sample of the batch.
    """
    text = str(err)
    match = re.match(r"sample (\d+)\b", text)
    if match is None or int(match.group(1)) >= len(batch):
        return err
    k = int(match.group(1))
    sample = batch.samples[k]
    row = ""
    if data is not None and 0 <= sample.source_index < len(data.sources):
        row = ", " + data.sources[sample.source_index].describe_row(sample.row_index)
    return ValueError(f"sample {k} of global batch {batch.step}{row}{text[match.end():]}")
