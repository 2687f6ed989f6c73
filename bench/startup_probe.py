"""Phase timestamps inside the processes of `entrenar train` (bench/fsdp_startup.py installs it).

Imported by a generated ``sitecustomize`` in every Python process the launched command starts (the launcher and
each torchrun worker) when ``ENTRENAR_PHASES`` names a folder. It wraps the loop's steps and the FSDP loading's
pieces by name (those that exist: the probe runs on older and newer code alike) and appends one JSON line per
call to ``ENTRENAR_PHASES/rank-R.jsonl``: ``{"phase", "start", "end"}`` in wall-clock seconds (``time.time()``,
comparable across the processes). Nothing in entrenar knows of it.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time
from typing import Any

_FOLDER = os.environ.get("ENTRENAR_PHASES", "")
_RANK = os.environ.get("RANK", "launcher")

# (module, attribute, phase); "Class.method" wraps a method. Phases nested in another are timed inside it.
WRAPPED = [
    ("entrenar.train.loop", "join", "join (process group)"),
    ("entrenar.train.loop", "plan_run", "plan"),
    ("entrenar.train.loop", "load_model", "load model"),
    ("entrenar.models.hf", "load_state_into", "load: read files into the weights"),
    ("entrenar.train.loop", "prepare", "prepare (FSDP)"),
    ("entrenar.distributed.parallelize", "full_state", "prepare: rank 0's state dict"),
    ("entrenar.distributed.parallelize", "shard_nf4_layers", "prepare: shard NF4"),
    ("torch.distributed.fsdp", "fully_shard", "prepare: fully_shard"),
    ("entrenar.distributed.parallelize", "materialize", "prepare: materialize"),
    ("torch.distributed.checkpoint.state_dict", "set_model_state_dict", "materialize: broadcast from rank 0"),
    ("entrenar.distributed.parallelize", "read_shards", "materialize: read own shards"),
    ("entrenar.distributed.parallelize", "scatter_nf4", "prepare: scatter NF4"),
    ("entrenar.train.loop", "read_data", "read and tokenize data"),
    ("entrenar.train.loop", "Trainer.__init__", "trainer (optimizer)"),
    ("entrenar.train.trainer", "Trainer.fit", "fit"),
    ("entrenar.train.trainer", "Trainer._finish", "finish (save)"),
]


def _write(phase: str, start: float, end: float) -> None:
    with open(os.path.join(_FOLDER, f"rank-{_RANK}.jsonl"), "a") as f:
        f.write(json.dumps({"phase": phase, "start": start, "end": end}) + "\n")


def _timed(fn: Any, phase: str) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            _write(phase, start, time.time())
    return wrapper


def _first_step(fn: Any) -> Any:
    """Trainer._log_step: the first step's results reached the host (its end)."""
    seen: list[bool] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not seen:
            seen.append(True)
            _write("first step logged", time.time(), time.time())
        return fn(*args, **kwargs)
    return wrapper


def install(started: float) -> None:
    """Wrap what exists of WRAPPED; record the interpreter's start and the imports' end."""
    if not _FOLDER:
        return
    _write("interpreter started", started, started)
    if _RANK == "launcher":
        return
    before = time.time()
    import entrenar.cli.main  # noqa: F401 - what `python -m entrenar` imports first
    import entrenar.train.loop  # noqa: F401
    _write("imports", before, time.time())
    for module_name, attribute, phase in WRAPPED:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner: Any = module
        name = attribute
        if "." in attribute:
            cls, name = attribute.split(".")
            owner = getattr(module, cls, None)
        if owner is not None and hasattr(owner, name):
            setattr(owner, name, _timed(getattr(owner, name), phase))
    from entrenar.train import trainer

    trainer.Trainer._log_step = _first_step(trainer.Trainer._log_step)  # type: ignore[method-assign]
