"""Dynamic micro-batches for any PyTorch training loop: one :class:`StepBatch` per optimizer step.

:class:`DynaBatchDataLoader` draws token-budget global batches from a mixture
(:class:`~dynabatch.data.batching.GlobalBatcher`; a ``datasets.Dataset`` / ``IterableDataset`` or a mapping of
task names to them is tokenized into one by :meth:`~dynabatch.data.pipeline.MixtureData.from_datasets`), cuts each into variable-size micro-batches and
collates the ones of its data-parallel replica, each padded only to its own longest sample (``packing``:
to its fixed row length; ``packing_free``: to its longest packed row):

* ``dynamic`` (default): :func:`~dynabatch.plan.step.plan_step` with one pipeline stage and
  ``num_replicas`` replicas. The partition DP groups samples of similar length and sizes every
  micro-batch to the memory budget of the cost model, so the number and shapes of micro-batches
  change from step to step. The plan is deterministic, so every rank builds the same loader with its
  own ``replica_index``, plans the whole global batch and keeps its share; no rank talks to another.
* any baseline of :data:`dynabatch.data.baselines.BASELINES` (``padding``, ``length_grouped``,
  ``token_budget``, ``packing``, ``packing_free``): its micro-batches are dealt to replicas as ``dynabatch
  train`` deals them, largest first to the least-loaded replica, each replica keeping the baseline's order
  (:func:`~dynabatch.plan.candidates.deal_to_replicas`; a ``ValueError`` when there are fewer micro-batches
  than replicas).

Both go through the planning path ``train``, ``plan`` and ``simulate`` share
(:class:`~dynabatch.plan.global_plan.GlobalPlanner`), so the loader yields what ``train`` would run for the same
global batch, method and replicas (one pipeline stage).

Evaluation loaders (``each_row_once=True``): every row of the data once per iteration, in finite global batches
(:class:`~dynabatch.data.batching.EveryRowBatcher`), cut and collated like the training steps.

Loss normalisation: micro-batch ``i`` gets the weight ``loss_tokens_i / T`` where ``T`` counts the loss
tokens of the whole global batch over all replicas (from the sample lengths, without collating the
other replicas' tensors). ``sum_i loss_sum_i / T`` over a replica's micro-batches, summed over
replicas (the gradient all-reduce with SUM), is the token-normalised loss of the global batch: every
target token weighs the same, however the batch was cut.

The cost model for ``dynamic`` defaults to the analytic model of the Hugging Face ``model_config``
(:func:`~dynabatch.models.families.analytic_spec`, one stage, the device's memory minus
parameters, gradients and Adam states; ``hardware="auto"``, decided by the resolver's rule
(:mod:`dynabatch.training.config.resolve`), is the CUDA device's preset by its name, ``cpu`` without one; activations priced as the trainer prices its own runs, in ``dtype`` under ``attention``)
or, without a config, to
:class:`~dynabatch.plan.costs.PolynomialCostModel`. Planning a global batch of a few hundred samples
takes ~1-20 ms (numba, warm); collating is numpy + ``torch.from_numpy``.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from types import SimpleNamespace
from typing import Any

from dynabatch.training.config.resolve import Found, decide_why
from dynabatch.core.attention import ATTENTION_PATHS
from dynabatch.core.dtypes import DTYPES
from dynabatch.core.methods import METHODS  # the dynamic planner, then every baseline
from dynabatch.data.baselines import BASELINES, Batcher, RowGroup, batcher_options_given, make_batcher
from dynabatch.data.batching import EveryRowBatcher, GlobalBatcher, LengthLimits, replica_budget_problem
from dynabatch.data.collate import sample_loss_tokens as collate_loss_tokens
from dynabatch.data.microbatch import MicroBatch
from dynabatch.data.pipeline import MixtureData
from dynabatch.data.sample import GlobalBatch
from dynabatch.plan.costs import MicroBatchCostModel, PolynomialCostModel
from dynabatch.plan.global_plan import GlobalPlanner
from dynabatch.cost.hardware import device_hardware, hardware_spec
from dynabatch.cost.stages import StageCostModel
from dynabatch.cost.layer_split import balanced_layout
from dynabatch.data.inputs import load_data
from dynabatch.data.source_spec import BadRowError
from dynabatch.data.tokenize import TokenizerInfo, load_tokenizer, said_diffs, special_id_diffs


def model_sequence_kind(config) -> str:
    """The sequence kind (``causal``/``seq2seq``) of a supported HF config; ``ValueError`` naming the
    supported families otherwise (the family registry, :mod:`dynabatch.models.families`)."""
    from dynabatch.models.families import family_for_config  # lazy: keeps transformers out of the DataLoader import

    return family_for_config(config).sequence_kind


def check_data_fits_model(config, limits: LengthLimits, tokens: TokenizerInfo, name: str) -> None:
    """One ``ValueError`` line, at build time, when data of ``limits`` tokenized with the tokenizer ``tokens``
    describes would fail inside the model of the HF ``config`` mid-run (``name``: the loader's name): a token id past
    the model's embedding, or a sample longer than a learned position table (GPT-2's ``n_positions``); longer than a
    rotary model's trained positions is a warning (:func:`~dynabatch.models.families.check_length_limit`, as
    ``dynabatch train`` checks its flags at start). A special id the config sets to another value than the
    tokenizer's (:func:`~dynabatch.data.tokenize.special_id_diffs`) is a warning too: training pads, ends and starts
    decoding with the tokenizer's ids, while the model's ``generate`` stops at and starts from the config's."""
    from dynabatch.models.families import check_length_limit  # lazy: keeps transformers out of the DataLoader import

    rows = getattr(config, "vocab_size", None)
    if rows is not None and tokens.vocab_size > rows:
        raise ValueError(f"{name}'s data is tokenized with a vocabulary of {tokens.vocab_size} tokens but the "
                         f"{getattr(config, 'model_type', None)!r} model's embedding has {rows} rows; tokenize with "
                         "the model's own tokenizer (load_tokenizer(<model folder>))")
    if limits.family == "causal":
        check_length_limit(config, limits.max_seq_len, what=f"{name}'s LengthLimits max_seq_len")
    if diffs := special_id_diffs(tokens, config):
        sets = ", ".join(f"config.{key} = {ours}" for key, (_, ours) in diffs.items())
        warnings.warn(f"{name}'s data and the {getattr(config, 'model_type', None)!r} model disagree on special ids "
                      f"({said_diffs(diffs)}): training uses the tokenizer's, the model's generate() the config's; set {sets}, "
                      "or tokenize with the model's own tokenizer")


@dataclass(frozen=True)
class StepStats:
    """Token accounting of one replica's share of a step."""

    num_micro_batches: int
    num_samples: int
    """Samples in this replica's micro-batches."""
    real_tokens: int
    """Inputs + targets of those samples."""
    computed_tokens: int
    """Tokens the model computes on, padding included (``sum b (E + D)``)."""
    plan_time_s: float
    """Wall time spent cutting the global batch (the planner or the baseline's grouping)."""

    @property
    def efficiency(self) -> float:
        """Padding efficiency: real / computed tokens (1.0 for an empty share)."""
        return self.real_tokens / self.computed_tokens if self.computed_tokens else 1.0


@dataclass(frozen=True, eq=False)
class StepBatch:
    """What one optimizer step consumes on one replica."""

    step: int
    """0-based index of the global batch in the stream."""
    micro_batches: tuple[MicroBatch, ...]
    """Collated micro-batches of this replica, in execution order, each padded to its own longest sample."""
    weights: tuple[float, ...]
    """Per micro-batch: its loss tokens / :attr:`num_loss_tokens` (sums to 1 over all replicas)."""
    num_loss_tokens: int
    """Loss tokens of the whole global batch, all replicas together: the loss denominator."""
    stats: StepStats
    batch: GlobalBatch
    """The global batch (all samples; ``micro_batches[i].sample_ids`` index into it)."""
    replica_index: int
    num_replicas: int


def sample_loss_tokens(batch: GlobalBatch, family: str, loss_on_inputs: bool = False) -> list[int]:
    """Loss tokens of each sample of ``batch``, from lengths alone, exactly as collate lays them out
    (:func:`dynabatch.data.collate.sample_loss_tokens`: every target token of an encoder-decoder; a decoder-only
    sample's tokens after its first loss position, since its first token is never predicted)."""
    return collate_loss_tokens(batch.input_lens, batch.target_lens, family, loss_on_inputs).tolist()


def _batcher_seed(batcher: GlobalBatcher | EveryRowBatcher) -> int:
    """The seed that orders a batcher's rows (an ``EveryRowBatcher`` has its own; a stream's is its mixture's)."""
    return batcher.seed if isinstance(batcher, EveryRowBatcher) else batcher.data.spec.seed


def default_cost_model(
    model_config=None, hardware: str = "auto", device_memory_bytes: float | None = None, *,
    dtype: str = "fp32", attention: str = "segments",
) -> MicroBatchCostModel:
    """One-stage analytic cost model of ``model_config`` trained as :func:`~dynabatch.models.forward.forward_loss`
    runs it (``attention``, activations in ``dtype``: :meth:`AnalyticCostModel.for_run
    <dynabatch.cost.analytic.AnalyticCostModel.for_run>` through :func:`~dynabatch.models.families.run_cost_model`, the
    trainer's own model) on ``hardware`` (a preset of
    :mod:`dynabatch.cost.hardware`; ``auto``: this machine's, the CUDA device's preset and memory when there is
    one); polynomial without a config.

    The memory budget is ``device_memory_bytes`` (default: the preset's) less 10% and less the whole model's
    parameters, gradients and Adam states (:class:`~dynabatch.cost.stages.StageCostModel`).
    """
    if model_config is None:
        return PolynomialCostModel()
    import torch

    from dynabatch.models.families import run_cost_model  # lazy: keeps transformers out of the DataLoader import

    hardware = resolved_hardware(hardware)[0]
    if hardware == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("hardware='cuda' prices this machine's CUDA device, but CUDA is not available; use "
                             "hardware='auto' or a preset name")
        spec = device_hardware("cuda")
    else:
        spec = hardware_spec(hardware)
    device = "cpu" if hardware == "cpu" else "cuda"
    model = run_cost_model(model_config, device, dtype=dtype, attention_path=attention, dropout=True, hardware=spec)
    memory = device_memory_bytes if device_memory_bytes is not None else spec.memory_bytes
    return StageCostModel(model, balanced_layout(model, 1), float(memory))


def resolved_hardware(hardware: str) -> tuple[str, str | None]:
    """``hardware`` as the resolver's ``hardware`` rule decides it with what this process finds (``auto``: ``cuda``,
    the CUDA device's own preset, when CUDA is available, else ``cpu``), and the rule's reason (``None``: given)."""
    import torch

    return decide_why(SimpleNamespace(hardware=hardware), "hardware", Found(cuda_available=torch.cuda.is_available()))


@dataclass(eq=False)
class DynaBatchDataLoader:
    """Endless (or ``max_steps``-long) iterable of :class:`StepBatch`, one per optimizer step (more: the module
    docstring and ``docs/huggingface.md``)::

        loader = DynaBatchDataLoader({"qa": dataset}, LengthLimits("causal", max_seq_len=1024), token_budget=65_536,
                                     model_config=model.config, tokenizer=tok,
                                     columns={"inputs": "question", "targets": "answer"})
        for step in loader:
            for mb in step.micro_batches:
                (forward_loss(model, mb, loader.attention).loss_sum / step.num_loss_tokens).backward()
            optimizer.step(); optimizer.zero_grad()

    Main arguments (every field has its own docstring in the source):

    * ``data``: ``datasets.Dataset`` / ``IterableDataset`` objects (one, or a dict of task names to them, tokenized
      with ``tokenizer``, columns mapped by ``columns``), a ``MixtureData`` or a batcher.
    * ``limits``: :class:`~dynabatch.data.batching.LengthLimits`; ``token_budget``: real tokens per global batch.
    * ``model_config``: the model's Hugging Face config, for the planner's cost model and checks at build.
    * ``method`` (``dynamic`` or a baseline), ``method_options``; ``num_replicas`` / ``replica_index`` for data
      parallelism; ``max_steps`` (gives a ``len()``); ``each_row_once=True`` for evaluation.

    It is itself the loader: iterate it directly, not through ``torch.utils.data.DataLoader``.
    :meth:`state_dict` / :meth:`load_state_dict` save and resume the position.
    """

    data: Any = field(repr=False)
    """A tokenized mixture (``MixtureData``), a batcher (its position is shared: the loader advances it), or
    ``datasets.Dataset`` / ``IterableDataset`` objects (one, or a mapping of task names to them), tokenized with
    ``tokenizer`` by :meth:`MixtureData.from_datasets` (a stream is read up to its row limit)."""
    limits: LengthLimits | None = None
    """Per-sample length limits; required with ``MixtureData``, taken from a ``GlobalBatcher``."""
    _: KW_ONLY
    token_budget: int | None = None
    """Real tokens per global batch; required with ``MixtureData``, taken from a ``GlobalBatcher``."""
    method: str = "dynamic"
    """``dynamic`` (the planner) or a baseline name (see :data:`METHODS`)."""
    cost_model: MicroBatchCostModel | None = None
    """Planner cost model (``dynamic``); default: see :func:`default_cost_model`."""
    model_config: Any = None
    """Hugging Face ``T5Config`` / ``GPT2Config`` for the default analytic cost model."""
    hardware: str = "auto"
    """Hardware preset of the default analytic cost model (``dynabatch.cost.hardware``), ``cuda`` (the preset of this
    machine's CUDA device, with its memory) or ``auto`` (the resolver's rule: ``cuda`` when CUDA is available, else
    ``cpu``; :attr:`resolved` says what it chose)."""
    device_memory_bytes: float | None = None
    """Device memory for the default analytic cost model (default: the detected device's, else the preset's)."""
    dtype: str = "fp32"
    """Activation precision of the training loop, for the default cost model's memory: ``fp32``, or ``bf16`` /
    ``fp16`` for fp32 weights under autocast (what ``TrainingArguments(bf16=True)`` runs)."""
    attention: str = "segments"
    """The ``forward_loss`` attention path the loop runs (``segments``: padding-free, no score tensors kept
    except T5 on CPU; ``dense``), for the default cost model's memory."""
    method_options: Mapping[str, Any] = field(default_factory=dict)
    """Options of a baseline ``method``: its batcher's fields (``{"rows_per_micro_batch": 2}`` for ``packing_free``) or
    its knob's ``dynabatch train`` name (``{"packing_free_rows": 2}``); another name is a ``ValueError`` listing the
    valid ones (:func:`~dynabatch.data.baselines.option_names`)."""
    planner_options: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword options of :func:`~dynabatch.plan.step.plan_step` (e.g. ``cap_tolerance``)."""
    plan_candidates: bool = True
    """``dynamic``: also price the baselines' plans of each global batch (``length_grouped``, ``token_budget`` and,
    with ``attention="segments"``, ``packing_free``, at their tuning grids' values) by the cost model and keep the
    cheapest when it beats the DP's (:class:`~dynabatch.plan.global_plan.GlobalPlanner`)."""
    loss_on_inputs: bool = False
    """Decoder-only: also take loss on input tokens (with seq2seq data a ``ValueError``)."""
    num_replicas: int = 1
    """Data-parallel replicas (processes) sharing each global batch."""
    replica_index: int = 0
    """This process's replica, ``0 <= replica_index < num_replicas``."""
    max_steps: int | None = None
    """Steps per iteration (and ``len``); ``None``: endless, no ``len``."""
    restart_on_iter: bool = False
    """Every iteration starts again at the position the loader was built at (set by ``each_row_once``)."""
    each_row_once: bool = False
    """Evaluation loaders: every row of the data exactly once per iteration, truncated to ``limits``, in global
    batches of at most ``token_budget`` real tokens (:class:`~dynabatch.data.batching.EveryRowBatcher`), instead
    of the endless mixture stream (which draws rows by rate, with repetition); ``max_steps`` becomes the number
    of those batches and every iteration restarts."""
    eval_samples: int | None = None
    """With ``each_row_once``: at most this many rows per task (the same rows every iteration, as ``dynabatch
    train --eval-samples``); ``None``: every row."""
    tokenizer: Any = None
    """With datasets as ``data``: the tokenizer (e.g. ``dynabatch.data.tokenize.load_tokenizer("builtin")``), or a name
    or folder :func:`~dynabatch.data.tokenize.load_tokenizer` loads (``"builtin"``, ``"gpt2"``, ``"byt5"``, a path)."""
    columns: Mapping[str, str] | str | None = None
    """With datasets as ``data``: ``{"inputs": "question", "targets": "answer"}`` (or ``--columns`` text)."""
    bad_rows: str = "error"
    """With datasets as ``data``: ``error`` (a malformed row, e.g. a ``None`` or empty target, is a ``ValueError``
    naming it) or ``skip`` (dropped, counted in ``data.sources[i].num_skipped`` and said in a warning), as
    ``--bad-rows``."""
    max_stream_rows: int | None = None
    """With a ``datasets.IterableDataset`` in ``data``: the rows read from it into memory (the sampler draws rows by
    index); ``None``: :data:`~dynabatch.data.pipeline.DEFAULT_STREAM_ROWS`, with a warning when the stream has more."""
    seed: int | None = None
    """Orders the rows: the mixture sampler's draws (``each_row_once``: the row order). ``None``: 0 for datasets as
    ``data`` (the seed a :class:`~dynabatch.integrations.trainer.DynaBatchTrainer` replaces with
    ``TrainingArguments``' ``data_seed`` or ``seed``, :meth:`reseed`), the mixture's own seed for ``MixtureData``
    (as ``dynabatch train --mixture``). A seed given re-seeds ``MixtureData``; with a batcher as ``data`` it must be
    the batcher's."""
    resolved: dict = field(init=False, repr=False, default_factory=dict)
    """``{field: (value, reason)}`` of the options the resolver decided (``hardware`` of the default cost model)."""
    priced_for_run: bool = field(init=False, default=False)
    """The cost model is the default analytic one of ``model_config``, priced for ``dtype`` and ``attention`` (a
    :class:`~dynabatch.integrations.trainer.DynaBatchTrainer` checks them against how it trains)."""
    tokenized_here: bool = field(init=False, default=False)
    """``data`` was datasets, tokenized by this loader (its unset ``seed`` is then the trainer's to choose)."""
    batcher: GlobalBatcher | EveryRowBatcher = field(init=False, repr=False)
    _collator: Batcher = field(init=False, repr=False)
    _start_state: dict = field(init=False, repr=False)
    _planner: GlobalPlanner = field(init=False, repr=False)
    _pass_step: int = field(init=False, repr=False, default=0)
    """Steps yielded so far in the current iteration (what :meth:`state_dict` saves as ``pass_step``)."""
    _resume_pass_step: int | None = field(init=False, repr=False, default=None)
    """Set by :meth:`load_state_dict`: the next iteration finishes the saved, unfinished iteration."""

    def __post_init__(self) -> None:
        if self.eval_samples is not None and not self.each_row_once:
            raise ValueError("eval_samples caps the rows of an each_row_once loader; set each_row_once=True")
        if isinstance(self.data, (GlobalBatcher, EveryRowBatcher)):
            self._check_same("limits", self.limits, self.data.limits)
            self._check_same("token_budget", self.token_budget, self.data.token_budget)
            self._check_same("seed", self.seed, _batcher_seed(self.data))
            if self.each_row_once and isinstance(self.data, GlobalBatcher):
                raise ValueError("each_row_once reads every row of MixtureData or datasets; a GlobalBatcher is a "
                                 "stream: pass its .data instead")
            self.batcher = self.data
        else:
            if self.limits is None or self.token_budget is None:
                raise ValueError(f"with MixtureData or datasets give limits and token_budget (got limits={self.limits}, "
                                 f"token_budget={self.token_budget})")
            if not isinstance(self.data, MixtureData):
                self.data, self.tokenized_here = self._tokenized(self.data), True
            elif self.seed is not None:
                self.data = replace(self.data, spec=replace(self.data.spec, seed=self.seed))
            self.batcher = self._new_batcher()
        if not self.tokenized_here:
            loading = {k: getattr(self, k) for k in ("tokenizer", "columns", "max_stream_rows")
                       if getattr(self, k) is not None}
            loading.update({"bad_rows": self.bad_rows} if self.bad_rows != "error" else {})
            if loading:
                warnings.warn(f"{sorted(loading)} apply to datasets given as data, which this loader tokenizes; its "
                              f"data is a {type(self.data).__name__}, already tokenized, so they have no effect",
                              stacklevel=3)
        if isinstance(self.batcher, EveryRowBatcher):
            if self.max_steps not in (None, len(self.batcher)):
                raise ValueError(f"max_steps={self.max_steps} with each_row_once: the data makes {len(self.batcher)} "
                                 "global batches, each row once; leave max_steps unset")
            self.max_steps, self.restart_on_iter, self.each_row_once = len(self.batcher), True, True
        self.limits, self.token_budget = self.batcher.limits, self.batcher.token_budget
        if self.loss_on_inputs and self.family != "causal":
            raise ValueError(f"loss_on_inputs=True takes loss on a decoder-only model's input tokens, but the data is "
                             f"tokenized for {self.family!r} models, whose inputs go to the encoder and have no loss; "
                             "leave loss_on_inputs unset")
        if self.method not in METHODS:
            raise ValueError(f"unknown batching method {self.method!r}; valid: {', '.join(METHODS)}")
        for name, value, valid in (("dtype", self.dtype, DTYPES), ("attention", self.attention, ATTENTION_PATHS)):
            if value not in valid:
                raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")
        if self.num_replicas < 1 or not 0 <= self.replica_index < self.num_replicas:
            raise ValueError(
                f"need num_replicas >= 1 and 0 <= replica_index < num_replicas, "
                f"got replica_index={self.replica_index}, num_replicas={self.num_replicas}"
            )
        if (problem := replica_budget_problem(self.token_budget, self.num_replicas, self.limits, "token_budget")):
            raise ValueError(problem)  # else a global batch of long samples leaves a replica without one, mid-run
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 or None, got {self.max_steps}")
        if self.restart_on_iter and self.max_steps is None:
            raise ValueError("restart_on_iter=True needs max_steps (an endless loader would never restart)")
        if self.model_config is not None:
            kind = model_sequence_kind(self.model_config)
            if kind != self.family:
                raise ValueError(
                    f"model_config is a {getattr(self.model_config, 'model_type', None)!r} model ({kind}) but the "
                    f"data is tokenized for {self.family!r} models"
                )
            check_data_fits_model(self.model_config, self.limits, self.batcher.data.tokens, "the loader")
        tokens = self.batcher.data.tokens
        defaults = {f.name: f.default for f in fields(self)}
        unused = {k: getattr(self, k) for k in ("hardware", "device_memory_bytes", "dtype", "attention")
                  if getattr(self, k) != defaults[k]}
        if unused and (self.method != "dynamic" or self.cost_model is not None or self.model_config is None):
            warnings.warn(
                f"{unused} only shape the analytic cost model built from model_config for method 'dynamic' "
                "without a cost_model; they have no effect here"
            )
        if self.method == "dynamic":
            if self.method_options:
                raise ValueError(f"method_options {dict(self.method_options)} apply to baselines, not 'dynamic'")
            if self.cost_model is None:
                hardware = self.hardware
                if self.model_config is not None:
                    hardware, why = resolved_hardware(self.hardware)
                    if why is not None:
                        self.resolved["hardware"] = (hardware, why)
                self.cost_model = default_cost_model(self.model_config, hardware, self.device_memory_bytes,
                                                     dtype=self.dtype, attention=self.attention)
                self.priced_for_run = self.model_config is not None
            self._collator = Batcher(limits=self.limits, tokens=tokens, loss_on_inputs=self.loss_on_inputs)
        else:
            if self.cost_model is not None or self.planner_options:
                raise ValueError(f"cost_model and planner_options apply to method 'dynamic', not {self.method!r}")
            self.method_options = batcher_options_given(self.method, self.method_options, self.limits)
            self._collator = make_batcher(
                self.method, self.limits, tokens, loss_on_inputs=self.loss_on_inputs, **self.method_options
            )
        self._planner = GlobalPlanner(
            self.method, self.limits, 1, self.num_replicas, self.cost_model,
            planner_options=self.planner_options, batcher_options=self.method_options,
            candidates=self.plan_candidates, padding_free=self.attention == "segments",
        )
        self._start_state = self.batcher.state_dict()

    def _new_batcher(self) -> GlobalBatcher | EveryRowBatcher:
        """A batcher at the start of ``data`` (``MixtureData``), ordered by its spec's seed."""
        if self.each_row_once:
            return EveryRowBatcher(self.data, self.limits, self.token_budget, per_task=self.eval_samples,
                                   seed=self.data.spec.seed, min_samples=max(self.num_replicas, 1))
        return GlobalBatcher(self.data, self.limits, token_budget=self.token_budget)

    @property
    def data_seed(self) -> int:
        """The seed that orders the rows (``seed`` as given, or the default it stands for)."""
        return _batcher_seed(self.batcher)

    def reseed(self, seed: int) -> None:
        """Order the rows with ``seed``, as if the loader had been built with it: how a ``DynaBatchTrainer`` makes
        ``TrainingArguments(seed=...)`` decide the order of datasets, as the stock ``Trainer``'s sampler does.
        Only before the first step, and not for a loader built on a batcher (whose order is fixed)."""
        if not isinstance(self.data, MixtureData):
            raise ValueError("reseed: this loader was built on a batcher, whose order is fixed; pass its .data")
        if self.batcher.state_dict() != self._start_state:
            raise ValueError("reseed: the loader has already drawn steps; build it with seed= instead")
        self.seed = seed
        self.data = replace(self.data, spec=replace(self.data.spec, seed=seed))
        self.batcher = self._new_batcher()
        self._start_state = self.batcher.state_dict()

    def _tokenized(self, datasets) -> MixtureData:
        """``data`` given as datasets, tokenized with ``tokenizer`` for the family of ``limits``."""
        import datasets as hf_datasets


        if not isinstance(datasets, (hf_datasets.Dataset, hf_datasets.IterableDataset, Mapping)):
            raise ValueError(f"data must be MixtureData, a GlobalBatcher, a datasets.Dataset / IterableDataset or a "
                             f"mapping of task names to them, got {type(datasets).__name__}")
        if self.tokenizer is None:
            raise ValueError("with datasets as data give tokenizer= (e.g. dynabatch.data.tokenize.load_tokenizer('builtin'))")
        if isinstance(self.tokenizer, (str, os.PathLike)):  # a name or folder, as dynabatch train --tokenizer takes
            self.tokenizer = load_tokenizer(os.fspath(self.tokenizer))
        elif not hasattr(self.tokenizer, "eos_token_id"):
            raise ValueError(f"tokenizer= must be a Hugging Face tokenizer or a name load_tokenizer takes ('builtin', "
                             f"'gpt2', 'byt5' or a folder), got {type(self.tokenizer).__name__}")
        try:
            data = load_data(self.tokenizer, self.limits.family, datasets=datasets, columns=self.columns,
                             bad_rows=self.bad_rows, seed=self.seed or 0, max_stream_rows=self.max_stream_rows)
        except BadRowError as e:  # its advice names the spec and command-line spellings; add this class's own
            advice = "In DynaBatchDataLoader: columns={'inputs': <column>, 'targets': <column>}, bad_rows='skip'."
            raise BadRowError(f"{str(e).rstrip('.')}. {advice}") from None
        for src in data.sources:  # as the run log of dynabatch train --bad-rows skip says it
            if src.num_skipped:
                warnings.warn(f"dataset {src.name!r}: {src.num_skipped} of {src.num_skipped + len(src)} rows were "
                              "malformed (a missing or empty field) and skipped (bad_rows='skip'); "
                              "loader.batcher.data.sources[i].num_skipped counts them", stacklevel=3)
        return data

    @staticmethod
    def _check_same(name: str, given, actual) -> None:
        if given is not None and given != actual:
            raise ValueError(f"{name}={given} differs from the GlobalBatcher's {actual}; leave it unset")

    @property
    def family(self) -> str:
        return self.batcher.limits.family

    # ------------------------------------------------------------------ planning and collation

    def plan(self, batch: GlobalBatch) -> tuple[tuple[RowGroup, ...], ...]:
        """Every replica's micro-batches as row groups (sample indices only, no tensors)."""
        batch = self._collator.prepare(batch)  # packing_free_split: chunks of long samples (idempotent)
        planned = self._planner.plan(batch, self.batcher.data)
        assert not planned.plan.sliced_samples, "token slicing is not requested, so no piece is a slice"
        return tuple(tuple(planned.row_groups(r)) for r in range(self.num_replicas))

    def step_batch(self, batch: GlobalBatch) -> StepBatch:
        """Plan ``batch`` and collate this replica's micro-batches."""
        start = time.perf_counter()
        batch = self._collator.prepare(batch)  # the samples the groups index (a baseline may cut long ones)
        groups = self.plan(batch)[self.replica_index]
        plan_time = time.perf_counter() - start
        micro_batches = tuple(self._collator.collate(batch, g) for g in groups)
        total = sum(sample_loss_tokens(batch, self.family, self.loss_on_inputs))
        weights = tuple(mb.num_loss_tokens / total if total else 0.0 for mb in micro_batches)
        stats = StepStats(
            num_micro_batches=len(micro_batches),
            num_samples=sum(mb.num_samples for mb in micro_batches),
            real_tokens=sum(mb.num_real_tokens for mb in micro_batches),
            computed_tokens=sum(mb.num_computed_tokens for mb in micro_batches),
            plan_time_s=plan_time,
        )
        return StepBatch(batch.step, micro_batches, weights, total, stats, batch, self.replica_index, self.num_replicas)

    def next_step(self) -> StepBatch:
        """The next global batch of the stream, planned and collated."""
        return self.step_batch(self.batcher.next_batch())

    # ------------------------------------------------------------------ iteration and state

    def __iter__(self) -> Iterator[StepBatch]:
        """``max_steps`` steps (endless without), from where the stream is; ``restart_on_iter`` starts each
        iteration at the loader's first position. After :meth:`load_state_dict` of a position saved inside an
        iteration, the next iteration yields only that iteration's remaining steps and, with ``restart_on_iter``,
        does not restart: a resumed run sees the batches the uninterrupted run saw, and a ``Trainer`` counting
        ``len()`` steps per epoch keeps its epochs aligned with the loader's."""
        num_steps, self._resume_pass_step = self._resume_pass_step or 0, None
        if num_steps == 0 and self.restart_on_iter:
            self.batcher.load_state_dict(self._start_state)
        self._pass_step = num_steps
        while self.max_steps is None or num_steps < self.max_steps:
            step = self.next_step()
            num_steps += 1
            self._pass_step = num_steps  # before yielding: a checkpoint saved while the step trains counts it
            yield step

    def __getitem__(self, index):
        """Not a dataset: ``torch.utils.data.DataLoader(loader)`` indexes its dataset, so it gets this one line."""
        raise TypeError("DynaBatchDataLoader is itself the data loader, not a dataset to index or to wrap in "
                        "torch.utils.data.DataLoader: iterate it directly (for step in loader: ...); it plans and "
                        "collates in this process, so there are no worker processes (num_workers) to set")

    def __len__(self) -> int:
        """``max_steps``: the steps of one iteration; an endless loader (no ``max_steps``) has no ``len()``."""
        if self.max_steps is None:
            raise TypeError("an endless DynaBatchDataLoader has no len(); set max_steps")
        return self.max_steps

    def state_dict(self) -> dict[str, Any]:
        """The stream position (the batcher's state; the next step is the next global batch), with ``max_steps``
        ``pass_step`` (the steps already yielded by the current iteration), and ``stream``: the settings that decide
        the stream (``token_budget``, ``limits``, ``seed``), which :meth:`load_state_dict` checks."""
        state = self.batcher.state_dict()
        if self.max_steps is not None:
            state["pass_step"] = self._pass_step
        state["stream"] = self._stream_settings()
        return state

    def _stream_settings(self) -> dict[str, Any]:
        """What decides the global batches besides the data (which the batcher's state checks itself)."""
        limits = self.limits
        lens = (("max_input_len", "max_target_len") if limits.family == "seq2seq" else ("max_seq_len",))
        return {"token_budget": self.token_budget, "limits": {"family": limits.family, **{k: getattr(limits, k) for k in lens}},
                "seed": self.data_seed}

    def restart(self) -> None:
        """Back at the loader's first position (its first global batch, a new iteration next), as built and
        seeded: how a second ``DynaBatchTrainer.train()`` without a checkpoint starts over the data."""
        self.batcher.load_state_dict(self._start_state)
        self._resume_pass_step = None
        self._pass_step = 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a :meth:`state_dict` position; a dict that is not one is a ``ValueError`` naming what it lacks.
        A position inside an iteration (``0 < pass_step < max_steps``) makes the next iteration finish that one.
        A position saved by a loader with another ``token_budget``, ``limits`` or ``seed`` is a ``ValueError`` naming
        them: the same position would cut other global batches than the saved run's."""
        saved, now = state.get("stream"), self._stream_settings()
        if isinstance(saved, Mapping):
            diffs = [f"{k}={saved[k]!r} then, {now[k]!r} now" for k in now if k in saved and saved[k] != now[k]]
            if diffs:
                raise ValueError(f"this position was saved by a loader with other stream settings ({'; '.join(diffs)}); "
                                 "build the loader with the settings it was saved with to resume, or start over "
                                 "without load_state_dict")
        self.batcher.load_state_dict(state)
        pass_step = int(state.get("pass_step", 0))
        self._resume_pass_step = pass_step if self.max_steps is not None and 0 < pass_step < self.max_steps else None
