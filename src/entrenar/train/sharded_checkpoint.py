"""Sharded training checkpoints through torch.distributed.checkpoint (DCP): each rank writes its own shards.

An FSDP run's checkpoint is the single-process layout (:mod:`entrenar.train.checkpoint`) with the weights and the
optimizer state in DCP's format instead of three safetensors/JSON files::

    step-N/
        shards/            .metadata and __<rank>_0.distcp: {"model": ..., "optimizer": ...} of
                           torch.distributed.checkpoint.state_dict (trainable weights and buffers, and the
                           optimizer state, keyed by parameter name); each rank wrote the shards it holds
        rng.safetensors    rank 0's generator states (every rank restores them, as in the single format)
        trainer.json       step, data position, global batch, world size...; written last

No rank gathers anything: the cost of a save is each rank's shards, not the whole model. The folder is staged
and renamed into place by rank 0 (:func:`entrenar.io.atomic.staged_folder`) once every rank's shards are written,
so a crash leaves the previous checkpoint as it was; ``output.dir`` must be a folder every rank sees.

Loading reads DCP's metadata, checks names and shapes against the model, and lets DCP reshard: a checkpoint
saved on N processes loads on M under FSDP, under DDP, or on a single process (plain tensors). Nothing is
pickled: DCP's tensor files are raw bytes, and its metadata is read by DCP's own reader.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn

from entrenar.distributed.world import World
from entrenar.errors import CheckpointError, EntrenarError
from entrenar.io import atomic
from entrenar.io.checkpoint_files import first_line as _first_line
from entrenar.io.checkpoint_files import one_process_ok as _one_process_ok
from entrenar.io.checkpoint_files import saved_entries as _saved_entries
from entrenar.io.finite import first_nonfinite
from entrenar.quant.nf4.format import NF4Linear
from entrenar.train import checkpoint as ckpt_files


# Frozen parameters (a LoRA run's base) are the base model's: read again from model.path, not saved.
class _Options(TypedDict, total=False):
    """The StateDictOptions fields set here."""

    ignore_frozen_params: bool
    strict: bool


_SAVE: _Options = {"ignore_frozen_params": True}
# strict would ask for the frozen ones; names are checked here
_LOAD: _Options = {"ignore_frozen_params": True, "strict": False}


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, load: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer,
                                                  options=StateDictOptions(**(_LOAD if load else _SAVE)))
    base = _quantized_base(model)
    return {"model": {k: v for k, v in model_state.items() if k not in base}, "optimizer": optimizer_state}


def _quantized_base(model: nn.Module) -> set[str]:
    """The buffers of a QLoRA run's NF4 base: frozen as its weights are, quantized again from model.path."""
    return {f"{name}.{b}" for name, module in model.named_modules() if isinstance(module, NF4Linear)
            for b, _ in module.named_buffers(recurse=False)}


def _local(tensor: Any) -> Any:
    return tensor.to_local() if type(tensor).__name__ == "DTensor" else tensor


def _tensors(tree: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    """(dotted name, this rank's part) of every tensor in a state-dict tree."""
    if isinstance(tree, torch.Tensor):
        return [(path, _local(tree))]
    if isinstance(tree, dict):
        return [t for k, v in tree.items() for t in _tensors(v, f"{path}.{k}" if path else str(k))]
    if isinstance(tree, (list, tuple)):
        return [t for i, v in enumerate(tree) for t in _tensors(v, f"{path}.{i}")]
    return []


def _check_finite(state: dict[str, Any], where: Path, world: World) -> None:
    """Refuse a checkpoint with NaN/inf weights or moments (as the single format does) on every rank at once."""
    bad = first_nonfinite(_tensors(state))
    found = [b for b in world.all_gather(bad) if b is not None]
    if found:
        name, count = found[0]
        raise CheckpointError(f"{where}: tensor {name!r} holds {count:,} non-finite value(s) (NaN/inf); nothing was "
                              "written (weights that diverged in training: lower optimizer.lr; see training.nonfinite)")


def save_sharded_checkpoint(run_dir: str | os.PathLike, step: int, model: nn.Module,
                            optimizer: torch.optim.Optimizer, trainer_state: dict[str, Any], world: World,
                            keep_last: int | None = None, best: bool = False) -> Path:
    """Write ``<run_dir>/checkpoints/step-<step>`` with every rank's shards; point ``latest`` at it (a collective).

    As :func:`entrenar.train.checkpoint.save_checkpoint`: ``trainer_state`` is stored in trainer.json, the
    ``keep_last`` newest checkpoints and the best are kept, ``best=True`` marks this one best. Returns the folder.
    """
    import torch.distributed.checkpoint as dcp

    final = Path(run_dir) / ckpt_files.CHECKPOINTS_DIR / f"step-{step}"
    trainer_json = ckpt_files.encode_trainer_state(step, trainer_state, keep_last)
    state = _state_dicts(model, optimizer, load=False)
    _check_finite(state, final / ckpt_files.SHARDS_DIR, world)
    with ExitStack() as staged:  # rank 0's staging folder; removed, with the shards in it, if anything fails
        tmp = Path(world.main_only(lambda: str(staged.enter_context(atomic.staged_folder(final)))))
        try:
            with _one_process_ok():
                dcp.save(state, checkpoint_id=tmp / ckpt_files.SHARDS_DIR, no_dist=not world.distributed)
        except EntrenarError:
            raise
        except Exception as e:  # DCP reports every rank's failure on every rank
            raise CheckpointError(f"{final}: writing the shards failed ({_first_line(e)}); output.dir must be a "
                                  "folder every rank can write") from None
        world.barrier()  # every rank's shards are on disk before rank 0 renames the folder into place

        def finish() -> Path:
            ckpt_files.write_rng_and_trainer(tmp, trainer_json)
            staged.close()  # fsync the tree, rename it into place
            return ckpt_files.publish(final, keep_last, best)

        return Path(world.main_only(finish))


def _check_names(saved: dict[str, Any], model_state: dict[str, Any], shards: Path) -> None:
    """Every tensor the model expects is saved with its shape, and the checkpoint holds no weight the model lacks."""
    expected = {f"model.{name}": tensor for name, tensor in model_state.items()}
    stored = {name for name in saved if name.startswith("model.")}
    missing = [name for name in expected if name not in stored]
    if missing:
        raise CheckpointError(f"{shards}: tensor {missing[0][6:]!r} of the model is missing "
                              f"({len(missing)} missing in all)")
    extra = [name for name in stored if name not in expected]
    if extra:
        raise CheckpointError(f"{shards}: tensor {extra[0][6:]!r} is not in the model ({len(extra)} unexpected in all)")
    for name, tensor in expected.items():
        size = getattr(saved[name], "size", None)
        if size is not None and tuple(size) != tuple(tensor.shape):
            raise CheckpointError(f"{shards}: tensor {name[6:]!r} has shape {tuple(size)}, the model has "
                                  f"{tuple(tensor.shape)}")


def load_sharded_checkpoint(ckpt: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                            world: World, restore_rng: bool = True) -> dict[str, Any]:
    """Restore the weights, optimizer state and generators of a sharded checkpoint; return its trainer state.

    Every rank of the run calls it (a collective when distributed). ``model`` may be sharded over any number of
    processes, replicated (DDP) or whole: DCP reads the parts of the saved shards each rank's tensors cover.
    Names, shapes and the trainer state are checked before anything changes.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    ckpt = Path(ckpt)
    shards = ckpt / ckpt_files.SHARDS_DIR
    missing = [name for name in ckpt_files.SHARDED_REQUIRED_FILES if not (ckpt / name).is_file()]
    if missing:
        raise CheckpointError(f"{ckpt}: incomplete checkpoint, missing {', '.join(missing)}")
    trainer_state = ckpt_files.read_trainer_state(ckpt)
    rng = ckpt_files.read_rng(ckpt) if restore_rng else None
    state = _state_dicts(model, optimizer, load=True)
    _check_names(_saved_entries(shards), state["model"], shards)
    try:
        with _one_process_ok():
            dcp.load(state, checkpoint_id=shards, no_dist=not world.distributed)
    except Exception as e:
        raise CheckpointError(f"{shards}: does not fit this run's model and optimizer ({_first_line(e)})") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(**_LOAD))
    if rng is not None:
        ckpt_files.restore_rng(rng)
    return trainer_state
