"""Split a Hugging Face model of a registered family (GPT-2, T5, Llama-style) into pipeline stage modules.

The family registry (:mod:`dynabatch.models.families`) says which stage module, tied groups, analytic
spec and stage inputs a model has; this module only composes them.

1. :func:`layout_for` cuts the model's layer kinds (``embedding, gpt x L, lm_head`` or
   ``embedding, t5_encoder x L, decoder_embedding, t5_decoder x L, lm_head``) into ``S`` contiguous
   stages with :func:`~dynabatch.cost.layer_split.balanced_layout` under the analytic cost model (CPU
   preset; only the relative layer times matter for the cut).
2. :func:`build_stage` builds one :class:`~dynabatch.models.stage.StageModule` that references the
   model's submodules for its layers, then deep-copies it, so the stage owns its parameters (ties
   inside one stage survive the copy) and the full model can be dropped. Each runtime rank builds only
   its own stage from an identically seeded full model. Parameters several stages hold (the token
   table / tied head, T5's relative-position tables) are reported by ``tied_parameters()`` under group
   names; :func:`tied_parameter_stages` says which stages hold each group without building them. With
   ``moving_boundaries`` a stage also holds copies of the neighbours' units that may move to it
   (:mod:`dynabatch.models.boundary_copies`), each parameter a tied group named by its original name.
3. ``stage.parameter_map`` (also ``stage.original_names()``) maps every stage parameter name to the
   original model's parameter name (the canonical one ``model.named_parameters()`` yields, e.g.
   ``transformer.wte.weight`` for GPT-2's tied head). Summing the gradients of the stage parameters that
   map to one name gives the unsplit model's gradient of that name (tests/unit/models/test_stage_split.py).
4. :func:`micro_batch_inputs` maps a micro-batch to a stage's ``loaded`` dict by the names of
   :meth:`~dynabatch.schedule.ir.PipelineSpec.load_tensors` (GPT's ``labels`` are the pre-shifted
   ``target_ids``; T5's ``segment_ids`` are the encoder segment ids).

Dropout. Each stage draws dropout masks from the global torch RNG. To make them reproducible per
(step, micro-batch, stage) the executor calls ``torch.manual_seed(seed_for(base_seed, step,
micro_batch, stage))`` right before a stage's forward (inside :func:`forked_rng` so other RNG users
are not disturbed). Activation recomputation (:mod:`dynabatch.models.recompute`) restores the RNG state a
checkpointed block or attention core started from, so its recomputed forward draws the same masks.
With dropout 0 nothing depends on the RNG and chained stages equal the unsplit model exactly.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from dynabatch.cost.analytic import AnalyticCostModel
from dynabatch.cost.hardware import hardware_spec
from dynabatch.cost.boundary_moves import held_kinds
from dynabatch.cost.model_specs import BLOCK_KINDS, join_halves, layer_kinds, split_halves
from dynabatch.cost.stages import StageLayout
from dynabatch.cost.layer_split import balanced_layout, placement_layout
from dynabatch.data.microbatch import CausalMicroBatch, MicroBatch, Seq2SeqMicroBatch
from dynabatch.models.attention import check_attention_path, use_segment_attention
from dynabatch.models.boundary_copies import moving_parameters
from dynabatch.models.families import analytic_spec, family_for_config
from dynabatch.model_presets import stages_line
from dynabatch.models.stage import StageModule
from dynabatch.schedule.ir import PipelineSpec
from dynabatch.core.sequence import CAUSAL, SEQ2SEQ

_MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------------------------
# Layout and spec
# ----------------------------------------------------------------------------------------------


def _num_blocks(model: nn.Module) -> int:
    spec = analytic_spec(model.config)
    return spec.num_layers + spec.num_decoder_layers


def check_num_stages(model: nn.Module, num_stages: int, placement=None) -> None:
    """One-line ``ValueError`` unless ``1 <= num_stages <=`` the model's transformer blocks (every stage holds
    one), and unless the chunks of ``placement`` (a :class:`~dynabatch.schedule.placement.Placement` with several
    chunks per device) fit them too; the trainer checks it before loading any data."""
    num_blocks = _num_blocks(model)
    if not 1 <= num_stages <= num_blocks:
        raise ValueError(stages_line(model.config.model_type, num_blocks, num_stages))
    if placement is not None and placement.num_stages > num_blocks:
        raise ValueError(
            f"--placement {placement.describe()} cuts {num_stages} stages into {placement.num_stages} chunks, more than the "
            f"{num_blocks} transformer blocks of this {model.config.model_type} model (every chunk holds one); use "
            "--placement linear or fewer chunks per device"
        )


def layout_for(model: nn.Module, num_stages: int, placement=None, split_blocks: bool = False) -> StageLayout:
    """Balanced stage layout of ``model`` (any registered family's HF model) in ``num_stages`` stages; with the
    ``cyclic`` :class:`~dynabatch.schedule.placement.Placement` of ``num_stages`` chunks, the encoder and the
    decoder each cut into one balanced chunk per device (:func:`~dynabatch.cost.layer_split.cyclic_layout`).
    ``split_blocks``: cuts may fall between a block's attention and MLP halves (decoder-only, T5 encoder)."""
    check_num_stages(model, num_stages if placement is None else placement.num_devices, placement)
    dtype_bytes = next(model.parameters()).element_size()
    cost_model = AnalyticCostModel(analytic_spec(model.config, dtype_bytes), hardware_spec("cpu"))
    if placement is not None and placement.kind == "cyclic":
        if placement.num_stages != num_stages:
            raise ValueError(f"placement {placement.describe()} has {placement.num_stages} chunks, not {num_stages}")
        return placement_layout(cost_model, placement)
    return balanced_layout(cost_model, num_stages, split_blocks=split_blocks)


def pipeline_spec_for(model: nn.Module, layout: StageLayout, dtype: str = "float32") -> PipelineSpec:
    """What the stages of ``layout`` exchange (roles from the layer kinds; width and whether every stage
    loads position ids from the model's family)."""
    family = family_for_config(model.config)
    return PipelineSpec.from_layout(layout, family.d_model(model.config), dtype, family.positions_every_stage)


def _check_layout(model: nn.Module, layout: StageLayout) -> None:
    expected = layer_kinds(analytic_spec(model.config))
    got = [k for s in layout.stages for k in s]
    whole_inside = all(join_halves(s) == tuple(s) for s in layout.stages)  # halves only where a cut falls
    if split_halves(got) != split_halves(expected) or not whole_inside:
        raise ValueError(
            f"layout {layout.describe()!r} does not cover this {model.config.model_type} model's layers "
            f"in order; expected {len(expected)} layers {' '.join(expected)}"
        )
    empty = [i for i, s in enumerate(layout.stages) if not any(k in BLOCK_KINDS for k in s)]
    if empty:
        raise ValueError(
            f"stages {empty} of layout {layout.describe()!r} hold no transformer block; every stage needs one"
        )


# ----------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------


def _own_copy(stage: StageModule, model: nn.Module) -> StageModule:
    """Deep-copy ``stage`` (which references ``model``'s submodules) and fill its ``parameter_map``."""
    canonical = {id(p): name for name, p in model.named_parameters()}  # tied params: first name only
    names = {name: canonical[id(p)] for name, p in stage.named_parameters()}
    owned = copy.deepcopy(stage)
    assert [n for n, _ in owned.named_parameters()] == list(names)  # deepcopy keeps order and ties
    owned.parameter_map = names
    return owned


def build_stage(model: nn.Module, layout: StageLayout, stage_index: int, attention: str = "segments",
                moving_boundaries: bool = False) -> StageModule:
    """Stage ``stage_index`` of ``layout``, owning deep copies of the parameters it needs.

    ``moving_boundaries``: the stage also holds copies of the neighbours' units that may move to it
    (:mod:`dynabatch.models.boundary_copies`), mapped to their original names in ``parameter_map``; its forward
    then takes ``moves=(lower, upper)``. Off, the stage is exactly the one without the option.

    ``attention``: ``segments`` (padding-free, :mod:`dynabatch.models.attention`) or ``dense`` (4-D masks
    under the model's own attention implementation, the reference). Either way the stage's own copy of the
    config is pointed at the registered padding-free function, which hands dense masks to the model's own
    implementation: every attention core then passes :func:`~dynabatch.models.recompute.run_attention_core`
    (``selective`` recomputation). The model is not modified. The stage is in the model's train/eval mode,
    dtype and device.
    """
    if not 0 <= stage_index < layout.num_stages:
        raise ValueError(f"stage_index must be in [0, {layout.num_stages}), got {stage_index}")
    check_attention_path(attention)
    _check_layout(model, layout)
    stage = family_for_config(model.config).stage_class(model, layout, stage_index, moving_boundaries=moving_boundaries)
    owned = _own_copy(stage, model).train(model.training)
    owned.attention = attention
    use_segment_attention(owned)
    return owned


class DeviceChunks(nn.Module):
    """The pipeline chunks one device holds under a virtual-stage placement (:mod:`dynabatch.schedule.placement`),
    as one module for the optimizer, checkpoints and weight gathering: ``chunks.K.<name>`` parameters, a
    ``parameter_map`` to the global names (tied copies on two chunks map to one name and hold equal values)."""

    def __init__(self, chunks: list[StageModule]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.parameter_map = {f"chunks.{k}.{local}": name for k, c in enumerate(chunks)
                              for local, name in c.parameter_map.items()}

    @property
    def attention(self) -> str:
        return self.chunks[0].attention


def build_device_stages(model: nn.Module, layout: StageLayout, device: int, num_devices: int,
                        attention: str = "segments", moving_boundaries: bool = False) -> list[StageModule]:
    """The chunks ``device`` of ``num_devices`` holds: stages ``device, device + num_devices, ...`` of ``layout``."""
    return [build_stage(model, layout, v, attention, moving_boundaries)
            for v in range(device, layout.num_stages, num_devices)]


def build_stages(model: nn.Module, layout: StageLayout, attention: str = "segments",
                 moving_boundaries: bool = False) -> list[StageModule]:
    """Every stage of ``layout`` (for single-process tests and tools; the runtime builds one per rank)."""
    return [build_stage(model, layout, i, attention, moving_boundaries) for i in range(layout.num_stages)]


def tied_parameter_stages(model: nn.Module, layout: StageLayout,
                          moving_boundaries: bool = False) -> dict[str, tuple[int, ...]]:
    """Tied-parameter group -> indices of the stages holding a copy (groups held by one stage included).

    The runtime sums each group's gradient over these stages (within a replica) before the optimizer step. With
    ``moving_boundaries`` every parameter of a unit that may cross a boundary is a group of the two stages holding
    it, named by its original name (:mod:`dynabatch.models.boundary_copies`); the stages are then only referenced
    (their constructors copy nothing), not built.
    """
    tied_head = model.lm_head.weight is model.get_input_embeddings().weight
    family = family_for_config(model.config)
    canonical = {id(p): name for name, p in model.named_parameters()}
    out: dict[str, list[int]] = {}
    for i in range(layout.num_stages):
        kinds = held_kinds(layout, i) if moving_boundaries else tuple(layout.stages[i])
        groups = list(family.tied_groups(kinds, tied_head))
        if moving_boundaries:
            reference = family.stage_class(model, layout, i, moving_boundaries=True)
            groups += [canonical[id(p)] for p in moving_parameters(reference).values()]
        for group in groups:
            out.setdefault(group, []).append(i)
    return {g: tuple(v) for g, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def micro_batch_inputs(mb: MicroBatch, spec: PipelineSpec, stage_index: int) -> dict[str, torch.Tensor]:
    """The ``loaded`` dict of stage ``stage_index`` for ``mb``, keyed by ``spec.load_tensors`` names."""
    if isinstance(mb, CausalMicroBatch):
        if spec.family != CAUSAL:
            raise ValueError(f"a CausalMicroBatch needs a causal pipeline spec, got {spec.family!r}")
        b, e = mb.shape
        d = 0
        source = {
            "segment_ids": mb.segment_ids,
            "input_ids": mb.input_ids,
            "position_ids": mb.position_ids,
            "labels": mb.target_ids,  # already shifted
        }
    elif isinstance(mb, Seq2SeqMicroBatch):
        if spec.family != SEQ2SEQ:
            raise ValueError(f"a Seq2SeqMicroBatch needs a seq2seq pipeline spec, got {spec.family!r}")
        b, e, d = mb.shape
        source = {
            "segment_ids": mb.encoder_segment_ids,
            "input_ids": mb.input_ids,
            "decoder_segment_ids": mb.decoder_segment_ids,
            "decoder_input_ids": mb.decoder_input_ids,
            "labels": mb.labels,
        }
    else:
        valid = "CausalMicroBatch, Seq2SeqMicroBatch"
        raise ValueError(f"unsupported micro-batch type {type(mb).__name__}; valid: {valid}")
    if not 0 <= stage_index < spec.num_stages:
        raise ValueError(f"stage_index must be in [0, {spec.num_stages}), got {stage_index}")
    return {t.name: source[t.name] for t in spec.load_tensors(stage_index, b, e, d)}


# ----------------------------------------------------------------------------------------------
# Dropout seeds
# ----------------------------------------------------------------------------------------------


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seed_for(base_seed: int, step: int, micro_batch: int, stage: int) -> int:
    """Deterministic dropout seed of one stage forward: splitmix64 chained over the four ints.

    The same on every process and run (no Python ``hash``), in ``[0, 2**63)`` for ``torch.manual_seed``.
    """
    for name, value in (("base_seed", base_seed), ("step", step), ("micro_batch", micro_batch), ("stage", stage)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    x = 0
    for value in (base_seed, step, micro_batch, stage):
        x = _splitmix64(x ^ (value & _MASK64))
    return x >> 1


@contextlib.contextmanager
def forked_rng(seed: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Run the body with the RNG of the CPU (and of ``device`` if it is CUDA) seeded to ``seed``,
    restoring the previous RNG states afterwards."""
    device = torch.device(device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield
