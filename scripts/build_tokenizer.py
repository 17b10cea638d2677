"""Build the offline default tokenizer shipped at ``dynabatch/assets/tokenizer/``.

Byte-level BPE (``tokenizers``), trained on text from the built-in generators
(``dynabatch.data.builtin``: every task, ``--examples-per-task`` rows each, seed 12345), vocabulary
of exactly 8192 tokens with the specials at fixed ids ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2
(T5 convention: the decoder starts from pad). No normalizer and no post-processor: encoding adds no
special tokens (the data pipeline appends EOS itself) and ``decode(encode(text)) == text``.

Deterministic: the same generators give byte-identical ``tokenizer.json`` (checked by running twice).

Rebuild from the repository root::

    .venv/bin/python scripts/build_tokenizer.py

Options: ``--out DIR`` (default ``dynabatch/assets/tokenizer``), ``--examples-per-task N`` (300).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from dynabatch.data.builtin import BUILTIN_TASKS, DEFAULT_TOKENIZER_DIR, generate_examples  # noqa: E402

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2
CORPUS_SEED = 12345


def corpus(examples_per_task: int) -> list[str]:
    """Inputs and targets of every built-in task, in a fixed order."""
    texts = []
    for task in sorted(BUILTIN_TASKS):
        for row in generate_examples(task, examples_per_task, CORPUS_SEED):
            texts.append(row["inputs"])
            texts.append(row["targets"])
    return texts


def train(texts: list[str]) -> Tokenizer:
    """Train the byte-level BPE model; specials come first so they get ids 0, 1, 2."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def save(tokenizer: Tokenizer, out: Path) -> None:
    """Write tokenizer.json (no post-processor) and tokenizer_config.json (specials, no clean-up)."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # save_pretrained writes a no-op TemplateProcessing; store none at all, and the class name that
    # both transformers 4 and 5 resolve to their fast tokenizer.
    tokenizer.post_processor = None
    tokenizer.save(str(out / "tokenizer.json"))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def check(out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert len(tok) == VOCAB_SIZE, len(tok)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    text = "Definition: Count the cats.\n\nInput: Geazon lives in Goford.  Héllo ✓ 1234 + 5\tx\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text, tok.decode(ids)
    assert ids == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids  # nothing added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER_DIR)
    parser.add_argument("--examples-per-task", type=int, default=300)
    args = parser.parse_args()
    texts = corpus(args.examples_per_task)
    tokenizer = train(texts)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()
    save(tokenizer, args.out)
    check(args.out)
    digest = hashlib.sha256((args.out / "tokenizer.json").read_bytes()).hexdigest()[:16]
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1024:.0f} KiB, {len(texts)} texts, tokenizer.json sha256 {digest})")


if __name__ == "__main__":
    main()
