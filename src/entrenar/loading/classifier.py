"""Loading a sequence classifier: what ``entrenar.load`` gives for ``task="classification"``.

Three sources: a transformers ``*ForSequenceClassification`` folder (its head and ``classifier.json`` as saved),
a language model with a fresh head (``num_labels``, drawn from ``seed``), or a language model with an adapter
saved for ``task_type: SEQ_CLS`` (its head inside the adapter, as PEFT's ``modules_to_save`` keeps it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from entrenar.adapters.lora import ADAPTER_WEIGHTS, PEFT_PREFIX, load_adapter
from entrenar.data.tokenizer import Tokenizer, require_tokenizer
from entrenar.device import resolve_device, resolve_dtype
from entrenar.errors import AdapterError, ConfigError, ModelError, QuantError
from entrenar.models.classifier import (
    SequenceClassifier,
    from_backbone,
    is_classifier_folder,
    load_classifier_folder,
    read_classifier_info,
)

if TYPE_CHECKING:
    import torch

    from entrenar.models.transformer import Transformer

# (path, dtype=, device=, quantize=) -> (language model, tokenizer): how the backbone of a fresh head is loaded.
LoadLanguageModel = Callable[..., "tuple[Transformer, Tokenizer | None]"]


def load_classifier(path: str | Path, load_backbone: LoadLanguageModel, adapter: str | Path | None = None,
                    dtype: str | torch.dtype | None = None, device: str | torch.device | None = None,
                    quantize: str | None = None, num_labels: int | None = None, pooling: str = "last",
                    seed: int = 0) -> tuple[SequenceClassifier, Tokenizer]:
    """A classifier folder, or a language model (loaded by ``load_backbone``) with a fresh head (``num_labels``)
    or with a SEQ_CLS adapter's head, in eval mode.

    ``entrenar.load`` passes itself as ``load_backbone``: the front door dispatches here, so this module does not
    import it back.
    """
    path = Path(path)
    device = resolve_device(device)
    if is_classifier_folder(path):
        if quantize is not None:
            raise QuantError(f"{path}: quantize={quantize!r} is for a language model's linear layers; load the "
                             "classifier unquantized")
        model = load_classifier_folder(path, resolve_dtype(dtype, device), device)
        tokenizer = Tokenizer.from_folder(path)
        if num_labels is not None and num_labels != model.num_labels:
            raise ModelError(f"{path}: the classifier has {model.num_labels} labels, num_labels={num_labels} was asked")
    else:
        lm, backbone_tokenizer = load_backbone(path, dtype=dtype, device=device, quantize=quantize)
        tokenizer = require_tokenizer(backbone_tokenizer, path)  # its pad id is the classifier's
        info = read_classifier_info(adapter) if adapter is not None else {}
        if adapter is not None:
            num_labels = adapter_num_labels(adapter)
            pooling = info.get("pooling", pooling)
        if num_labels is None:
            raise ConfigError(f"{path}: a language model needs num_labels to become a classifier")
        model = from_backbone(lm, num_labels, pooling, seed)
        model.info = info
    if adapter is not None:
        load_adapter(model, adapter)
        model.info = {**model.info, **read_classifier_info(adapter)}
    model.info.setdefault("pad_token_id", padding_id(tokenizer))
    return model.eval(), tokenizer


def adapter_num_labels(adapter: str | Path) -> int:
    """The number of labels of a SEQ_CLS adapter: the rows of the ``score`` head it holds."""
    with safe_open(str(Path(adapter) / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safetensors file handle is not iterable)
            if key.removeprefix(PEFT_PREFIX).split(".")[0] == "score":
                return int(f.get_slice(key).get_shape()[0])
    raise AdapterError(f"{adapter}: a SEQ_CLS adapter without the 'score' head weight")


def padding_id(tokenizer: Tokenizer) -> int:
    """The id a classifier's batches pad with: the tokenizer's pad token, else its (first) EOS, else 0."""
    if tokenizer.pad_id is not None:
        return tokenizer.pad_id
    return tokenizer.eos_ids[0] if tokenizer.eos_ids else 0
