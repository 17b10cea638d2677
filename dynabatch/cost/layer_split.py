"""The layer split: a model's layer kinds cut into contiguous pipeline stages that balance a layer-level cost model.

A model is an ordered list of layer kinds (``embedding, gpt x L, lm_head`` or ``embedding,
t5_encoder x L, decoder_embedding, t5_decoder x L, lm_head``). :func:`balanced_layout` cuts it into
``S`` contiguous stages minimising the largest stage time at a reference micro-batch shape (a small
exact DP over cut points; every stage gets at least one transformer block).

Cuts fall between blocks. With ``split_blocks`` a cut may also fall inside a decoder-only block, between
its attention half and its MLP half (``gpt_attn`` / ``gpt_mlp``, :data:`~dynabatch.cost.model_specs.BLOCK_HALVES`),
or inside a T5 encoder block (``t5_enc_attn`` / ``t5_enc_ffn``): a stage then ends with the attention half and the
next begins with the other, and what passes between them is the hidden state after the attention's residual add,
the size of any other hand-off. T5 needs it when inputs are long: at 2,048 tokens self-attention is about 87% of an
encoder block on a CPU core (13% the FFN), so a whole-block split of t5-d256 on 2 stages leaves one stage 30% busier. A whole block's
granularity is coarse when stages hold few blocks: GPT-1.3B's head costs about two blocks, so its 24
blocks and head make 26 block-times, 6.5 per stage over 4 stages, and the best whole-block split's
slowest stage holds 7 (7% over the balance). The halves (44% and 56% of a GPT-1.3B block at 4 x 512
tokens on the A100 preset) let it come within a fraction of a block. The split keeps halves only where they lower the slowest stage's time by
more than :data:`SPLIT_GAIN`.

Any layer-level model with ``stage_cost(kinds, b, E, D)`` and ``layer_kinds()`` works: the analytic model does (and
prices the halves), a profile's tables price whole blocks.
"""

from __future__ import annotations

import numpy as np

from dynabatch.cost.model_specs import BLOCK_HALVES, BLOCK_KINDS, join_halves, split_halves
from dynabatch.cost.stages import StageLayout

SPLIT_GAIN = 0.01
"""A split inside a block is kept only where it lowers the slowest stage's time by more than this fraction."""
SPLIT_ROUNDS = 3
"""Layer splits balanced at most over a dynamic planner's micro-batches, each over the plan made under the previous
one, the one its plans are predicted fastest under kept (``dynabatch plan`` / ``simulate``'s
``commands.common.split_from_data`` and ``train``'s ``training.run_layout.choose_run_layout``): the planner keeps the
DP's plan or a baseline's, whichever is predicted faster under the split, so a split balanced over one plan can make
another the faster one, which a split balanced over it serves better."""


def balanced_layout(model, num_stages: int, ref_shape: tuple[int, int, int] = (4, 512, 128),
                    micro_batches=None, split_blocks: bool = False) -> StageLayout:
    """Cut ``model.layer_kinds()`` into ``num_stages`` contiguous stages minimising the slowest stage.

    Time is fwd + bwd at ``ref_shape`` (b, E, D), or with ``micro_batches`` (``(shapes, pairs)`` of each
    plan of sampled global batches: ``(M, 3)`` shapes and their attention pairs, ``None`` for dense) summed
    over every micro-batch: the split balanced over the run's own length distribution, so encoder-heavy and
    decoder-heavy micro-batches weigh as often as they occur. Cut points fall only just before a transformer
    block (embeddings and the head attach to their neighbouring block), so each stage holds >= 1 block.
    ``split_blocks``: cuts may also fall between a block's halves (module docstring); the layer model must
    price the halves (the analytic model does, profiled tables do not).
    """
    kinds = list(model.layer_kinds())
    whole = _cut(kinds, layer_times(model, kinds, ref_shape, micro_batches), num_stages)
    if not split_blocks or not any(k in BLOCK_HALVES for k in kinds):
        return StageLayout(whole)
    halves = split_halves(kinds)
    if not set(halves) <= set(model_kinds(model)):
        raise ValueError(f"{type(model).__name__} does not price block halves (gpt_attn, gpt_mlp); cutting inside "
                         "blocks needs the analytic cost model (with a cost profile use --split-blocks auto or off)")
    times = layer_times(model, halves, ref_shape, micro_batches)
    halved = _cut(halves, times, num_stages)
    slowest = [max(_stage_times(model, stages, _queries(kinds, ref_shape, micro_batches))) for stages in (whole, halved)]
    if slowest[1] < (1 - SPLIT_GAIN) * slowest[0]:
        return StageLayout(tuple(join_halves(s) for s in halved))
    return StageLayout(whole)


def rebalanced_layout(start, micro_batches_under, balance, predicted=None, rounds: int = SPLIT_ROUNDS):
    """The layer split balanced over the micro-batches planned under ``start`` and, with ``predicted``, balanced
    again over those planned under each new split, up to ``rounds`` splits (:data:`SPLIT_ROUNDS`): the split
    ``predicted(layout)`` (seconds, lower is better; the first on a tie) deems fastest. ``micro_batches_under(layout)``
    gives what ``balance(micro_batches)`` balances a layout over; either of it and ``predicted`` returns ``None`` where
    the method cannot plan under that split (the search stops there). Without ``predicted`` (a baseline, whose
    micro-batches do not depend on the split) one balancing. ``None`` when nothing could be planned."""
    layout, best, best_s, seen = start, None, None, set()
    for _ in range(rounds if predicted is not None else 1):
        micro_batches = micro_batches_under(layout)
        if micro_batches is None:
            break
        layout = balance(micro_batches)
        if layout in seen:
            break
        seen.add(layout)
        if predicted is None:
            return layout
        seconds = predicted(layout)
        if seconds is None:
            break
        if best_s is None or seconds < best_s:
            best, best_s = layout, seconds
    return best


def model_kinds(model) -> tuple[str, ...]:
    """Every layer kind the layer model prices: its ``priced_kinds()`` where it has one (the analytic model, which
    prices block halves too), else the kinds of its model."""
    priced = getattr(model, "priced_kinds", None)
    return tuple(priced() if priced is not None else model.layer_kinds())


def _stage_times(model, stages, queries) -> list[float]:
    """fwd + bwd seconds of each stage of ``stages`` summed over ``queries`` (:func:`_queries`)."""
    return [sum(float(np.sum(_time(model.stage_cost(list(kinds), *shape, **extra)))) for shape, extra in queries)
            for kinds in stages]


def _queries(kinds, ref_shape, micro_batches) -> list:
    """The ``((b, E, D), extra kwargs)`` queries of a layer time for a model of ``kinds``: one at ``ref_shape``,
    or one per plan of ``micro_batches`` (array shapes, with their pairs); ``D`` is None for a decoder-only model."""
    seq2seq = "t5_decoder" in kinds
    if micro_batches is None:
        b, e, d = ref_shape
        return [((b, e, d if seq2seq else None), {})]
    out = []
    for shapes, pairs in micro_batches:
        b, e, d = (np.asarray(x, dtype=np.int64) for x in np.asarray(shapes).reshape(-1, 3).T)
        out.append(((b, e, d if seq2seq else None), {} if pairs is None else {"pairs": pairs}))
    return out


def cyclic_layout(model, num_devices: int, ref_shape: tuple[int, int, int] = (4, 512, 128),
                  micro_batches=None) -> StageLayout:
    """A T5's ``2 x num_devices`` chunks for the cyclic placement: the encoder cut into ``num_devices``
    balanced chunks, then the decoder likewise (device ``d`` holds encoder chunk ``d`` and decoder chunk
    ``d``, :class:`~dynabatch.schedule.placement.Placement`). Every device then gets about ``1/S`` of the
    encoder's and ``1/S`` of the decoder's work of every micro-batch, whatever its input and target lengths:
    balanced per micro-batch, which no contiguous split of the whole model is."""
    kinds = list(model.layer_kinds())
    if "decoder_embedding" not in kinds:
        raise ValueError("the cyclic placement puts an encoder and a decoder chunk on every device; this model has "
                         "no decoder (use interleaved:V for a decoder-only model)")
    seam = kinds.index("decoder_embedding")
    times = layer_times(model, kinds, ref_shape, micro_batches)
    return StageLayout(_cut(kinds[:seam], times[:seam], num_devices) + _cut(kinds[seam:], times[seam:], num_devices))


def placement_layout(model, placement, micro_batches=None, ref_shape: tuple[int, int, int] = (4, 512, 128),
                     split_blocks: bool = False) -> StageLayout:
    """The chunks of ``placement`` (a :class:`~dynabatch.schedule.placement.Placement`): :func:`cyclic_layout`
    for the cyclic placement, else :func:`balanced_layout` into its ``num_stages`` chunks (``split_blocks``: cuts
    may fall inside blocks); balanced at ``ref_shape`` or over ``micro_batches``."""
    if placement.kind == "cyclic":
        return cyclic_layout(model, placement.num_devices, ref_shape, micro_batches)
    return balanced_layout(model, placement.num_stages, ref_shape, micro_batches, split_blocks)


def layer_times(model, kinds: list[str], ref_shape, micro_batches) -> np.ndarray:
    """fwd + bwd seconds of each layer kind in ``kinds``: at ``ref_shape`` or summed over ``micro_batches``
    (see :func:`balanced_layout`)."""
    return np.array(_stage_times(model, [[k] for k in kinds], _queries(kinds, ref_shape, micro_batches)))


def _cut(kinds: list[str], layer_time: np.ndarray, num_stages: int) -> tuple[tuple[str, ...], ...]:
    """``kinds`` cut into ``num_stages`` contiguous parts minimising the largest summed ``layer_time``; cuts
    only just before a transformer block (the first block owns the layers before it)."""
    blocks = [i for i, k in enumerate(kinds) if k in BLOCK_KINDS]
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_stages > len(blocks):
        raise ValueError(
            f"{num_stages} pipeline stages but the model has only {len(blocks)} transformer blocks; "
            f"use at most {len(blocks)} stages"
        )
    starts = [0] + blocks[1:]
    bounds = starts + [len(kinds)]
    unit_time = np.array([layer_time[bounds[u] : bounds[u + 1]].sum() for u in range(len(starts))])
    cuts = _min_max_partition(unit_time, num_stages)
    return tuple(tuple(kinds[bounds[a] : bounds[z]]) for a, z in zip(cuts[:-1], cuts[1:]))


def _time(cost):
    """fwd + bwd seconds (an array for array shapes)."""
    return np.asarray(cost.fwd_time_s) + np.asarray(cost.bwd_time_s)


def _min_max_partition(weights: np.ndarray, parts: int) -> list[int]:
    """Cut points ``0 = c_0 < ... < c_parts = n`` minimising the largest part sum (exact O(parts n^2) DP)."""
    n = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    best = np.full((parts + 1, n + 1), np.inf)
    arg = np.zeros((parts + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for p in range(1, parts + 1):
        for j in range(p, n - (parts - p) + 1):
            for i in range(p - 1, j):
                v = max(best[p - 1, i], prefix[j] - prefix[i])
                if v < best[p, j]:
                    best[p, j], arg[p, j] = v, i
    cuts = [n]
    for p in range(parts, 0, -1):
        cuts.append(int(arg[p, cuts[-1]]))
    return cuts[::-1]
