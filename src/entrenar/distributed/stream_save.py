"""A sharded (FSDP2) full fine-tune's final model folder, written one tensor at a time.

:func:`entrenar.distributed.state.full_params` gathers every parameter on every rank at once (an 8B model in fp32:
32 GB of host memory per rank) before rank 0 writes. Here each tensor is gathered in turn (a collective every rank
enters, in ``state_dict`` order); rank 0 keeps it until its safetensors file (at most ``max_shard_bytes``, as
:func:`entrenar.models.hf.save_hf` splits them) is written, the other ranks drop it at once. The folder is the one
:func:`entrenar.models.saving.save_model_folder` writes for the same model: the same files, names, dtypes, metadata.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from entrenar.distributed.state import gather_whole, is_dtensor_shard, is_sharded
from entrenar.errors import ModelError
from entrenar.io import atomic
from entrenar.io.finite import first_nonfinite
from entrenar.models.hf import expert_checkpoint_names, folder_config, write_weight_shards
from entrenar.models.saving import generation_config, record_dtype, write_beside_weights

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.distributed.world import World
    from entrenar.models.transformer import Transformer


def streams(model: nn.Module) -> bool:
    """Whether ``model``'s folder can be streamed: sharded, and saved under its own parameter names (MoE expert
    layouts are rewritten from whole stacked tensors, so they keep the gathered path)."""
    config = getattr(model, "config", None)
    return (is_sharded(model) and config is not None and config.model_type != "gpt_oss"
            and not expert_checkpoint_names(config))


def _saved(model: Transformer) -> dict[str, Any]:
    """The tensors save_hf writes, as this rank holds them (shards or plain), in its order."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # groups left gathered after a forward register their shards again
    state = {n: t.detach() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _groups(state: dict[str, Any], max_shard_bytes: int) -> list[list[str]]:
    """The names in each file, split by global size as save_hf's ``_shards`` splits whole tensors."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _check_finite(world: World, state: dict[str, Any], where: Path) -> None:
    """save_hf's refusal of NaN/inf, on each rank's shards; every rank raises the same error (nothing written)."""
    local = [(n, t.to_local() if is_dtensor_shard(t) else t) for n, t in state.items()]
    found = world.all_gather(first_nonfinite(local))
    bad = [b for b in found if b is not None]
    if bad:
        order = list(state)
        name = min((b[0] for b in bad), key=order.index)
        count = sum(c for n, c in bad if n == name)
        raise ModelError(f"{where}: tensor {name!r} holds {count:,} non-finite value(s) (NaN/inf); nothing was "
                         "written (weights that diverged in training: lower optimizer.lr; see training.nonfinite)")


def _gathered(state: dict[str, Any], names: list[str], keep: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Each tensor of ``names`` whole, on the CPU (one collective each); None where this rank does not ``keep``."""
    for name in names:
        tensor = state[name]
        if not keep:
            if is_dtensor_shard(tensor):
                tensor.full_tensor()  # this rank's part in the collective; nothing kept, nothing copied
            yield name, None
            continue
        yield name, gather_whole(tensor) if is_dtensor_shard(tensor) else tensor.contiguous().cpu()


def save_model_folder_streamed(world: World, model: Transformer, tokenizer: Tokenizer | None, output: Path,
                               base: Path | None = None, max_shard_bytes: int = 5 * 2**30) -> Path:
    """``save_model_folder`` for a sharded model, a collective: no rank holds more than one file's tensors."""
    state = _saved(model)
    _check_finite(world, state, output)
    groups = _groups(state, max_shard_bytes)
    error: BaseException | None = None
    if world.is_main:
        record_dtype(model)
    written: list[int] = []  # rank 0: the groups gathered so far
    try:
        if world.is_main:
            generation = generation_config(tokenizer, base)
            with atomic.staged_folder(output) as target:
                _write_hf(model, state, groups, target, written)
                write_beside_weights(tokenizer, target, generation)
        else:
            for names in groups:
                for _ in _gathered(state, names, keep=False):
                    pass
    except BaseException as e:  # rank 0: the other ranks still gather the rest; then all stop with it
        error = e
    finally:
        for names in groups[len(written):] if world.is_main and error is not None else []:
            for _ in _gathered(state, names, keep=False):
                pass
    return world.main_only(_result, error, output)


def _result(error: BaseException | None, output: Path) -> Path:
    if error is not None:
        raise error
    return output


def _write_hf(model: Transformer, state: dict[str, Any], groups: list[list[str]], target: Path,
              written: list[int]) -> None:
    """save_hf's files into ``target``, one file's tensors gathered at a time."""
    config, extra_files = folder_config(model)
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    def shards() -> Iterator[dict[str, torch.Tensor]]:
        for i, names in enumerate(groups, 1):
            shard = {name: cast(torch.Tensor, whole) for name, whole in _gathered(state, names, keep=True)}
            written.append(i)
            yield shard
            del shard  # before the next file's tensors are gathered

    write_weight_shards(target, shards(), len(groups))
    for name, text in extra_files.items():
        (target / name).write_text(text)
