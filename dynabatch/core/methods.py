"""Batching methods: the dynamic planner and the baseline batchers, each name registered once.

``dynamic`` plans micro-batches with the cost model (:mod:`dynabatch.plan`); ``dynamic_sliced`` is the same
planner allowed to cut long decoder-only samples into token slices (TeraPipe; ``train --slice-long``). Each
baseline cuts a global batch by a fixed rule, and its batcher, knob and tuning grid live in
:data:`dynabatch.data.baselines.BASELINES`, keyed by the names here. ``--method`` choices and
``DynaBatchDataLoader(method=...)`` read :data:`METHODS`; the method lists of ``plan``, ``simulate`` and ``bench``
read :data:`COMPARED_METHODS` (the same names plus ``dynamic_sliced``).

Two properties of a method are kept here, next to its name, so that every command checks and labels them alike:
:data:`CAUSAL_ONLY` (token slices and split rows cut a decoder-only sequence; an encoder-decoder model has no such
cut, so T5 refuses them with one line, :func:`check_method_family`) and :data:`CHANGES_OBJECTIVE` (a method that
trains on something other than the whole samples: its loss is not comparable, and every table says so).
"""

from __future__ import annotations

from dynabatch.core.registry import Registry
from dynabatch.core.sequence import is_seq2seq

DYNAMIC, DYNAMIC_SLICED = "dynamic", "dynamic_sliced"
PADDING, LENGTH_GROUPED, TOKEN_BUDGET, PACKING, PACKING_FREE, PACKING_FREE_SPLIT = (
    "padding", "length_grouped", "token_budget", "packing", "packing_free", "packing_free_split")

BASELINE_METHODS = Registry("baseline method", [
    (PADDING, "fixed samples per micro-batch in stream order, padded to the micro-batch max"),
    (LENGTH_GROUPED, "sorted by length, then fixed samples per micro-batch (HF group_by_length)"),
    (TOKEN_BUDGET, "sorted, as many samples as fit a padded-token budget (fairseq max_tokens)"),
    (PACKING, "best-fit-decreasing rows of the max length, dense block-diagonal masks (DynaPipe's baseline)"),
    (PACKING_FREE, "the same rows, padding-free, attention per sample (TRL packing with padding_free)"),
    (PACKING_FREE_SPLIT, "padding-free rows of a tuned length, samples longer than a row split into row-length "
                         "chunks, each its own sequence (TRL bfd_split; CHANGES THE OBJECTIVE: later chunks train "
                         "without their context; decoder-only)"),
])
"""The baseline batchers, in the order commands list them."""

PLANNER_METHODS = Registry("batching method", [
    (DYNAMIC, "the planner"),
    (DYNAMIC_SLICED, "the planner, allowed to cut long samples into token slices (decoder-only; train --slice-long)"),
])
"""The dynamic planner's methods."""

METHODS = Registry("batching method", [(DYNAMIC, PLANNER_METHODS.help(DYNAMIC))]) + BASELINE_METHODS
"""The methods ``train --method`` and the data loader take: ``dynamic`` (token slicing is ``--slice-long``) then
the baselines."""

COMPARED_METHODS = PLANNER_METHODS + BASELINE_METHODS
"""The methods ``plan``, ``simulate`` and ``bench`` compare, under the same names: both planner methods, then the
baselines."""

CAUSAL_ONLY = frozenset({DYNAMIC_SLICED, PACKING_FREE_SPLIT})
"""Methods that cut a decoder-only sequence (token slices, split rows); encoder-decoder models refuse them."""

CHANGES_OBJECTIVE = {
    PACKING_FREE_SPLIT: "splits samples longer than a row: later chunks train without their context, a different "
                        "objective (its loss is not comparable; its speed is not a whole-sample method's)",
}
"""Methods that do not train on the whole samples, and why (shown beside their rows)."""


def is_planner(method: str) -> bool:
    """``dynamic`` or ``dynamic_sliced``: planned by the cost-model planner."""
    return method in PLANNER_METHODS


def check_method_family(method: str, sequence_kind: str, model: str = "", subject: str = "") -> None:
    """One clear ``ValueError`` when ``method`` cuts decoder-only sequences and the model is encoder-decoder.
    ``subject`` says what is encoder-decoder where there is no model (``data-report``: its ``--family``)."""
    if method in CAUSAL_ONLY and is_seq2seq(sequence_kind):
        what = "token slices" if method == DYNAMIC_SLICED else "split rows"
        subject = subject or f"{model or 'this model'} is an encoder-decoder model"
        raise ValueError(f"method {method!r} cuts decoder-only sequences ({what}); {subject}: drop {method} from "
                         f"--methods (use "
                         f"{'dynamic' if method == DYNAMIC_SLICED else 'packing_free or --overlong truncate'})")


def methods_for(sequence_kind: str, methods=COMPARED_METHODS) -> list[str]:
    """``methods`` that a model of ``sequence_kind`` can run (the default method list of a command)."""
    return [m for m in methods if not (m in CAUSAL_ONLY and is_seq2seq(sequence_kind))]


def objective_note(method: str) -> str:
    """``""``, or why ``method``'s loss is not comparable (a different objective)."""
    return CHANGES_OBJECTIVE.get(method, "")


def whole_sample_baselines(sequence_kind: str) -> list[str]:
    """The baselines a model of ``sequence_kind`` runs that train on whole samples: every one but those that change
    the objective (``packing_free_split``, which is decoder-only besides)."""
    return [m for m in methods_for(sequence_kind, BASELINE_METHODS) if not objective_note(m)]
