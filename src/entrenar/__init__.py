"""entrenar: fine-tune transformer language models.

    model, tokenizer = entrenar.load("path/to/hf-folder-or-model.gguf")
    logits = model(input_ids)          # [batch, seq, vocab]

The front door only: ``load`` and ``read_model_config`` come from :mod:`entrenar.loading` on first use, so
``import entrenar`` (and the CLI's start) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from entrenar.errors import EntrenarError

if TYPE_CHECKING:
    from entrenar.loading import load, read_model_config

__version__ = "0.1.0"
__all__ = ["EntrenarError", "__version__", "load", "read_model_config"]


def __getattr__(name: str) -> Any:
    if name in ("load", "read_model_config"):
        from entrenar import loading  # start-up time: torch comes with it

        return getattr(loading, name)
    raise AttributeError(f"module 'entrenar' has no attribute {name!r}")
