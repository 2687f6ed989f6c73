"""Held-out loss and perplexity: the number a fine-tune is judged by."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from entrenar.data import eval_batches, read_records, tokenize_records
from entrenar.data.batching import Batch
from entrenar.data.formats import DATA_FORMATS, split_format
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ModelError
from entrenar.models.loss import token_cross_entropy
from entrenar.models.transformer import compute_device


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int
    examples: int | None = None


def autocast_for(device: torch.device, precision: str, cache: bool = True) -> contextlib.AbstractContextManager:
    """The autocast context of a precision setting (fp32: none). ``cache=False`` for CUDA-graph capture, where
    weights cast once and cached would be freed with the context."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache)


@torch.no_grad()
def eval_loss(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    precision: str = "fp32",
    max_batches: int | None = None,
) -> EvalResult:
    """Mean cross-entropy per target token over `batches` (summed, then divided once)."""
    device = compute_device(model)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    try:
        for i, batch in enumerate(batches):
            if max_batches is not None and i >= max_batches:
                break
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast_for(device, precision):
                logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
            loss_sum, n = token_cross_entropy(logits, batch["labels"])
            total += loss_sum.double()
            tokens += int(n)
    finally:
        model.train(was_training)
    loss = float(total) / max(tokens, 1)
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)), tokens=tokens)


def evaluate_file(
    model: torch.nn.Module,
    tokenizer: Tokenizer | None,
    path: str | Path,
    seq_len: int = 512,
    batch_size: int = 4,
    train_on: str = "all",
    fmt: str = "auto",
    precision: str = "fp32",
    add_eos: bool = True,
    columns: Mapping[str, str] | None = None,
) -> EvalResult:
    """Loss and perplexity of `model` on a data file, masked as training would mask it (`add_eos` as the
    recipe's data.add_eos: whether each text example ends with EOS; `columns` as its data.*_field keys)."""
    if tokenizer is None:
        raise ModelError("the model was loaded without a tokenizer (no tokenizer.json in its folder); "
                         "evaluating a data file needs one")
    file_format, kind = split_format(fmt) if fmt in DATA_FORMATS else (fmt, "auto")  # data.format, or a file format
    records, _ = read_records(path, format=file_format)
    examples, _ = tokenize_records(records, tokenizer, seq_len, kind=kind, train_on=train_on, add_eos=add_eos,
                                   columns=columns)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0  # neither pad nor EOS; pads carry no loss
    batches = eval_batches(examples, batch_size, seq_len, packing=True, pad_id=pad_id)
    result = eval_loss(model, batches, precision=precision)
    result.examples = len(examples)
    return result
