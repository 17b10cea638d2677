"""The model family registry: everything dynabatch needs to know about one kind of Hugging Face model.

A :class:`ModelFamily` (the idea of torchtitan's ``TrainSpec``) declares in one place what used to be
spread over a dozen modules: the HF ``model_type``s and classes it accepts, its sequence kind
(``causal``/``seq2seq``, the only thing ``data/``, ``plan/`` and ``schedule/`` see), its pipeline stage
module, tied-parameter groups, the tensors its stages pass (via :class:`~dynabatch.schedule.ir.PipelineSpec`),
the analytic layer spec read from an HF config, the profiler's layer builders, its position limit and
its CPU presets. Families registered here:

* ``gpt2`` (:mod:`.gpt2`): ``GPT2LMHeadModel``;
* ``t5`` (:mod:`.t5`): ``T5ForConditionalGeneration`` (T5, T5 v1.1 / Flan-T5 gated-GELU) and
  ``MT5ForConditionalGeneration``;
* ``llama`` (:mod:`.llama`): Llama-style decoders whose decoder layer is called like Llama's
  (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``).

Adding a family is one module here that builds its :class:`ModelFamily` and calls
:func:`register_family`, plus its tests (docs/model_families.md, "Adding a model family").
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable

from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.model_specs import TransformerSpec
from dynabatch.core.rank_warnings import EveryRankWarning
from dynabatch.core.sequence import CAUSAL, SEQUENCE_KINDS


@dataclass(frozen=True)
class ModelFamily:
    """One registered model family (see the module docstring)."""

    name: str
    """Registry key, e.g. ``llama``."""
    model_types: tuple[str, ...]
    """HF ``config.model_type`` values accepted."""
    model_classes: tuple[str, ...]
    """HF model classes accepted (a checkpoint's ``config.architectures`` must name one of them)."""
    sequence_kind: str
    """``causal`` or ``seq2seq``."""
    stage_class: type
    """The :class:`~dynabatch.models.stage.StageModule` subclass: ``stage_class(model, layout, stage_index,
    moving_boundaries=False)`` (:mod:`~dynabatch.models.boundary_copies`)."""
    tied_groups: Callable[[tuple[str, ...], bool], tuple[str, ...]]
    """Tied-parameter groups a stage with these layer kinds holds (second argument: the head is tied)."""
    analytic_spec: Callable[..., TransformerSpec]
    """``analytic_spec(config, dtype_bytes)``: the cost model's shape of a config."""
    d_model: Callable[[object], int]
    """Hidden width of a config (the width of the tensors between stages)."""
    presets: tuple[str, ...] = ()
    """CPU presets of the family (:data:`dynabatch.model_presets.PRESETS` names)."""
    positions_every_stage: bool = False
    """Rotary positions: every stage loads the position ids (:class:`~dynabatch.schedule.ir.PipelineSpec`)."""
    position_table: Callable[[object], int | None] | None = None
    """Size of a learned position table (a hard limit on the sequence length), or None."""
    trained_positions: Callable[[object], int | None] | None = None
    """Rotary models: the positions the model was trained for (exceeding them is a warning)."""
    profile_layers: Callable | None = None
    """``profile_layers(name, model, device, dtype) -> ModelLayers``: the profiler's layer builders."""
    check_config: Callable[[object, int], None] | None = None
    """Optional extra start-up check of a config for a sequence-length limit (raises ``ValueError``)."""

    def __post_init__(self) -> None:
        if self.sequence_kind not in SEQUENCE_KINDS:
            raise ValueError(f"sequence_kind must be one of {SEQUENCE_KINDS}, got {self.sequence_kind!r}")


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to the registry (a name or model type registered twice is an error)."""
    if family.name in _FAMILIES:
        raise ValueError(f"model family {family.name!r} is already registered")
    taken = {t: f.name for f in _FAMILIES.values() for t in f.model_types}
    clash = [t for t in family.model_types if t in taken]
    if clash:
        raise ValueError(f"model types {clash} of family {family.name!r} are already registered by {taken[clash[0]]!r}")
    _FAMILIES[family.name] = family
    return family


def families() -> tuple[ModelFamily, ...]:
    """Every registered family, in registration order."""
    return tuple(_FAMILIES.values())


def get_family(name: str) -> ModelFamily:
    """The family registered as ``name``."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; registered families: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def supported_description() -> str:
    """``gpt2 (GPT2LMHeadModel), t5 (...), ...``: for error messages."""
    return "; ".join(f"{f.name} ({', '.join(f.model_classes)})" for f in _FAMILIES.values())


def family_for_config(config) -> ModelFamily:
    """The family that accepts an HF config (its ``model_type`` and, when given, ``architectures``).

    An unsupported model is a ``ValueError`` naming its type and the supported families.
    """
    model_type = getattr(config, "model_type", None)
    family = next((f for f in _FAMILIES.values() if model_type in f.model_types), None)
    if family is None:
        raise ValueError(
            f"model type {model_type!r} is not supported; dynabatch supports the families {supported_description()}"
        )
    archs = [a for a in (getattr(config, "architectures", None) or []) if a not in family.model_classes]
    if archs:
        raise ValueError(
            f"model class {archs[0]} is not supported; the {family.name} family trains {', '.join(family.model_classes)}"
        )
    return family


def family_for_preset(name: str) -> ModelFamily:
    """The family of a CPU preset name."""

    return family_for_config(build_config(name))


def layer_builder(model) -> Callable:
    """The profiler layer builder of a preset name, local checkpoint or HF config's family."""

    family = family_for_config(load_config(model) if isinstance(model, str) else model)
    if family.profile_layers is None:
        raise ValueError(f"the {family.name} family has no profiler layer builders")
    return family.profile_layers


def analytic_spec(config, dtype_bytes: int = 2) -> TransformerSpec:
    """The analytic cost model's :class:`TransformerSpec` of a supported HF config."""
    return family_for_config(config).analytic_spec(config, dtype_bytes)


def run_cost_model(config, device: str = "cpu", *, dtype: str = "fp32", attention_path: str = "segments",
                   dropout: bool = False, hardware=None):
    """The analytic cost model of a training run of the supported HF ``config`` as the runtime executes it
    (:meth:`AnalyticCostModel.for_run <dynabatch.cost.analytic.AnalyticCostModel.for_run>` of its
    :func:`analytic_spec`), shared by the trainer's planner and the dataloader."""
    return AnalyticCostModel.for_run(analytic_spec(config), device, dtype=dtype, attention_path=attention_path,
                                     dropout=dropout, hardware=hardware)


def check_length_limit(config, max_len: int, what: str = "the length limit") -> None:
    """Start-up check of a per-sequence token limit against the model's positions.

    Above a learned position table (GPT-2's ``n_positions``) it is a ``ValueError`` (the embedding
    lookup would fail mid-run); above a rotary model's ``max_position_embeddings`` it is a warning
    (positions run past those the model was trained on), an :class:`EveryRankWarning`: each rank of a run checks
    the same config, and rank 0 alone says it.
    """
    family = family_for_config(config)
    table = family.position_table(config) if family.position_table else None
    if table is not None and max_len > table:
        raise ValueError(
            f"{what} is {max_len} tokens but this {config.model_type} model has only {table} positions "
            f"(n_positions); lower the limit to at most {table}"
        )
    trained = family.trained_positions(config) if family.trained_positions else None
    if trained is not None and max_len > trained:
        warnings.warn(
            f"{what} is {max_len} tokens but this {config.model_type} model was trained for "
            f"{trained} positions (max_position_embeddings); longer samples use untrained rotary positions",
            EveryRankWarning, stacklevel=2,
        )
    if family.check_config is not None:
        family.check_config(config, max_len)


def check_config_limit(config, max_len: int | None) -> ModelFamily:
    """The family of a supported HF ``config`` (:func:`family_for_config`), after the start-up check of a
    decoder-only model's per-sample token limit ``max_len`` (``None``: not checked) against its positions and its
    family's own rules (:func:`check_length_limit`: a learned position table, Mistral's sliding window): what
    ``train`` checks of its model (:func:`check_model`), and ``plan`` and ``simulate`` of a model they price from
    its config."""
    family = family_for_config(config)
    if family.sequence_kind == CAUSAL and max_len is not None:
        check_length_limit(config, max_len, what="the length limit (--max-input-len)")
    return family


def check_model(name_or_path: str, max_len: int | None, slice_long: bool = False) -> ModelFamily:
    """Start-up checks of a model to train, from its config alone (before any weights or data load).

    The model type must be supported (:func:`family_for_config`); a causal model's per-sample token
    limit ``max_len`` (None: not checked) must fit its positions (:func:`check_length_limit`); token slices need a causal model.
    """

    problem = model_problem(name_or_path)
    if problem is not None and not os.path.isdir(name_or_path):  # no such folder, a file, an unknown preset
        raise ValueError(problem)
    config = load_config(name_or_path)  # a folder without a usable config.json: one line
    family = family_for_config(config)
    if slice_long and family.sequence_kind != CAUSAL:
        raise ValueError(
            f"slice_long cuts decoder-only samples into token slices; {name_or_path} is a {family.sequence_kind} "
            f"({family.name}) model"
        )
    check_config_limit(config, max_len)
    if problem is not None:  # a folder without weights: after what its config alone says
        raise ValueError(problem)
    return family


# Registration: importing a family module registers it.
from dynabatch.models.families import gpt2, llama, t5  # noqa: E402,F401
from dynabatch.model_presets import build_config
from dynabatch.model_presets import load_config, model_problem
