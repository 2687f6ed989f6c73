"""A run's checkpoint folders as files: their names, which one is the latest or the best, and a sharded one's weights.

Layout under a run folder (written by :mod:`entrenar.train.checkpoint` and :mod:`entrenar.train.sharded_checkpoint`)::

    <run>/checkpoints/
        step-<N>/
            model.safetensors      the trainable tensors (a sharded checkpoint: shards/, torch.distributed.checkpoint)
            optimizer.safetensors  optimizer.json  rng.safetensors
            trainer.json           written last: a complete checkpoint has it
        latest                     text file naming the newest checkpoint folder ("step-N")
        best                       text file naming the checkpoint kept as best

Kept below training so that what reads a run (``entrenar.load`` of ``RUN/checkpoints/step-N``,
:mod:`entrenar.loading.runs`) needs none of the code that writes it.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from entrenar.errors import CheckpointError

CHECKPOINTS_DIR = "checkpoints"
MODEL_FILE = "model.safetensors"
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
RNG_FILE = "rng.safetensors"
TRAINER_FILE = "trainer.json"
REQUIRED_FILES = (MODEL_FILE, OPTIMIZER_TENSORS, OPTIMIZER_JSON, RNG_FILE, TRAINER_FILE)
SHARDS_DIR = "shards"  # a sharded checkpoint's torch.distributed.checkpoint folder
SHARDED_REQUIRED_FILES = (f"{SHARDS_DIR}/.metadata", RNG_FILE, TRAINER_FILE)

STEP_DIR = re.compile(r"^step-(\d+)$")


# ---------------------------------------------------------------- finding checkpoints


def read_pointer(path: Path, instead: str) -> str | None:
    """The ``step-N`` a pointer file names; None if there is no such file. A damaged pointer (not UTF-8, not a
    ``step-N``) warns, saying what is used ``instead``, and reads as None."""
    try:
        name = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, OSError) as e:
        warnings.warn(f"{path}: unreadable pointer ({e}); {instead}", stacklevel=3)
        return None
    if not STEP_DIR.match(name):
        warnings.warn(f"{path}: does not name a checkpoint ({name[:40]!r}); {instead}", stacklevel=3)
        return None
    return name


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def is_complete(ckpt: Path) -> bool:
    return any(all((ckpt / name).is_file() for name in files) for files in (REQUIRED_FILES, SHARDED_REQUIRED_FILES))


def is_sharded(ckpt: str | os.PathLike) -> bool:
    """Whether ``ckpt`` is a sharded checkpoint (torch.distributed.checkpoint), written by an FSDP run."""
    return (Path(ckpt) / SHARDED_REQUIRED_FILES[0]).is_file()


def step_dirs(ckpts: Path) -> list[tuple[int, Path]]:
    """(N, folder) of every ``step-N`` folder in ``ckpts``, lowest N first."""
    if not ckpts.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in ckpts.iterdir() if d.is_dir() and (m := STEP_DIR.match(d.name))]
    return sorted(found)


def incomplete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The ``step-N`` folders of a run that lack a file of a checkpoint (left by a kill in an older version's
    rotation, or by hand); resuming skips them."""
    return [d for _, d in step_dirs(checkpoints_dir(run_dir)) if not is_complete(d)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names, or else the highest complete ``step-N``; None if there is none.

    Temporary folders of an interrupted save and folders missing a file are ignored.
    """
    ckpts = checkpoints_dir(run_dir)
    name = read_pointer(ckpts / "latest", instead="using the newest complete checkpoint instead")
    if name is not None and is_complete(ckpts / name):
        return ckpts / name
    complete = [d for _, d in step_dirs(ckpts) if is_complete(d)]
    if name is not None and complete:
        warnings.warn(f"{ckpts / 'latest'} names {name}, which is not a complete checkpoint; using "
                      f"{complete[-1].name}, the newest complete one", stacklevel=2)
    return complete[-1] if complete else None


def best_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint last marked best (:func:`entrenar.train.checkpoint.mark_best`), if it still exists complete."""
    ckpts = checkpoints_dir(run_dir)
    name = read_pointer(ckpts / "best", instead="no checkpoint is marked best")
    return ckpts / name if name is not None and is_complete(ckpts / name) else None


# ---------------------------------------------------------------- reading a sharded checkpoint's weights


def first_line(error: BaseException) -> str:
    """The line of an exception's message that says what went wrong (DCP's are long), at most 300 characters."""
    text = str(error).strip()
    return text.splitlines()[-1][:300] if text else type(error).__name__


@contextmanager
def one_process_ok() -> Iterator[None]:
    """DCP warns that it assumes one process whenever there is no process group, even when asked to (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")
        yield


def saved_entries(shards: Path) -> dict[str, Any]:
    """DCP's metadata of a checkpoint: each saved entry's dotted name and its (tensor) metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return dict(FileSystemReader(str(shards)).read_metadata().state_dict_metadata)
    except Exception as e:
        raise CheckpointError(f"{shards}: unreadable checkpoint metadata ({first_line(e)})") from None


def read_model_tensors(ckpt: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The saved model tensors of a sharded checkpoint, whole, in this one process (DCP joins the shards): what
    ``load(RUN/checkpoints/step-N)`` puts on the base model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shards = Path(ckpt) / SHARDS_DIR
    state = {name: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
             for name, entry in saved_entries(shards).items()
             if name.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
    try:
        with one_process_ok():
            dcp.load(state, checkpoint_id=shards, no_dist=True)
    except Exception as e:
        raise CheckpointError(f"{shards}: cannot read the shards ({first_line(e)})") from None
    return {name[len("model."):]: tensor for name, tensor in state.items()}


__all__ = ["CHECKPOINTS_DIR", "MODEL_FILE", "OPTIMIZER_JSON", "OPTIMIZER_TENSORS", "REQUIRED_FILES", "RNG_FILE",
           "SHARDED_REQUIRED_FILES", "SHARDS_DIR", "TRAINER_FILE", "best_checkpoint", "is_sharded",
           "latest_checkpoint", "read_model_tensors"]
