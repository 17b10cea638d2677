"""The set-up checks of :class:`~dynabatch.integrations.trainer.DynaBatchTrainer`: which constructor arguments,
``TrainingArguments`` and loaders it refuses (a ``ValueError`` saying what to do), which it warns have no effect or
differ from how it trains, and the settings it takes from ``TrainingArguments`` (the train loader's seed, the model's
generation config). Each function reads what it checks and nothing else of the trainer."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping

from dynabatch.core.allocator import CPU_ALLOCATORS
from dynabatch.core.attention import ATTENTION_PATHS
from dynabatch.integrations.dataloader import DynaBatchDataLoader, check_data_fits_model, model_sequence_kind

NOT_ACCEPTED = ("train_dataset", "eval_dataset", "data_collator")
"""``Trainer`` keywords a ``DynaBatchTrainer`` refuses: its loaders take their place."""
_ROW_ORDER = ("the loader's seed orders the rows and its method groups them into micro-batches "
              "(method='length_grouped' groups by length)")
DECIDED_BY_LOADER = {
    "per_device_train_batch_size": "the train loader's token_budget decides the samples of each step",
    "per_device_eval_batch_size": "the eval loader's token_budget decides the samples of each batch",
    "dataloader_num_workers": "the loader plans and collates in the training process",
    "train_sampling_strategy": _ROW_ORDER,
    "auto_find_batch_size": "the train loader's token_budget sizes each step and the planner fits its micro-batches "
                            "to the cost model's memory (lower token_budget or device_memory_bytes if a step runs out)",
    "dataloader_drop_last": "every training step is a whole token-budget global batch, and an each_row_once eval "
                            "loader evaluates every row, its last global batch included",
    "sortish_sampler": _ROW_ORDER,  # Seq2SeqTrainingArguments' own
}
"""``TrainingArguments`` the stock ``Trainer`` uses to build its dataloaders, which a ``DynaBatchTrainer`` never
builds: setting one is a warning naming what decides instead."""


def check_constructor(args, eval_loader, attention: str, cpu_allocator: str, kwargs: dict) -> None:
    """The refusals due before ``Trainer.__init__`` runs: an unknown ``attention`` or ``cpu_allocator``, a
    :data:`NOT_ACCEPTED` keyword, and an ``eval_strategy`` without ``eval_loader`` (``Trainer``'s own error would ask
    for ``eval_dataset``)."""
    if attention not in ATTENTION_PATHS:  # the choices of --attention
        raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTION_PATHS)}")
    if cpu_allocator not in CPU_ALLOCATORS:  # the choices of --cpu-allocator
        raise ValueError(f"unknown cpu_allocator {cpu_allocator!r}; valid: {', '.join(CPU_ALLOCATORS)}")
    given = [k for k in NOT_ACCEPTED if kwargs.get(k) is not None]
    if given:
        raise ValueError(f"DynaBatchTrainer takes train_loader= and eval_loader=, not {given}")
    strategy = getattr(getattr(args, "eval_strategy", "no"), "value", "no")
    if strategy != "no" and eval_loader is None:
        raise ValueError(f"TrainingArguments(eval_strategy={strategy!r}) evaluates during training, but no "
                         "eval_loader was given: pass eval_loader=DynaBatchDataLoader(..., each_row_once=True), "
                         "or set eval_strategy='no'")


def check_arguments(args) -> None:
    """A ``ValueError`` for the ``TrainingArguments`` a ``DynaBatchTrainer`` cannot train as asked
    (``gradient_accumulation_steps``, ``label_smoothing_factor``, several GPUs in one process); a warning for a
    ``WORLD_SIZE`` launch whose arguments are not distributed."""
    if args.gradient_accumulation_steps != 1:
        raise ValueError(
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: one StepBatch is one optimizer "
            "step already (its size is the loader's token_budget); set gradient_accumulation_steps=1"
        )
    if args.label_smoothing_factor:
        raise ValueError(
            f"label_smoothing_factor={args.label_smoothing_factor}: a DynaBatchTrainer trains on forward_loss's "
            "summed token cross-entropy, without label smoothing; set label_smoothing_factor=0"
        )
    if args.n_gpu > 1:
        raise ValueError(
            f"{args.n_gpu} GPUs in one process (nn.DataParallel) are not supported; "
            "run one process per device with torchrun"
        )
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and args.world_size == 1:
        warnings.warn(
            f"launched with WORLD_SIZE={launched} but TrainingArguments is not distributed, so every process "
            "trains alone on the whole batch; on CPU set TrainingArguments(use_cpu=True)"
        )


def check_loaders(args, model, train_loader, eval_loader) -> None:
    """A ``ValueError`` for a loader that is not a :class:`DynaBatchDataLoader`, not this process's replica
    (:func:`check_replica`), of another sequence kind than ``model`` or too long for it, or an endless eval loader."""
    loaders = {"train_loader": train_loader}
    if isinstance(eval_loader, Mapping):
        loaders.update({f"eval_loader[{k!r}]": v for k, v in eval_loader.items()})
    else:
        loaders["eval_loader"] = eval_loader
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for name, loader in loaders.items():
        if loader is None:
            continue
        if not isinstance(loader, DynaBatchDataLoader):
            raise ValueError(f"{name} must be a DynaBatchDataLoader, got {type(loader).__name__}")
        check_replica(args, name, loader)
        if model_type is not None and model_sequence_kind(model.config) != loader.family:
            raise ValueError(f"{name} holds {loader.family!r} data but the model is {model_type!r}")
        if model_type is not None and loader.model_config is not model.config:  # else the loader checked
            check_data_fits_model(model.config, loader.limits, loader.batcher.data.tokens, name)
        if name != "train_loader" and loader.max_steps is None:
            raise ValueError(f"{name} is endless; build eval loaders with each_row_once=True (every row "
                             "once per evaluation)")


def check_replica(args, name: str, loader: DynaBatchDataLoader) -> None:
    """A ``ValueError`` when ``loader`` is not this process's replica: its share would be another rank's (the
    summed loss and gradients would count one share twice and miss another)."""
    if (loader.num_replicas, loader.replica_index) != (args.world_size, args.process_index):
        raise ValueError(
            f"{name} is replica {loader.replica_index} of {loader.num_replicas} but this process is "
            f"{args.process_index} of {args.world_size}; build it with num_replicas=args.world_size, "
            "replica_index=args.process_index"
        )


def warn_endless_epochs(args, loader: DynaBatchDataLoader | None) -> None:
    """An endless train loader makes the whole run one epoch: ``"epoch"`` strategies then act once, at the end."""
    if loader is None or loader.max_steps is not None:
        return
    for name in ("eval_strategy", "save_strategy", "logging_strategy"):
        if getattr(getattr(args, name, None), "value", None) == "epoch":
            warnings.warn(f"TrainingArguments({name}='epoch') with an endless train_loader: the run is one epoch, "
                          f"so it acts only after the last step; use {name}='steps', or build the loader with "
                          "max_steps=N (an epoch of N steps)")


def check_pricing(args, attention: str, loader: DynaBatchDataLoader | None) -> None:
    """A warning when the train loader's default cost model prices another ``dtype`` or ``attention`` than the
    trainer runs (``TrainingArguments(bf16=/fp16=)``, ``attention=``): its micro-batches are then sized for memory
    the steps do not take (too large a share of the device when it prices fp32 or segments for bf16 or dense)."""
    if loader is None or not loader.priced_for_run:
        return
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    runs = {"dtype": dtype, "attention": attention}
    differ = {k: v for k, v in runs.items() if getattr(loader, k) != v}
    if differ:
        priced = ", ".join(f"{k}={getattr(loader, k)!r}" for k in differ)
        wanted = ", ".join(f"{k}={v!r}" for k, v in differ.items())
        warnings.warn(f"train_loader prices micro-batch memory for {priced} but this trainer runs {wanted} "
                      f"(TrainingArguments bf16/fp16, DynaBatchTrainer attention); build it with {wanted}")


def seed_train_loader(args, loader: DynaBatchDataLoader | None) -> tuple[int, str] | None:
    """Let ``TrainingArguments``' ``data_seed`` (else ``seed``) order the training data, as the stock ``Trainer``'s
    sampler does, which an HF user expects: a train loader that tokenized datasets without ``seed=`` is re-seeded
    with it, and ``(seed, why)`` is returned (the trainer's ``resolved["data_seed"]``). A seed given to the loader
    (or a mixture's own) stays; a given one that differs is a warning."""
    if loader is None:
        return None
    name = "data_seed" if args.data_seed is not None else "seed"
    seed = getattr(args, name)
    if loader.seed is None and loader.tokenized_here:
        try:
            loader.reseed(seed)
        except ValueError as e:
            warnings.warn(f"train_loader keeps seed {loader.data_seed}, not TrainingArguments.{name}={seed}: {e}")
            return None
        return seed, f"TrainingArguments.{name}; the train loader was built without seed="
    if loader.seed is not None and loader.seed != seed:
        warnings.warn(f"train_loader was built with seed={loader.seed}, which orders its data instead of "
                      f"TrainingArguments.{name}={seed}; build it with seed=args.{name} to follow TrainingArguments")
    return None


def warn_ignored_arguments(args) -> None:
    """One warning per :data:`DECIDED_BY_LOADER` argument set to other than its default: it has no effect."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    for name, instead in DECIDED_BY_LOADER.items():
        value = getattr(args, name, None)
        if name in defaults and value != defaults[name]:
            warnings.warn(f"TrainingArguments({name}={value!r}) has no effect on a DynaBatchTrainer: {instead}")


def warn_unused_metrics_arguments(args, compute_metrics) -> None:
    """A warning each for a ``compute_metrics`` that ``evaluate()`` would never call (it gets generated ids, so
    only with ``predict_with_generate``; ``predict()`` always calls it) and for ``include_for_metrics``, which the
    trainer does not act on (the ``EvalPrediction`` holds predictions and labels only)."""
    if compute_metrics is not None and not getattr(args, "predict_with_generate", False):
        warnings.warn("compute_metrics gets generated ids, so a DynaBatchTrainer's evaluate() calls it only with "
                      "Seq2SeqTrainingArguments(predict_with_generate=True) (predict() always does); without it "
                      "evaluate() reports eval_loss alone")
    if getattr(args, "include_for_metrics", None):
        warnings.warn(f"TrainingArguments(include_for_metrics={args.include_for_metrics!r}) has no effect on "
                      "a DynaBatchTrainer: compute_metrics' EvalPrediction holds the generated ids and labels only")


def use_generation_config(args, model) -> None:
    """``Seq2SeqTrainingArguments(generation_config=...)`` becomes ``model``'s ``generation_config``, as
    ``Seq2SeqTrainer`` makes it: ``predict`` and ``evaluate(predict_with_generate)`` generate with its settings
    (its ``max_new_tokens``/``max_length`` and ``num_beams`` after ``gen_kwargs`` and ``generation_max_length``/
    ``generation_num_beams``; its ``do_sample``)."""
    given = getattr(args, "generation_config", None)
    if given is None or model is None:
        return
    from transformers import Seq2SeqTrainer

    model.generation_config = Seq2SeqTrainer.load_generation_config(given)
