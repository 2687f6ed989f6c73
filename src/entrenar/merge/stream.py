"""Inputs read one tensor at a time, and output written shard by shard: a merge holds a few tensors, not models.

Safetensors files are read at the offsets in their header: whole tensors with
plain ``readinto``, row blocks (:meth:`SafetensorsFile.view_rows`) as views of a
memory map, with the pages of the block before dropped from the process
(``MADV_DONTNEED``: they stay in the page cache), so the bytes of tensors already
merged do not count toward its resident memory. The writer knows every output tensor's name, shape and
dtype before the first is merged, so it writes each shard's header first and
then streams the tensors into it in order.

Inputs (:func:`open_input`):

- a Hugging Face folder (one or several safetensors files);
- a ``.gguf`` file (tensors dequantized one at a time, under Hugging Face names);
- ``model+adapter``: a base plus a PEFT LoRA adapter, each targeted weight
  returned as ``W + scale * B @ A`` as it is read (the adapter is small and read whole).
"""

from __future__ import annotations

import contextlib
import io
import json
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors.torch import load_file

from entrenar.errors import AdapterError, ModelError
from entrenar.io.hf_files import weight_files
from entrenar.io.safetensors_dtypes import SAFETENSORS_DTYPES

_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


# -- safetensors ------------------------------------------------------------------


class SafetensorsFile:
    """One safetensors file: its header parsed, tensors read on demand with ``readinto``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelError(f"{path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + length
        self.entries: dict[str, tuple[TensorInfo, int, int]] = {}
        for name, entry in header.items():
            if entry.get("dtype") not in SAFETENSORS_DTYPES:
                raise ModelError(f"{path}: tensor '{name}' has unsupported dtype {entry.get('dtype')!r}")
            start, end = entry["data_offsets"]
            self.entries[name] = (TensorInfo(tuple(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]]), start, end)
        self._file: io.BufferedReader | None = None
        self._map: mmap.mmap | None = None
        self._viewed: tuple[int, int] | None = None  # page range of the last view, dropped at the next

    def read(self, name: str) -> torch.Tensor:
        info = self.entries[name][0]
        return self.read_rows(name, 0, info.shape[0] if info.shape else 1)

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor (its first dimension), read from the file alone.

        ``out``, a uint8 tensor of at least the rows' bytes, is read into and the
        result is a view of it: a caller merging block after block reuses one buffer.
        """
        info, begin, end = self.entries[name]
        if not info.shape:
            start, stop, row = 0, 1, end - begin
        else:
            row = (end - begin) // max(info.shape[0], 1)
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close()
        nbytes = (stop - start) * row
        buffer = torch.empty(nbytes, dtype=torch.uint8) if out is None else out[:nbytes]
        self._file.seek(self.data_start + begin + start * row)
        if self._file.readinto(buffer.numpy().data) != nbytes:
            raise ModelError(f"{self.path}: tensor '{name}' is truncated")
        shape = (stop - start, *info.shape[1:]) if info.shape else ()
        return buffer.view(info.dtype).reshape(shape)

    def view_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of a tensor as a read-only uint8 view of the mapped file: no copy, no read call.

        The pages of the previous view are dropped from this process's memory
        first, so however much is read, about one block per file stays resident.
        """
        info, begin, end = self.entries[name]
        row = (end - begin) // max(info.shape[0], 1) if info.shape else end - begin
        offset = self.data_start + begin + start * row
        nbytes = (stop - start) * row if info.shape else end - begin
        if self._map is None:
            if self._file is None:
                self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close()
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        if offset + nbytes > len(self._map):
            raise ModelError(f"{self.path}: tensor '{name}' is truncated")
        self._drop_view()
        first = offset - offset % mmap.PAGESIZE
        self._viewed = (first, min(len(self._map), offset + nbytes) - first)
        return np.frombuffer(self._map, np.uint8, nbytes, offset)

    def _drop_view(self) -> None:
        if self._viewed is not None and self._viewed[1] > 0 and hasattr(mmap, "MADV_DONTNEED"):  # not on Windows
            assert self._map is not None  # _viewed is set only once the file is mapped
            self._map.madvise(mmap.MADV_DONTNEED, *self._viewed)
        self._viewed = None

    def close(self) -> None:
        if self._map is not None:
            self._drop_view()
            with contextlib.suppress(BufferError):  # a view is still alive: the map closes when it is collected
                self._map.close()
            self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _header(entries: Sequence[tuple[str, TensorInfo]], metadata: dict[str, str] | None) -> tuple[bytes, int]:
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, info in entries:
        header[name] = {"dtype": _CODES[info.dtype], "shape": list(info.shape),
                        "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    data = json.dumps(header, separators=(",", ":")).encode()
    data += b" " * (-len(data) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(data)) + data, offset


class ShardedWriter:
    """Writes planned tensors into ``model-0000i-of-0000n.safetensors`` shards in plan order.

    ``entries`` (name, info) is the whole output in order; shards are cut when the
    next tensor would push one past ``max_shard_bytes``. :meth:`write` takes the
    tensors in that same order; :meth:`close` checks every one was written and
    writes the index (or names the single file ``model.safetensors``).
    """

    def __init__(self, folder: Path, entries: Sequence[tuple[str, TensorInfo]], max_shard_bytes: int) -> None:
        self.folder = folder
        self.shards: list[list[tuple[str, TensorInfo]]] = [[]]
        size = 0
        for name, info in entries:
            if self.shards[-1] and size + info.nbytes > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append((name, info))
            size += info.nbytes
        n = len(self.shards)
        self.names = (["model.safetensors"] if n == 1
                      else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)])
        self._order = [(s, name, info) for s, shard in enumerate(self.shards) for name, info in shard]
        self._next = 0
        self._file: BinaryIO | None = None
        self._shard = -1
        self.total_bytes = sum(info.nbytes for _, info in entries)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.write_parts(name, [tensor])

    def write_parts(self, name: str, parts) -> None:
        """Write one tensor given as consecutive row blocks (an iterable), each written as it comes."""
        shard, expected, info = self._order[self._next]
        if name != expected:
            raise RuntimeError(f"tensor {name} written out of order (expected {expected})")
        if shard != self._shard:
            self._open(shard)
        assert self._file is not None  # _open made the shard's file
        written = 0
        for part in parts:
            if tuple(part.shape[1:]) != info.shape[1:] or part.dtype != info.dtype:
                raise ModelError(f"output tensor {name}: planned {info.shape} {info.dtype}, "
                                 f"got {tuple(part.shape)} {part.dtype}")
            self._file.write(part.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            written += part.numel() * part.element_size()
        if written != info.nbytes:
            raise ModelError(f"output tensor {name}: planned {info.nbytes} bytes, {written} were written")
        self._next += 1

    def _open(self, shard: int) -> None:
        if self._file is not None:
            self._file.close()
        self._shard = shard
        self._file = open(self.folder / self.names[shard], "wb")  # noqa: SIM115 - closed in _open/close
        header, _ = _header(self.shards[shard], {"format": "pt"})
        self._file.write(header)

    def close(self) -> list[str]:
        """Finish the last shard and write the index when sharded; returns the files written."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._next != len(self._order):
            raise RuntimeError(f"only {self._next} of {len(self._order)} planned tensors were written")
        if len(self.names) > 1:
            weight_map = {name: self.names[s] for s, name, _ in self._order}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            return [*self.names, INDEX_NAME]
        return list(self.names)


# -- inputs ------------------------------------------------------------------------


class Input:
    """A model to merge: its Hugging Face config, its tensors' names and shapes, lazy reads."""

    reference: str
    config: dict[str, Any]
    folder: Path | None  # where tokenizer and generation files live (None for GGUF)

    def tensors(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor; inputs that cannot seek read it whole and slice.

        ``out`` is a uint8 scratch buffer the result may be a view of (see :meth:`SafetensorsFile.read_rows`).
        """
        return self.read(name)[start:stop]

    @property
    def reads_rows(self) -> bool:
        """Whether :meth:`read_rows` reads only the rows asked for (then merging by row blocks pays)."""
        return False

    def view_rows(self, name: str, start: int, stop: int) -> np.ndarray | None:
        """Rows ``start:stop`` as a read-only uint8 view of the stored bytes, or None where there is none."""
        return None

    def close(self) -> None:
        pass

    def has(self, name: str) -> bool:
        return name in self.tensors()

    def resolve(self, name: str) -> str:
        """The stored tensor that holds ``name``: a tied model's lm_head is its embedding."""
        if name == "lm_head.weight" and not self.has(name) and self.config.get("tie_word_embeddings"):
            return "model.embed_tokens.weight"
        return name


class HFInput(Input):
    def __init__(self, folder: Path, reference: str) -> None:
        self.reference, self.folder = reference, folder
        path = folder / "config.json"
        if not path.is_file():
            raise ModelError(f"{folder}: not a Hugging Face model folder (no config.json)")
        try:
            self.config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelError(f"{path} line {e.lineno}: invalid JSON: {e.msg}") from None
        if self.config.get("quantization_config"):
            raise ModelError(f"{path}: the checkpoint is quantized; merging needs floating-point weights")
        self.files = [SafetensorsFile(f) for f in weight_files(folder)]
        self._where: dict[str, SafetensorsFile] = {}
        self._info: dict[str, TensorInfo] = {}
        for f in self.files:
            for name, (info, _, _) in f.entries.items():
                self._where[name] = f
                self._info[name] = info

    def tensors(self) -> dict[str, TensorInfo]:
        return self._info

    def read(self, name: str) -> torch.Tensor:
        return self._where[name].read(name)

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._where[name].read_rows(name, start, stop, out)

    def view_rows(self, name: str, start: int, stop: int) -> np.ndarray | None:
        return self._where[name].view_rows(name, start, stop)

    @property
    def reads_rows(self) -> bool:
        return True

    def close(self) -> None:
        for f in self.files:
            f.close()


class GGUFInput(Input):
    def __init__(self, path: Path, reference: str) -> None:
        from entrenar.models.gguf import read_gguf

        self.reference, self.folder = reference, None
        self.gguf = read_gguf(path)
        self.config = dict(self.gguf.hf_config)
        shapes = _gguf_shapes(self.gguf)
        self._info = {name: TensorInfo(shape, torch.float32) for name, shape in shapes.items()}

    def tensors(self) -> dict[str, TensorInfo]:
        return self._info

    def read(self, name: str) -> torch.Tensor:
        return self.gguf.tensor(name, torch.float32)


def _gguf_shapes(model) -> dict[str, tuple[int, ...]]:
    """HF-order shapes of a GGUF file's tensors, from the reader's metadata (no tensor data read)."""
    shapes = {}
    for name, t in model._tensors.items():
        dims = [int(d) for d in t.shape]  # GGUF stores dims innermost first
        shapes[name] = tuple(reversed(dims)) if len(dims) > 1 else tuple(dims)
    return shapes


class AdapterInput(Input):
    """``base+adapter``: every weight a PEFT LoRA adapter targets comes back as ``W + scale * B @ A``."""

    def __init__(self, base: Input, adapter: Path, reference: str) -> None:
        from entrenar.adapters.lora import ADAPTER_WEIGHTS, PEFT_PREFIX, read_adapter_config

        self.base, self.reference, self.folder, self.config = base, reference, base.folder, base.config
        cfg = read_adapter_config(adapter)
        self.scale = cfg.scaling
        path = adapter / ADAPTER_WEIGHTS
        if not path.is_file():
            raise AdapterError(f"{adapter}: no {ADAPTER_WEIGHTS}")
        self.pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        state = load_file(str(path))
        for key, a in state.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b = state.get(key.replace(".lora_A.", ".lora_B."))
            if b is None:
                raise AdapterError(f"{path}: {key} has no lora_B partner")
            self.pairs[f"{module}.weight"] = (a, b)
        if not self.pairs:
            raise AdapterError(f"{path}: no LoRA tensors (lora_A/lora_B) found")
        known = base.tensors()
        for name, (a, b) in self.pairs.items():
            if name not in known:
                raise AdapterError(f"{path}: the adapter targets '{name}', which {base.reference} does not have")
            if known[name].shape != (b.shape[0], a.shape[1]):
                raise AdapterError(
                    f"{path}: '{name}' is {known[name].shape} in {base.reference} but the adapter's B@A is "
                    f"{(b.shape[0], a.shape[1])}"
                )

    def tensors(self) -> dict[str, TensorInfo]:
        return self.base.tensors()

    def read(self, name: str) -> torch.Tensor:
        weight = self.base.read(name)
        if name not in self.pairs:
            return weight
        a, b = self.pairs[name]
        merged = weight.float() + self.scale * (b.float() @ a.float())
        return merged.to(weight.dtype) if weight.dtype.is_floating_point else merged

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.base.read_rows(name, start, stop, out)
        if name not in self.pairs:
            return weight
        a, b = self.pairs[name]
        return (weight.float() + self.scale * (b[start:stop].float() @ a.float())).to(weight.dtype)

    @property
    def reads_rows(self) -> bool:
        return self.base.reads_rows

    def close(self) -> None:
        self.base.close()


def underlying(model: Input) -> Input:
    """The model a ``base+adapter`` input wraps: its tokenizer, chat template and generation files are the base's."""
    while isinstance(model, AdapterInput):
        model = model.base
    return model


def open_input(path: Path, adapter: Path | None = None, reference: str | None = None) -> Input:
    """An :class:`Input` for a folder or .gguf file, with ``adapter`` merged into it as it is read."""
    reference = reference or str(path)
    if not path.exists():
        raise ModelError(f"{reference}: no such model folder or .gguf file"
                         + (f" ({path})" if str(path) != reference.partition("+")[0] else ""))
    if path.suffix == ".gguf":
        model: Input = GGUFInput(path, reference)
    elif path.is_dir():
        model = HFInput(path, reference)
    else:
        raise ModelError(f"{reference}: not a model folder or .gguf file")
    if adapter is not None:
        if not adapter.exists():
            raise AdapterError(f"{reference}: no such adapter folder {adapter}")
        model = AdapterInput(model, adapter, reference)
    return model


__all__ = ["AdapterInput", "GGUFInput", "HFInput", "Input", "SafetensorsFile", "ShardedWriter", "TensorInfo",
           "open_input"]
