"""What a checkpoint keeps of its run's model and tokenizer, so that it exports without the folders they came from.

Every checkpoint folder holds ``model/`` (:data:`MODEL_FILES`), written by rank 0 during the save, before the
manifest: the Hugging Face config the run built its model from (``config.json``, with the tokenizer's vocabulary
and special ids and the run's dropout), the generation config where the model has one, and the tokenizer's own
``save_pretrained`` files. A few hundred KB to a few MB; the weights are the checkpoint's. ``dynabatch export``
(:mod:`dynabatch.training.export`) reads them, so moving, editing or deleting the ``--model`` / ``--tokenizer``
folder after training changes nothing. Checkpoints written before this folder existed export from the paths
their manifest records.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

MODEL_FILES = "model"
"""The sub-folder of a checkpoint with the run's model config and tokenizer."""
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class ModelFiles:
    """The run's model config, generation config and tokenizer, as the start of the run built them."""

    config: Any
    """The Hugging Face config of the model the run trains (all stages together)."""
    generation_config: Any
    """The model's ``GenerationConfig``, ``None`` for a model that does not generate."""
    tokenizer: Any
    """The tokenizer the run encodes its data with (before :func:`~dynabatch.data.tokenize.inference_tokenizer`)."""

    @classmethod
    def of(cls, model, tokenizer) -> "ModelFiles":
        """The files of ``model`` (a Hugging Face model) and ``tokenizer``."""
        return cls(model.config, getattr(model, "generation_config", None), tokenizer)

    def write(self, checkpoint_folder: str) -> str:
        """Write them into ``checkpoint_folder/model/`` (``OSError`` as the save's other writes); returns that folder."""
        folder = os.path.join(checkpoint_folder, MODEL_FILES)
        os.makedirs(folder, exist_ok=True)
        self.config.save_pretrained(folder)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        return folder


def read_model_files(checkpoint_folder: str) -> ModelFiles | None:
    """The :class:`ModelFiles` a checkpoint holds, or ``None`` for one written before checkpoints held them."""
    folder = os.path.join(checkpoint_folder, MODEL_FILES)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return None
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    generation = (GenerationConfig.from_pretrained(folder, local_files_only=True)
                  if os.path.isfile(os.path.join(folder, GENERATION_CONFIG)) else None)
    return ModelFiles(config, generation, _saved_tokenizer(folder, AutoTokenizer))


def _saved_tokenizer(folder: str, auto):
    """The tokenizer saved in ``folder``, as the class its ``tokenizer_config.json`` names: ``AutoTokenizer`` takes
    the class of the ``config.json`` beside it instead (transformers 5: a ``Qwen2Tokenizer`` for a qwen2 config, which
    encodes digits and spaces unlike the builtin tokenizer the run trained with), so a run's own tokenizer is
    reloaded as it was saved; ``auto`` (``AutoTokenizer``) where the file names no class transformers has."""
    import transformers

    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return (cls if cls is not None and hasattr(cls, "from_pretrained") else auto).from_pretrained(
        folder, local_files_only=True)
