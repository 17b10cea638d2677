"""From a mixture spec to tokenized samples you can index in O(1).

``MixtureData.load(spec, tokenizer, family)`` loads and validates every source, tokenizes it
(cached ``datasets.map``), computes the mixing rates and keeps each source's token columns as
flat Arrow-backed numpy arrays with offsets, so fetching a sample costs two slices.
``MixtureData.from_datasets({"task": ds, ...}, tokenizer, family)`` does the same for ``datasets.Dataset`` /
``IterableDataset`` objects in memory (a stream is read up to a row limit: see :meth:`MixtureData.from_datasets`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynabatch.data.mixture import MixtureSampler, MixtureSpec, mixture_rates
from dynabatch.data.sample import GlobalBatch, TokenizedSample
from dynabatch.data.source_spec import SourceSpec
from dynabatch.data.sources import NormalisedSource, load_normalised
from dynabatch.data.tokenize import TokenizerInfo, tokenize_dataset, tokenizer_info
from dynabatch.core.sequence import sequence_kind


DEFAULT_STREAM_ROWS = 100_000
"""Rows of a streaming ``IterableDataset`` read into memory by :meth:`MixtureData.from_datasets` by default."""


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
    casts: dict[str, int] = field(default_factory=dict)
    """Field -> numbers / bools cast to text in this source's kept rows (only fields with casts)."""

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
        return MixtureData._build(spec, tokenizer, family, bad_rows, num_proc, {})

    @staticmethod
    def from_datasets(
        datasets: Mapping[str, Any] | Any,
        tokenizer,
        family: str,
        *,
        columns: Mapping[str, str] | None = None,
        rates: Mapping[str, float] | None = None,
        cap: int | None = None,
        seed: int = 0,
        bad_rows: str = "error",
        max_examples: int | None = None,
        max_stream_rows: int = DEFAULT_STREAM_ROWS,
        name: str = "datasets",
    ) -> "MixtureData":
        """A mixture of in-memory ``datasets.Dataset`` / ``IterableDataset`` objects, one source per task name.

        ``datasets``: ``{"task": dataset, ...}``, or one dataset (task ``train``; a ``task`` column, or the column
        ``columns["task"]`` names, labels rows within a source either way); a ``DatasetDict`` (splits, not tasks) is a
        ``ValueError``. ``columns`` maps ``inputs`` /
        ``targets`` / ``task`` to column names for every source; numbers and bools are cast to text (counted in
        :attr:`TokenizedSource.casts`). ``rates``: fixed mixing weights per task (all or none); default the
        examples-proportional rule with ``cap``. Streaming: the batcher draws rows by task rate and by index, so an
        ``IterableDataset`` is read into memory up to ``max_stream_rows`` rows (``max_examples`` when given; a
        warning says when the stream had more). The data position (the row cursors of
        :class:`~dynabatch.data.mixture.MixtureSampler`) then resumes exactly, since the stream yields the same rows
        again. ``max_examples`` also caps every in-memory ``Dataset``.
        """
        import datasets as hf_datasets

        if isinstance(datasets, (hf_datasets.Dataset, hf_datasets.IterableDataset)):
            datasets = {"train": datasets}
        if isinstance(datasets, (hf_datasets.DatasetDict, hf_datasets.IterableDatasetDict)):
            # its keys are splits: taken as tasks, a test split would be trained on beside train
            split = "train" if "train" in datasets else sorted(datasets)[0]
            raise ValueError(f"the data is a {type(datasets).__name__} of the splits {sorted(datasets)}, each of which "
                             f"would be trained on as a task; pass one split (dataset[{split!r}]), or dict(dataset) to "
                             "train on every split as a task")
        if not isinstance(datasets, Mapping) or not datasets:
            raise ValueError(f"datasets must be a Dataset, an IterableDataset or a non-empty mapping of task names to "
                             f"them, got {type(datasets).__name__}")
        if rates is not None and set(rates) != set(datasets):
            raise ValueError(f"rates must name every task of the datasets ({sorted(datasets)}), got {sorted(rates)}")
        def row_limit(ds) -> int | None:
            return max_examples if max_examples is not None or isinstance(ds, hf_datasets.Dataset) else max_stream_rows

        sources = tuple(
            SourceSpec(task=task, in_memory=True, columns=dict(columns or {}), max_examples=row_limit(ds),
                       rate=None if rates is None else rates[task])
            for task, ds in datasets.items()
        )
        spec = MixtureSpec(sources=sources, rule="fixed" if rates is not None else "examples_proportional", cap=cap,
                           seed=seed, name=name, bad_rows=bad_rows)
        return MixtureData._build(spec, tokenizer, family, None, None, dict(datasets))

    @staticmethod
    def _build(spec: MixtureSpec, tokenizer, family: str, bad_rows: str | None, num_proc: int | None,
               in_memory: dict[str, Any]) -> "MixtureData":
        """Load (``in_memory``: the rows of in-memory sources by task), normalise and tokenize every source."""
        sources = []
        for s in spec.sources:
            normalised = load_normalised(s, bad_rows=bad_rows or s.bad_rows or spec.bad_rows,
                                         dataset=in_memory.get(s.task) if s.in_memory else None)
            sources.append(_tokenized_source(s.task, normalised, tokenizer, family, num_proc))
        rates = mixture_rates(spec, [len(s) for s in sources])
        return MixtureData(spec=spec, family=sequence_kind(family), sources=tuple(sources), rates=rates, tokens=tokenizer_info(tokenizer))

    def sampler(self) -> MixtureSampler:
        return MixtureSampler(rates=self.rates, num_examples=[len(s) for s in self.sources], seed=self.spec.seed)

    def sample(self, source_index: int, row_index: int) -> TokenizedSample:
        return self.sources[source_index].sample(source_index, row_index)


def _tokenized_source(name: str, normalised: NormalisedSource, tokenizer, family: str,
                      num_proc: int | None) -> TokenizedSource:
    ds = tokenize_dataset(normalised.dataset, tokenizer, family, num_proc=num_proc, desc=f"tokenize {name}")
    rows = ds.data.column("source_row").to_numpy() if "source_row" in ds.column_names else None
    return TokenizedSource(
        name=name,
        tasks=ds.data.column("task").to_pylist(),
        input_ids=TokenColumn.from_dataset(ds, "input_ids"),
        target_ids=TokenColumn.from_dataset(ds, "target_ids"),
        num_skipped=normalised.num_skipped,
        source_rows=rows,
        casts=normalised.casts,
    )


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
