"""Loading a model to use or train: a Hugging Face folder, a GGUF file, a quantized folder or a training run.

``entrenar.load`` is :func:`load`; run folders resolve through :mod:`entrenar.loading.runs`, classifiers load
through :mod:`entrenar.loading.classifier`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from entrenar.adapters.lora import load_adapter
from entrenar.data.tokenizer import Tokenizer, require_tokenizer
from entrenar.device import resolve_device, resolve_dtype
from entrenar.errors import ConfigError, ModelError, QuantError
from entrenar.loading.classifier import load_classifier
from entrenar.loading.runs import adapter_base_mismatch, apply_checkpoint, resolve_model_and_adapter, run_folder_of
from entrenar.models import classifier as cls
from entrenar.models import random_init
from entrenar.models.config import ModelConfig
from entrenar.models.gguf import load_gguf, read_gguf
from entrenar.models.hf import load_hf, read_config
from entrenar.quant.checkpoint import is_quantized_folder, load_quantized
from entrenar.quant.nf4.sinks import base_sinks

if TYPE_CHECKING:
    import torch

    from entrenar.models.classifier import SequenceClassifier
    from entrenar.models.transformer import Transformer

__all__ = ["load", "read_model_config", "recipe_model_config", "require_tokenizer"]


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder, a GGUF file, a run's model or a Hub id's cached snapshot (fetched
    first when not cached: its weights come too, so the load that follows needs no network), reading no weights."""
    path = resolve_model_and_adapter(path).model
    if path.suffix == ".gguf":  # read_gguf maps tensor names and shapes; reads no tensor data
        return ModelConfig.from_hf(read_gguf(path).hf_config, source=str(path))
    if not path.exists():
        raise ModelError(f"{path}: no such model folder or .gguf file")
    if not path.is_dir():
        raise ModelError(f"{path}: not a model folder or .gguf file")
    return read_config(path)


def _check_vocabulary(path: str | Path, model_vocab_size: int, tokenizer: Tokenizer) -> None:
    """Refuse a tokenizer with ids the model's embedding has no row for.

    Without this, the first such id is an IndexError deep inside the embedding.
    A tokenizer smaller than the embedding is fine: vocabularies are often
    padded to a multiple of 64 or 128.
    """
    if tokenizer.vocab_size > model_vocab_size:
        raise ModelError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{model_vocab_size}; ids from {model_vocab_size} up have no embedding "
            "(mismatched tokenizer and model files?)"
        )


@overload
def load(
    path: str | Path,
    adapter: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    quantize: str | None = None,
    *,
    task: Literal["classification"],
    num_labels: int | None = None,
    pooling: str = "last",
    seed: int = 0,
) -> tuple[SequenceClassifier, Tokenizer]: ...


@overload
def load(
    path: str | Path,
    adapter: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    quantize: str | None = None,
    task: str | None = None,
    num_labels: int | None = None,
    pooling: str = "last",
    seed: int = 0,
) -> tuple[Transformer, Tokenizer | None]: ...


def load(
    path: str | Path,
    adapter: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    quantize: str | None = None,
    task: str | None = None,
    num_labels: int | None = None,
    pooling: str = "last",
    seed: int = 0,
) -> tuple[Transformer, Tokenizer | None]:
    """Load a model and its tokenizer from a Hugging Face folder, a GGUF file, a training run or a Hub id.

    `adapter` is a PEFT-format LoRA adapter folder applied on top. `quantize="nf4"`
    loads every linear layer but the output head straight into NF4 (QLoRA's
    frozen base), one tensor at a time. A folder saved quantized (`entrenar
    quantize`, a QAT run) loads into the same quantized layers. A run folder,
    its `best/` or a `checkpoints/step-N` loads what it stands for
    (:mod:`entrenar.loading.runs`). A name that is not a local path and spells a Hugging Face Hub id
    (``org/name``, ``org/name@revision``, ``org/name/file.gguf``; the same for ``adapter``) loads the cached
    snapshot, fetched first when the Hub is reachable (:mod:`entrenar.io.hub`). A folder without tokenizer.json (what
    `save_pretrained` of a model alone writes) loads with tokenizer None; what
    needs text asks for it with :func:`require_tokenizer`. The model is
    returned in eval mode; call `.train()` to fine-tune it. An `adapter` whose
    adapter_config.json names another base model than `path` is applied with
    a UserWarning naming both (:func:`~entrenar.loading.runs.adapter_base_mismatch`).

    A transformers ``*ForSequenceClassification`` folder loads as a
    :class:`~entrenar.models.classifier.SequenceClassifier` (``model(input_ids,
    attention_mask)`` gives ``[batch, num_labels]`` logits), and so does an
    adapter saved for ``task_type: SEQ_CLS``. ``task="classification"`` with
    ``num_labels`` puts a fresh head (drawn from ``seed``, ``pooling`` last or
    mean) on a language-model checkpoint or GGUF file.
    """
    if task not in (None, "causal_lm", "classification"):
        raise ConfigError(f"task {task!r} must be 'causal_lm' or 'classification'")
    source = resolve_model_and_adapter(path, adapter)
    if adapter is not None and source.adapter is not None:
        _note_other_base(source.adapter, source.model)
    if task == "classification" or (
        task is None and (cls.is_classifier_folder(source.model) or _seq_cls_adapter(source.adapter))
    ):
        return load_classifier(source.model, load, adapter=source.adapter, dtype=dtype, device=device,
                               quantize=quantize, num_labels=num_labels, pooling=pooling, seed=seed)
    model, tokenizer = _load_model(source.model, dtype, device, quantize)
    if source.adapter is not None:
        load_adapter(model, source.adapter)
    if source.checkpoint is not None:
        apply_checkpoint(model, source)
    return model.eval(), tokenizer


def _note_other_base(adapter: Path, model: Path) -> None:
    """Warn when an adapter given beside a model names another base (PEFT loads it silently); one run's own
    pair (its quantized/ folder with its adapter/) is its own business."""
    runs = run_folder_of(adapter), run_folder_of(model)
    if runs[0] is not None and runs[1] is not None and runs[0][0] == runs[1][0]:
        return
    note = adapter_base_mismatch(adapter, model)
    if note is not None:
        warnings.warn(note, stacklevel=3)


def _folder_tokenizer(path: Path) -> Tokenizer | None:
    return Tokenizer.from_folder(path) if (path / "tokenizer.json").is_file() else None


def _seq_cls_adapter(adapter: str | Path | None) -> bool:
    """Whether ``adapter`` is a PEFT adapter saved for sequence classification (``task_type: SEQ_CLS``)."""
    if adapter is None or not (Path(adapter) / "adapter_config.json").is_file():
        return False
    try:
        return json.loads((Path(adapter) / "adapter_config.json").read_text()).get("task_type") == "SEQ_CLS"
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return False


def _load_model(
    path: Path, dtype: str | torch.dtype | None, device: str | torch.device | None, quantize: str | None
) -> tuple[Transformer, Tokenizer | None]:
    path = Path(path)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    tokenizer: Tokenizer | None
    if path.suffix == ".gguf" and path.is_file():
        model, tokenizer = load_gguf(path, dtype=torch_dtype, device=device, sinks=base_sinks(quantize))
        _check_vocabulary(path, model.config.vocab_size, tokenizer)
    elif is_quantized_folder(path):  # written by `entrenar quantize` or a QAT run: codes and scales as saved
        if quantize is not None:
            raise QuantError(f"{path}: the model is already quantized; load it without quantize={quantize!r}")
        tokenizer = _folder_tokenizer(path)
        if tokenizer is not None:
            _check_vocabulary(path, read_model_config(path).vocab_size, tokenizer)  # before any weight is read
        model = load_quantized(path, dtype=torch_dtype, device=device)
    elif path.is_dir():
        tokenizer = _folder_tokenizer(path)
        if tokenizer is not None:
            _check_vocabulary(path, read_model_config(path).vocab_size, tokenizer)
        model = load_hf(path, dtype=torch_dtype, device=device, sinks=base_sinks(quantize))
    elif not path.exists():
        raise ModelError(f"{path}: no such model folder or .gguf file")
    else:
        raise ModelError(f"{path}: not a model folder or .gguf file")
    return model, tokenizer


def recipe_model_config(recipe: Any) -> ModelConfig:
    """A recipe's ModelConfig without reading or drawing weights: from ``model.config`` (random init) or
    ``model.path``."""
    if random_init.is_random(recipe):
        return random_init.model_config(recipe)
    return read_model_config(recipe.model.path)
