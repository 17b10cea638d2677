"""Small model configurations that run on a CPU, and loading of local checkpoints (bottom floor).

``build_config("t5-tiny")`` returns a Hugging Face config; ``build_model(name_or_path)`` returns a
randomly initialised model for a preset name, or ``from_pretrained`` of a local directory. A preset
is data only (an HF ``model_type`` and config fields), so this module knows no model family: the
family registry (:mod:`dynabatch.models.families`) lists which presets belong to which family and
checks that a loaded config is supported. ``cost/`` and ``models/`` both import this module.
Vocabulary and special ids default to the built-in offline tokenizer (pad 0, eos 1, unk 2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from dynabatch.core.sequence import CAUSAL, SEQ2SEQ

BUILTIN_VOCAB_SIZE = 8192
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2


@dataclass(frozen=True)
class ModelPreset:
    """A named model shape: a Hugging Face ``model_type`` and the config fields that give its shape."""

    model_type: str
    """The HF ``model_type`` (``t5``, ``gpt2``, ``llama``, ...)."""
    fields: dict = field(default_factory=dict)
    """Config fields of the shape (widths, depths, heads)."""
    dropout_fields: tuple[str, ...] = ()
    """Config fields that ``build_config(dropout=...)`` sets."""
    sequence_kind: str = CAUSAL
    """``seq2seq`` (encoder-decoder) or ``causal``."""


_SPECIAL_IDS = dict(pad_token_id=PAD_ID, eos_token_id=EOS_ID, use_cache=False)


def _t5(d_model: int, num_layers: int, num_heads: int, d_ff: int) -> ModelPreset:
    fields = dict(d_model=d_model, d_kv=d_model // num_heads, d_ff=d_ff, num_layers=num_layers,
                  num_decoder_layers=num_layers, num_heads=num_heads, decoder_start_token_id=PAD_ID,
                  feed_forward_proj="relu", tie_word_embeddings=True, **_SPECIAL_IDS)
    return ModelPreset("t5", fields, ("dropout_rate",), SEQ2SEQ)


def _gpt2(d_model: int, num_layers: int, num_heads: int, d_ff: int, max_positions: int = 4096) -> ModelPreset:
    fields = dict(n_positions=max_positions, n_embd=d_model, n_layer=num_layers, n_head=num_heads, n_inner=d_ff,
                  bos_token_id=EOS_ID, **_SPECIAL_IDS)
    return ModelPreset("gpt2", fields, ("resid_pdrop", "embd_pdrop", "attn_pdrop"))


def _llama(d_model: int, num_layers: int, num_heads: int, num_kv_heads: int, d_ff: int) -> ModelPreset:
    """A Llama-3-style decoder: GQA, RMSNorm, gated SiLU MLP, rotary positions, untied head."""
    fields = dict(hidden_size=d_model, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, intermediate_size=d_ff, max_position_embeddings=4096,
                  rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=EOS_ID, **_SPECIAL_IDS)
    return ModelPreset("llama", fields, ("attention_dropout",))


PRESETS: dict[str, ModelPreset] = {
    "t5-tiny": _t5(64, 2, 4, 128),
    "t5-mini": _t5(128, 4, 4, 512),
    "t5-small": _t5(512, 6, 8, 2048),
    "gpt2-tiny": _gpt2(64, 2, 4, 256),
    "gpt2-mini": _gpt2(128, 4, 4, 512),
    "gpt2-small": _gpt2(768, 12, 12, 3072),
    "llama-tiny": _llama(64, 2, 4, 2, 128),
    # The benchmark models of `dynabatch bench --model t5 / gpt / llama` (issue 9's "small T5, about
    # d_model 256, 4+4 layers", a GPT-2 of similar size: 8 blocks, and a Llama-3-style decoder of about
    # the same parameters: 8 blocks, 4 query / 2 key-value heads, gated MLP 688 wide, untied head).
    "t5-d256": _t5(256, 4, 4, 1024),
    "gpt2-d256": _gpt2(256, 8, 4, 1024),
    "llama-d256": _llama(256, 8, 4, 2, 688),
    # gpt2-d256 with a position table of 8,192 (its own stops at 4,096): the long-sample CPU benchmark's GPT at
    # an 8k-token limit (docs/benchmarks/long_tail/); the same blocks, 1M more embedding parameters.
    "gpt2-d256-8k": _gpt2(256, 8, 4, 1024, max_positions=8192),
}


FAMILY_PRESETS = {"t5": "t5-d256", "gpt": "gpt2-d256", "gpt2": "gpt2-d256", "llama": "llama-d256"}
"""``--model t5`` / ``gpt`` / ``llama`` in train, bench and profile: the family's benchmark preset."""


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""What ``save_pretrained`` writes for the weights (one file, or an index of shards)."""
_FOLDER_HINT = "pass a folder written by save_pretrained (config.json and the weights)"


def model_problem(name_or_path: str) -> str | None:
    """Why ``--model name_or_path`` names no model a run can load (one line), from the file system alone (no
    import of transformers: the launcher of a multi-rank run checks it once): a folder without ``config.json`` or
    without weights, a file, a path that does not exist, an unknown preset. ``None`` when it may load."""
    presets = f"or a preset ({', '.join(PRESETS)}; a family: {', '.join(FAMILY_PRESETS)})"
    if os.path.isdir(name_or_path):
        names = set(os.listdir(name_or_path))
        if "config.json" not in names:
            return f"--model {name_or_path!r}: the folder holds no config.json; {_FOLDER_HINT}, {presets}"
        if not names & set(WEIGHT_FILES):
            return (f"--model {name_or_path!r}: the folder holds config.json but no weights ({' or '.join(WEIGHT_FILES[::2])}); "
                    f"{_FOLDER_HINT}")
        return None
    if os.path.exists(name_or_path):
        return f"--model {name_or_path!r} is a file, not a model folder; {_FOLDER_HINT}, {presets}"
    if FAMILY_PRESETS.get(name_or_path, name_or_path) in PRESETS:
        return None
    if os.sep in name_or_path or name_or_path.startswith((".", "~")):
        return f"--model {name_or_path!r}: no such folder (nothing is downloaded); {_FOLDER_HINT}, {presets}"
    return _unknown_preset(name_or_path)


def _type_and_fields(name_or_path: str) -> tuple[str, dict, str] | None:
    """The ``model_type``, config fields and sequence kind of a preset, or of a model folder's ``config.json`` read
    as JSON (no import of transformers; its ``is_encoder_decoder``, which Hugging Face writes for T5, says
    ``seq2seq``); ``None`` when neither tells them."""
    if os.path.isdir(name_or_path):
        try:
            with open(os.path.join(name_or_path, "config.json"), encoding="utf-8") as f:
                fields = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(fields, dict):
            return None
        return str(fields.get("model_type", "this")), fields, SEQ2SEQ if fields.get("is_encoder_decoder") else CAUSAL
    preset = PRESETS.get(FAMILY_PRESETS.get(name_or_path, name_or_path))
    return (preset.model_type, preset.fields, preset.sequence_kind) if preset is not None else None


def sequence_kind(name_or_path: str) -> str | None:
    """``seq2seq`` or ``causal`` for ``--model``: a preset's, or a folder's with a ``model_type``, told from the file
    system alone (:func:`_type_and_fields`); ``None`` when it cannot tell."""
    found = _type_and_fields(name_or_path)
    return None if found is None or found[0] == "this" else found[2]


def num_blocks(name_or_path: str) -> tuple[str, int] | None:
    """The ``model_type`` of ``--model name_or_path`` and its transformer blocks (an encoder-decoder's encoder and
    decoder blocks together), from a preset's fields or the folder's ``config.json`` alone (no import of
    transformers: the launcher checks ``--stages`` against it once); ``None`` when they cannot be told so (the
    ranks check it on the loaded model)."""
    found = _type_and_fields(name_or_path)
    if found is None:
        return None
    model_type, fields, kind = found
    if kind == SEQ2SEQ and isinstance(fields.get("num_layers"), int):
        decoder = fields.get("num_decoder_layers")
        return model_type, fields["num_layers"] + (decoder if isinstance(decoder, int) else fields["num_layers"])
    for key in ("n_layer", "num_hidden_layers"):
        if isinstance(fields.get(key), int):
            return model_type, fields[key]
    return None


def stages_line(model_type: str, blocks: int, stages: int) -> str:
    """The one line for ``--stages`` outside ``1 ..`` the model's transformer blocks (every stage holds one)."""
    hint = f"use --stages {blocks} or fewer, or a model with more blocks" if stages > blocks else "use --stages 1 or more"
    return (f"--stages must be between 1 and the number of transformer blocks of this {model_type} model ({blocks}), "
            f"got {stages}; {hint}")


def stages_problem(name_or_path: str, stages: int) -> str | None:
    """The line of :func:`stages_line` when ``--model name_or_path`` has fewer transformer blocks than ``stages``,
    told from the file system alone (:func:`num_blocks`); ``None`` otherwise, or when that cannot tell."""
    shape = num_blocks(name_or_path)
    return stages_line(*shape, stages) if shape is not None and stages > shape[1] else None


def _unknown_preset(name: str) -> str:
    return (f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}, a family "
            f"({', '.join(FAMILY_PRESETS)}) or a local checkpoint dir")


def build_config(name: str, vocab_size: int = BUILTIN_VOCAB_SIZE, dropout: float = 0.0,
                 special_ids: dict[str, int] | None = None):
    """The Hugging Face config of a preset (or a family name of :data:`FAMILY_PRESETS`). ``dropout`` applies to
    every dropout in the model; ``special_ids`` (``pad_token_id``, ``eos_token_id``, ``decoder_start_token_id``,
    ``bos_token_id``: the run's tokenizer's) replace the built-in tokenizer's where the preset sets them."""
    from transformers import AutoConfig

    name = FAMILY_PRESETS.get(name, name)
    if name not in PRESETS:
        raise ValueError(_unknown_preset(name))
    p = PRESETS[name]
    fields = {**p.fields, **{k: v for k, v in (special_ids or {}).items() if k in p.fields}}
    return AutoConfig.for_model(p.model_type, vocab_size=vocab_size, **fields,
                                **{key: dropout for key in p.dropout_fields})


def model_class(config):
    """The HF auto class for ``config``: ``AutoModelForSeq2SeqLM`` for encoder-decoders, else causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM


def load_config(name_or_path: str, vocab_size: int = BUILTIN_VOCAB_SIZE, dropout: float = 0.0):
    """The config of a preset name or of a local checkpoint directory (without loading weights)."""
    if os.path.isdir(name_or_path):
        from transformers import AutoConfig

        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            raise ValueError(model_problem(name_or_path))
        try:
            return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
        except (OSError, ValueError) as e:  # unreadable JSON, an unknown model_type
            raise ValueError(f"--model {name_or_path!r}: its config.json cannot be loaded "
                             f"({' '.join(str(e).split())[:300]}); {_FOLDER_HINT}") from None
    if (problem := model_problem(name_or_path)) is not None:
        raise ValueError(problem)
    return build_config(name_or_path, vocab_size=vocab_size, dropout=dropout)


DROPOUT_FIELDS = tuple(dict.fromkeys(key for p in PRESETS.values() for key in p.dropout_fields))
"""Every config field a preset's ``dropout`` sets (T5's ``dropout_rate``, GPT-2's three, Llama-style
``attention_dropout``): the fields ``--dropout`` sets in a model folder's config too."""


def folder_dropout(config) -> dict[str, float]:
    """The dropout fields of a model folder's ``config`` (:data:`DROPOUT_FIELDS` it has) and their values.

    ``build_model`` sets them to the run's ``dropout``: the run prices dropout masks in memory, seeds them and
    records ``--dropout`` from that one value, so a folder's own rate (T5's and GPT-2's configs default to 0.1)
    left in place would train with dropout the run believes is off, or ignore ``--dropout``."""
    return {key: getattr(config, key) for key in DROPOUT_FIELDS if hasattr(config, key)}


def describe_dropout(model: str, dropout: float) -> str | None:
    """A log line when ``--dropout`` replaces another rate in the ``model`` folder's config, else ``None``."""
    if not os.path.isdir(model):
        return None
    other = {k: v for k, v in folder_dropout(load_config(model)).items() if v != dropout}
    if not other:
        return None
    given = ", ".join(f"{k} {v}" for k, v in other.items())
    return (f"model {model}: dropout {dropout} (--dropout) in place of its config's {given}; pass --dropout with "
            "the config's rate to train with it")


UNSET_IDS_FILLED = ("eos_token_id",)
"""Special ids a model folder's config may leave unset (``Qwen2Config()`` has no ``eos_token_id``) that
:func:`build_model` takes from the run's tokenizer before it builds the model: without EOS the exported model's
``generate`` never stops. The pad id is filled after (:data:`PAD_FILLED_AFTER_BUILD`)."""
PAD_FILLED_AFTER_BUILD = "pad_token_id"
"""An unset ``pad_token_id`` of a model folder's config takes the run tokenizer's pad (its EOS where it has no pad
token, as training pads) once the model is built, as Hugging Face users set ``model.config.pad_token_id =
tokenizer.eos_token_id``: a Llama-style model built with it would make that row its embedding's ``padding_idx``,
which then trains no more. The exported config and generation config hold it (batched ``generate`` and
``AutoModelForSequenceClassification`` need it)."""


def describe_unset_pad(model: str, pad_id: int) -> str | None:
    """The log line when the ``model`` folder's config leaves ``pad_token_id`` unset and the run sets it to the
    tokenizer's ``pad_id`` (:data:`PAD_FILLED_AFTER_BUILD`), else ``None``."""
    if not os.path.isdir(model) or getattr(load_config(model), PAD_FILLED_AFTER_BUILD, None) is not None:
        return None
    return (f"model {model}: its config has no pad_token_id; the run pads with the tokenizer's pad {pad_id} (its EOS "
            "where it has no pad token) and the exported config holds it; set pad_token_id in its config.json to "
            "choose another")


def build_model(name_or_path: str, vocab_size: int = BUILTIN_VOCAB_SIZE, dropout: float = 0.0, seed: int = 0,
                special_ids: dict[str, int] | None = None):
    """A preset built from config (random init, seeded; ``special_ids`` as :func:`build_config`) or a local
    checkpoint directory, loaded in fp32 whatever dtype its weights were saved in, with ``dropout`` in its config
    (:func:`folder_dropout`) and the ``special_ids`` of :data:`UNSET_IDS_FILLED` and :data:`PAD_FILLED_AFTER_BUILD`
    where its config leaves them unset.

    ``from_pretrained`` keeps a bf16/fp16 checkpoint's own dtype (transformers 5 loads ``dtype="auto"``); a run
    would then keep bf16 master weights and AdamW states that lose most small updates, while ``--dtype`` and the
    memory model say fp32 weights (bf16/fp16 are autocast over them). Loading in fp32 is what ``--dtype`` promises."""
    import torch

    if os.path.isdir(name_or_path):
        config = load_config(name_or_path)
        for key in folder_dropout(config):
            setattr(config, key, dropout)
        filled = {key: special_ids[key] for key in UNSET_IDS_FILLED  # without EOS an export's generate never stops
                  if getattr(config, key, None) is None and key in (special_ids or {})}
        for key, value in filled.items():
            setattr(config, key, value)
        model = model_class(config).from_pretrained(name_or_path, config=config, local_files_only=True,
                                                    dtype=torch.float32)
        pad = PAD_FILLED_AFTER_BUILD
        if getattr(config, pad, None) is None and pad in (special_ids or {}):  # after the embedding is built
            filled[pad] = model.config.pad_token_id = special_ids[pad]
        for key, value in filled.items():  # the folder's generation_config.json leaves it unset too
            if getattr(model.generation_config, key, None) is None:
                setattr(model.generation_config, key, value)
        return model
    config = build_config(name_or_path, vocab_size=vocab_size, dropout=dropout, special_ids=special_ids)
    torch.manual_seed(seed)
    return model_class(config).from_config(config)
