"""A model as a Hugging Face folder to use elsewhere: weights, config (with the dtype saved), tokenizer and
generation config.

    save_model_folder(model, tokenizer, Path("out"), base=Path("base-model"))   # training, quickstart, export

What a run writes at its end and what ``entrenar export`` writes are the same folder; export adds a GGUF file in it
(:func:`entrenar.export.save_merged`), so the folder is written here, below both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from entrenar.errors import ModelError
from entrenar.io import atomic
from entrenar.io.finite import check_finite
from entrenar.io.json_files import read_json_object as read_object
from entrenar.models.hf import save_hf

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.transformer import Transformer

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def save_model_folder(model: Transformer, tokenizer: Tokenizer | None, output: Path, base: Path | None = None) -> Path:
    """Write a Hugging Face folder at ``output`` (built beside it, renamed into place when complete); return it.

    ``model.config`` gets the dtype the weights are saved in (``dtype`` in config.json), which transformers 5 loads
    them as. ``base`` is the folder the model came from: its generation_config.json (sampling defaults) is kept,
    with the tokenizer's special ids. Without a tokenizer no tokenizer files are written.
    """
    generation = prepare_for_saving(model, tokenizer, output, base)
    with atomic.staged_folder(output) as target:
        write_model_files(model, tokenizer, target, generation)
    return output


def prepare_for_saving(model: Transformer, tokenizer: Tokenizer | None, output: Path,
                       base: Path | None) -> dict[str, Any]:
    """What comes before a folder is staged: refuse non-finite weights, record their dtype in ``model.config``;
    returns the generation config to write."""
    check_finite(model.state_dict(), output, ModelError)  # before the folder is staged or config.dtype changed
    record_dtype(model)
    return generation_config(tokenizer, base)


def record_dtype(model: Transformer) -> None:
    """Write the weights' dtype into ``model.config`` (config.json's ``dtype``), as the folder will hold them."""
    dtype = next(model.parameters()).dtype
    extra = {k: v for k, v in model.config.extra.items() if k != "torch_dtype"}
    model.config = model.config.replace(extra={**extra, "dtype": _DTYPE_NAMES.get(dtype, str(dtype))})


def write_model_files(model: Transformer, tokenizer: Tokenizer | None, target: Path,
                      generation: dict[str, Any]) -> None:
    """The folder's files, into ``target`` (a staged folder)."""
    save_hf(model, target)
    write_beside_weights(tokenizer, target, generation)


def write_beside_weights(tokenizer: Tokenizer | None, target: Path, generation: dict[str, Any]) -> None:
    """What a model folder holds beside its weights and config: the tokenizer's files and generation_config.json."""
    if tokenizer is not None:
        tokenizer.save(target)
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def generation_config(tokenizer: Tokenizer | None, base: Path | None) -> dict[str, Any]:
    """The base's generation_config.json (sampling defaults) with the tokenizer's special ids.

    Several end-of-sequence ids (Llama 3 Instruct stops on three) are written
    as a list, which is how transformers and entrenar's tokenizer read them.
    """
    config: dict[str, Any] = {}
    if base is not None and base.is_dir():
        config = read_json_object(base / "generation_config.json")
    if tokenizer is None:
        config.pop("transformers_version", None)
        return config
    eos = tokenizer.eos_ids
    if tokenizer.bos_id is not None:
        config["bos_token_id"] = tokenizer.bos_id
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "pad_token" in tokenizer.special_tokens:
        config["pad_token_id"] = tokenizer.pad_id
    config.pop("transformers_version", None)
    return config


def read_json_object(path: Path) -> dict[str, Any]:
    """A model folder's optional JSON file as a dict: {} when absent, a ModelError naming it when invalid."""
    return read_object(path) if path.is_file() else {}


__all__ = ["generation_config", "prepare_for_saving", "read_json_object", "save_model_folder", "write_model_files"]
