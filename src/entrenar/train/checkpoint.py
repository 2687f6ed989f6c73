"""Training checkpoints: atomic save, exact resume, keep the last N and the best.

Layout under a run folder::

    <run>/checkpoints/
        step-<N>/
            model.safetensors      tensors given by the caller (only trainable ones in LoRA runs)
            optimizer.safetensors  every tensor of optimizer.state_dict()
            optimizer.json         the rest of it, tensors replaced by {"__tensor__": key}
            rng.safetensors        torch CPU/CUDA generator states; numpy and `random` states as JSON metadata
            trainer.json           {"format_version", "step", ...caller's trainer state}; written last
        latest                     text file naming the newest checkpoint folder ("step-N")
        best                       text file naming the checkpoint kept as best (see mark_best)

A sharded (FSDP) run's checkpoint holds ``shards/`` (torch.distributed.checkpoint: each rank's shards of the
weights and optimizer state) instead of the three model and optimizer files; see
:mod:`entrenar.train.sharded_checkpoint`, which writes and reads it with the helpers here.

A checkpoint is built in a staging folder beside ``step-N``, fsynced, and renamed
into place (:func:`entrenar.io.atomic.staged_folder`); the pointers are replaced
the same way. A crash at any moment leaves the previous checkpoint intact and
``latest`` naming it; a staging folder left by a hard kill is removed by the
next save. Pruning renames an old checkpoint out of the ``step-N`` namespace
before deleting its files, so a kill mid-rotation never leaves a ``step-N``
that looks like a checkpoint but lacks one. Nothing is pickled.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from entrenar.errors import CheckpointError
from entrenar.io import atomic
from entrenar.io.checkpoint_files import (  # noqa: F401 - re-exported: the folder's names and readers live below
    CHECKPOINTS_DIR,
    MODEL_FILE,
    OPTIMIZER_JSON,
    OPTIMIZER_TENSORS,
    REQUIRED_FILES,
    RNG_FILE,
    SHARDED_REQUIRED_FILES,
    SHARDS_DIR,
    TRAINER_FILE,
    best_checkpoint,
    is_sharded,
    latest_checkpoint,
)
from entrenar.io.checkpoint_files import STEP_DIR as _STEP_DIR
from entrenar.io.checkpoint_files import checkpoints_dir as _checkpoints_dir
from entrenar.io.checkpoint_files import is_complete as _is_complete
from entrenar.io.checkpoint_files import read_pointer as _read_pointer
from entrenar.io.checkpoint_files import step_dirs as _step_dirs
from entrenar.io.finite import check_finite

FORMAT_VERSION = 1
# A staging folder of atomic.staged_folder for a checkpoint (removed once the process that made it is gone).
_LEFTOVER_DIR = re.compile(r"^\.(step-\d+)\..+" + re.escape(atomic.TEMP_SUFFIX) + "$")
# Group keys that describe this process's optimizer implementation, not training state.
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


# ---------------------------------------------------------------- small file helpers


def _write_pointer(path: Path, target: str) -> None:
    """Atomically make the text file ``path`` name ``target``."""
    atomic.write_text(path, target + "\n")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: corrupt JSON, nested too deeply to be a checkpoint's") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors file: {e}") from None


def _cpu_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies; tensors that share storage (tied weights) are cloned apart,
    since safetensors refuses shared storage."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state entry {name!r} is a {type(tensor).__name__}, not a tensor")
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel() > 0:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


# ---------------------------------------------------------------- optimizer state <-> JSON + tensors


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Turn a state_dict tree into JSON, moving tensors into ``tensors`` under their tree path
    (``state.3.exp_avg``). Tuples and int-keyed dicts are tagged so they decode as they were."""
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _encode(v, _join(path, k), tensors) for k, v in obj.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in obj):
            return {"__int_keys__": {str(k): _encode(v, _join(path, k), tensors) for k, v in obj.items()}}
    elif isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, _join(path, i), tensors) for i, v in enumerate(obj)]}
    elif isinstance(obj, list):
        return [_encode(v, _join(path, i), tensors) for i, v in enumerate(obj)]
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(
        f"optimizer state entry {path!r} is a {type(obj).__name__}, which cannot be saved without pickle"
    )


def _decode(obj: Any, tensors: dict[str, torch.Tensor], file: Path) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, file) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        key = obj["__tensor__"]
        if key not in tensors:
            raise CheckpointError(f"{file}: tensor {key!r} named in {OPTIMIZER_JSON} is missing")
        return tensors[key]
    if "__int_keys__" in obj:
        return {int(k): _decode(v, tensors, file) for k, v in obj["__int_keys__"].items()}
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors, file) for v in obj["__tuple__"])
    return {k: _decode(v, tensors, file) for k, v in obj.items()}


def _saved_optimizer_state(ckpt: Path, optimizer: torch.optim.Optimizer) -> dict:
    """Read the saved optimizer state and check it fits ``optimizer`` before anything is changed."""
    tensor_file = ckpt / OPTIMIZER_TENSORS
    try:
        saved = _decode(_read_json(ckpt / OPTIMIZER_JSON), _read_tensors(tensor_file), tensor_file)
    except RecursionError:
        raise CheckpointError(f"{ckpt / OPTIMIZER_JSON}: nested too deeply to be an optimizer state") from None
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        raise CheckpointError(f"{ckpt / OPTIMIZER_JSON}: not an optimizer state (needs 'state' and 'param_groups')")
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    if len(groups) != len(saved_groups):
        raise CheckpointError(
            f"{ckpt / OPTIMIZER_JSON}: {len(saved_groups)} parameter groups saved, the optimizer has {len(groups)}"
        )
    params: dict[int, tuple[str, torch.Tensor]] = {}
    for g, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        names = group.get("names") or [f"group {g} param {i}" for i in range(len(group["params"]))]
        saved_names = saved_group.get("names")
        if len(saved_group["params"]) != len(group["params"]):
            raise CheckpointError(
                f"{ckpt / OPTIMIZER_JSON}: group {g} has {len(saved_group['params'])} parameters saved, "
                f"the optimizer has {len(group['params'])}"
            )
        if saved_names is not None and group.get("names") is not None and saved_names != names:
            first = next(i for i, (a, b) in enumerate(zip(saved_names, names)) if a != b)
            raise CheckpointError(
                f"{ckpt / OPTIMIZER_JSON}: group {g} parameter {first} is {saved_names[first]!r} in the checkpoint "
                f"but {names[first]!r} in the optimizer"
            )
        for saved_id, name, param in zip(saved_group["params"], names, group["params"]):
            params[saved_id] = (name, param)
        for key in _IMPLEMENTATION_KEYS:
            if key in group:
                saved_group[key] = group[key]
    for saved_id, state in saved["state"].items():
        if saved_id not in params:
            raise CheckpointError(f"{tensor_file}: state for parameter id {saved_id}, which no group lists")
        name, param = params[saved_id]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape != param.shape:
                raise CheckpointError(
                    f"{tensor_file}: tensor 'state.{saved_id}.{key}' (parameter {name!r}) has shape "
                    f"{tuple(value.shape)}, the parameter has {tuple(param.shape)}"
                )
    return saved


# ---------------------------------------------------------------- RNG states


def _capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda.{i}"] = state
    # The legacy tuple (legacy=True, the default); numpy's stubs give the union with the dict form.
    legacy = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    kind, keys, pos, has_gauss, cached_gaussian = legacy
    tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    version, internal, gauss_next = random.getstate()
    metadata = {
        "numpy": json.dumps(
            {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
        ),
        "python_random": json.dumps({"version": version, "state": list(internal), "gauss_next": gauss_next}),
    }
    return tensors, metadata


def _read_rng(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = _read_tensors(path)
    with safe_open(str(path), "pt") as f:
        raw = f.metadata() or {}
    try:
        meta = {key: json.loads(raw[key]) for key in ("numpy", "python_random")}
    except (KeyError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: missing or corrupt RNG metadata ({e})") from None
    if "torch_cpu" not in tensors or "numpy_keys" not in tensors:
        raise CheckpointError(f"{path}: tensor 'torch_cpu' or 'numpy_keys' is missing")
    # Sizes the generators need, checked here so a cut-short state fails before anything is restored.
    expected = {"torch_cpu": (torch.uint8, torch.get_rng_state().numel()), "numpy_keys": (torch.int64, 624)}
    expected |= {name: (torch.uint8, tensors[name].numel()) for name in tensors if name.startswith("torch_cuda.")}
    for name, (dtype, numel) in expected.items():
        tensor = tensors[name]
        if tensor.dtype != dtype or tensor.dim() != 1 or tensor.numel() != numel:
            raise CheckpointError(f"{path}: tensor {name!r} is {tensor.dtype} of shape {list(tensor.shape)}, a "
                                  f"generator state is {dtype} of shape [{numel}]; the file is damaged")
    if not _rng_meta_ok(meta["python_random"], meta["numpy"]):
        raise CheckpointError(f"{path}: RNG metadata 'python_random' or 'numpy' is damaged")
    return tensors, meta


def _rng_meta_ok(py: Any, np_meta: Any) -> bool:
    """Whether the Python and numpy generator states have the fields and types their setters take."""
    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    return (isinstance(py, dict) and is_int(py.get("version")) and isinstance(py.get("state"), list)
            and len(py["state"]) == 625 and all(is_int(v) and 0 <= v < 2**32 for v in py["state"])
            and (py.get("gauss_next") is None or isinstance(py["gauss_next"], float))
            and isinstance(np_meta, dict) and np_meta.get("kind") == "MT19937"
            and is_int(np_meta.get("pos")) and 0 <= np_meta["pos"] <= 624 and is_int(np_meta.get("has_gauss"))
            and isinstance(np_meta.get("cached_gaussian"), (int, float)))


def _restore_rng(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [
        tensors[k]
        for k in sorted((k for k in tensors if k.startswith("torch_cuda.")), key=lambda k: int(k.split(".")[1]))
    ]
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(
                f"checkpoint holds RNG states for {len(cuda)} CUDA device(s) but this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; CUDA RNG not restored",
                stacklevel=3,
            )
    np_meta = meta["numpy"]
    np.random.set_state(
        (
            np_meta["kind"],
            tensors["numpy_keys"].numpy().astype(np.uint32),
            np_meta["pos"],
            np_meta["has_gauss"],
            np_meta["cached_gaussian"],
        )
    )
    py = meta["python_random"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))


# ---------------------------------------------------------------- marking the best


def mark_best(run_dir: str | os.PathLike, step: int) -> Path:
    """Record ``step-<step>`` as the best checkpoint (e.g. lowest eval loss); pruning keeps it."""
    ckpt = _checkpoints_dir(run_dir) / f"step-{step}"
    if not _is_complete(ckpt):
        raise CheckpointError(f"{ckpt}: cannot mark as best, no complete checkpoint there")
    _write_pointer(ckpt.parent / "best", ckpt.name)
    return ckpt


# ---------------------------------------------------------------- save


def _prune(ckpts: Path, keep_last: int | None, protected: set[str]) -> None:
    for d in ckpts.iterdir():
        if d.is_dir() and (m := _LEFTOVER_DIR.match(d.name)) and atomic.is_stale_temp(d, m.group(1)):
            shutil.rmtree(d, ignore_errors=True)
    if keep_last is None:
        return
    steps = _step_dirs(ckpts)
    keep = {d.name for _, d in steps[-keep_last:]} | protected
    for _, d in steps:
        if d.name not in keep:
            atomic.remove_folder(d)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    model_state: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    trainer_state: Mapping[str, Any],
    keep_last: int | None = None,
    best: bool = False,
) -> Path:
    """Write ``<run_dir>/checkpoints/step-<step>`` atomically and point ``latest`` at it.

    ``model_state`` holds the tensors to restore (only the trainable ones in a
    LoRA run). ``trainer_state`` is any JSON-serialisable dict (scheduler and
    data-stream state, best metrics, recipe hash); it is stored beside ``step``.
    Then keeps the ``keep_last`` highest-numbered checkpoints (all if None) plus
    the one just written and the one marked best; leftovers of interrupted saves
    are removed. ``best=True`` marks this checkpoint best before pruning, so
    the previous best is pruned like any other. Returns the checkpoint folder.
    """
    trainer_json = encode_trainer_state(step, trainer_state, keep_last)
    optimizer_tensors: dict[str, torch.Tensor] = {}
    optimizer_json = json.dumps(_encode(optimizer.state_dict(), "", optimizer_tensors))

    ckpts = _checkpoints_dir(run_dir)
    final = ckpts / f"step-{step}"
    # A checkpoint with NaN/inf weights or moments cannot be resumed from; refuse it before anything is written.
    check_finite(model_state, final / MODEL_FILE, CheckpointError)
    check_finite(optimizer_tensors, final / OPTIMIZER_TENSORS, CheckpointError)
    # Saving the same step again (after resuming from an earlier checkpoint) replaces it only once complete.
    with atomic.staged_folder(final) as tmp:
        save_file(_cpu_tensors(model_state), str(tmp / MODEL_FILE), metadata={"format": "pt"})
        save_file(_cpu_tensors(optimizer_tensors), str(tmp / OPTIMIZER_TENSORS))
        (tmp / OPTIMIZER_JSON).write_text(optimizer_json, encoding="utf-8")
        write_rng_and_trainer(tmp, trainer_json)
    return publish(final, keep_last, best)


def encode_trainer_state(step: int, trainer_state: Mapping[str, Any], keep_last: int | None) -> str:
    """trainer.json's text, after checking the arguments of a save (both checkpoint formats)."""
    if keep_last is not None and keep_last < 1:
        raise CheckpointError(f"keep_last must be at least 1 (or None to keep all), got {keep_last}")
    if "format_version" in trainer_state or trainer_state.get("step", step) != step:
        raise ValueError("trainer_state must not set 'format_version', and its 'step' (if any) must equal step")
    try:
        return json.dumps({"format_version": FORMAT_VERSION, **trainer_state, "step": step}, indent=2)
    except TypeError as e:
        raise TypeError(f"trainer_state must be JSON-serialisable: {e}") from None


def write_rng_and_trainer(folder: Path, trainer_json: str) -> None:
    """The generators' states, then trainer.json (last: its presence marks a finished write), into ``folder``."""
    rng_tensors, rng_meta = _capture_rng()
    save_file(rng_tensors, str(folder / RNG_FILE), metadata=rng_meta)
    (folder / TRAINER_FILE).write_text(trainer_json, encoding="utf-8")


def publish(final: Path, keep_last: int | None, best: bool) -> Path:
    """Point ``latest`` (and ``best``) at the checkpoint just renamed into place, then prune; return it."""
    ckpts = final.parent
    _write_pointer(ckpts / "latest", final.name)
    if best:
        _write_pointer(ckpts / "best", final.name)
    best_name = _read_pointer(ckpts / "best", instead="no checkpoint is kept as best")
    _prune(ckpts, keep_last, protected={final.name} | ({best_name} if best_name else set()))
    return final


# ---------------------------------------------------------------- load


def _resolve(path: str | os.PathLike) -> Path:
    p = Path(path)
    if _STEP_DIR.match(p.name) or (p / TRAINER_FILE).exists():
        if not p.is_dir():
            raise CheckpointError(f"{p}: no checkpoint folder there")
        return p
    if not p.is_dir():
        raise CheckpointError(f"{p}: no run folder or checkpoint there")
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(f"{p / CHECKPOINTS_DIR}: no complete checkpoint to resume from")
    return latest


def _check_model_state(state: dict[str, torch.Tensor], expected: Mapping[str, torch.Tensor], file: Path) -> None:
    missing = [k for k in expected if k not in state]
    if missing:
        raise CheckpointError(f"{file}: tensor {missing[0]!r} of the model is missing ({len(missing)} missing in all)")
    extra = [k for k in state if k not in expected]
    if extra:
        raise CheckpointError(f"{file}: tensor {extra[0]!r} is not in the model ({len(extra)} unexpected in all)")
    for name, reference in expected.items():
        if state[name].shape != reference.shape:
            raise CheckpointError(
                f"{file}: tensor {name!r} has shape {tuple(state[name].shape)}, the model has {tuple(reference.shape)}"
            )


def load_checkpoint(
    path_or_run_dir: str | os.PathLike,
    optimizer: torch.optim.Optimizer | None = None,
    expected_model_state: Mapping[str, torch.Tensor] | None = None,
    restore_rng: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load a checkpoint folder, or the latest one of a run folder.

    Restores ``optimizer`` (if given; hyperparameters and lr come from the
    checkpoint, the fused/foreach choice stays this process's) and the torch,
    CUDA, numpy and ``random`` generators (if ``restore_rng``). When
    ``expected_model_state`` is given (e.g. the trainable part of
    ``model.state_dict()``), tensor names and shapes must match it exactly.
    Everything is read and checked before any state changes.

    Returns ``(model_state, trainer_state)``: CPU tensors for the caller to copy
    into the model, and the trainer dict given at save time with its ``step``.
    """
    ckpt = _resolve(path_or_run_dir)
    if is_sharded(ckpt):
        raise CheckpointError(f"{ckpt}: a sharded checkpoint (torch.distributed.checkpoint, written by an FSDP run); "
                              "read it with entrenar.train.sharded_checkpoint.load_sharded_checkpoint (entrenar train "
                              "--resume does)")
    missing = [name for name in REQUIRED_FILES if not (ckpt / name).is_file()]
    if missing:
        raise CheckpointError(f"{ckpt}: incomplete checkpoint, missing {', '.join(missing)}")
    trainer_state = read_trainer_state(ckpt)
    model_state = _read_tensors(ckpt / MODEL_FILE)
    if expected_model_state is not None:
        _check_model_state(model_state, expected_model_state, ckpt / MODEL_FILE)
    optimizer_state = _saved_optimizer_state(ckpt, optimizer) if optimizer is not None else None
    rng = _read_rng(ckpt / RNG_FILE) if restore_rng else None

    if optimizer is not None and optimizer_state is not None:
        try:
            optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise CheckpointError(f"{ckpt / OPTIMIZER_JSON}: does not fit the optimizer: {e}") from None
    if rng is not None:
        _restore_rng(*rng)
    return model_state, trainer_state


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """trainer.json of a checkpoint (either format), checked: its format version and the step its folder names."""
    trainer_state = _read_json(ckpt / TRAINER_FILE)
    if not isinstance(trainer_state, dict) or trainer_state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{ckpt / TRAINER_FILE}: unsupported format_version "
            f"{trainer_state.get('format_version') if isinstance(trainer_state, dict) else None!r} "
            f"(this entrenar reads {FORMAT_VERSION})"
        )
    del trainer_state["format_version"]
    named = _STEP_DIR.match(ckpt.name)
    if named is not None and trainer_state.get("step") != int(named.group(1)):
        raise CheckpointError(f"{ckpt / TRAINER_FILE}: says step {trainer_state.get('step')!r} but the folder is "
                              f"{ckpt.name}; the checkpoint was moved or damaged, and resuming it would continue at "
                              "the wrong step")
    return trainer_state


def read_rng(ckpt: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A checkpoint's generator states, read and checked; :func:`restore_rng` applies them."""
    return _read_rng(ckpt / RNG_FILE)


def restore_rng(rng: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> None:
    """Set the torch, CUDA, numpy and ``random`` generators to what :func:`read_rng` read."""
    _restore_rng(*rng)
