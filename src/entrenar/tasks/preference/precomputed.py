"""Reference log-probabilities computed once, before training, and kept in the run folder (``task.reference:
precomputed``): full fine-tuning without a second copy of the model in memory.

The table holds each pair's (chosen, rejected) summed completion log-probability under the starting weights, for
every example the run read (training and validation files), in ``<run>/reference_logps.safetensors`` with two
fingerprints in its metadata: of the examples' tokens and of the starting weights. A later run (a resume, or a
new run in the same folder) reuses the file when both match and computes it again otherwise. The starting weights'
fingerprint is taken when the task prepares the model, before a resume loads a checkpoint's; a table is only
computed from weights that still have it, so a resumed run never scores its reference with trained weights.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from entrenar.errors import CheckpointError
from entrenar.io import atomic

REFERENCE_FILE = "reference_logps.safetensors"


def weights_fingerprint(model: nn.Module) -> str:
    """SHA-256 of a model's parameters and buffers (names, dtypes, shapes and bytes), in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def examples_fingerprint(examples: Sequence[Any]) -> str:
    """SHA-256 of the examples' token ids, in order."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(json.dumps([e.prompt, *e.sequences()], separators=(",", ":")).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def read_table(path: Path, data: str, model: str) -> torch.Tensor | None:
    """The stored ``[examples, 2]`` table when its fingerprints are ``data`` and ``model`` (None otherwise)."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(header_len)).get("__metadata__", {})
        if meta.get("data") != data or meta.get("model") != model:
            return None
        return load_file(path)["logps"]
    except (SafetensorError, ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{path}: not a reference log-probability table ({e}); remove it to compute it "
                              "again") from None


def write_table(path: Path, table: torch.Tensor, data: str, model: str) -> Path:
    """Write the table atomically (a crash leaves the old file or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic.write_file(path, lambda tmp: save_file({"logps": table.contiguous().cpu()}, str(tmp),
                                                         metadata={"data": data, "model": model}))


__all__ = ["REFERENCE_FILE", "examples_fingerprint", "read_table", "weights_fingerprint", "write_table"]
