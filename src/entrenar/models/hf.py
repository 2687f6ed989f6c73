"""Hugging Face checkpoint folders: config.json + safetensors (sharded or not)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from entrenar.errors import ModelError
from entrenar.io import atomic
from entrenar.io.finite import check_finite
from entrenar.io.hf_files import INDEX_NAME, SINGLE_NAME, weight_files  # noqa: F401 - re-exported
from entrenar.io.json_files import read_json
from entrenar.io.safetensors_dtypes import SAFETENSORS_DTYPES
from entrenar.models import gpt_oss_layout
from entrenar.models.config import ModelConfig, rope_inv_freq
from entrenar.models.transformer import Transformer, to_empty_tied

# Replaces layers of a model still on the meta device (given the weights' dtype and device) by the layers its
# weights stream into, such as NF4 layers that quantize them as they arrive.
Sinks = Callable[[Transformer, torch.dtype, str | torch.device], None]


def read_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelError(f"{folder}: not a Hugging Face model folder (no config.json)")
    return ModelConfig.from_hf(read_json(path), source=str(path))


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (file name, tensor name, tensor) one tensor at a time, so memory stays at one tensor."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as reader:
                for name in reader.keys():
                    yield f.name, name, reader.get_tensor(name)
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelError(f"{f}: cannot read safetensors file ({e})") from None


def header_tensors(files: list[Path]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """As :func:`iter_safetensors`, with meta tensors of each tensor's shape and dtype: the headers only, no data
    read (a model built on the meta device checks its names, shapes and dtypes against the files)."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as reader:
                for name in reader.keys():
                    piece = reader.get_slice(name)
                    dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise ModelError(f"{f}: tensor '{name}' has dtype {piece.get_dtype()}, which this PyTorch "
                                         "cannot hold")
                    yield f.name, name, torch.empty(piece.get_shape(), dtype=dtype, device="meta")
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelError(f"{f}: cannot read safetensors file ({e})") from None


def stacked_expert_names(config: ModelConfig) -> dict[str, tuple[str, slice, int]]:
    """Stacked per-projection expert tensors [E, I, H] (GGUF's ffn_gate_exps / ffn_up_exps, read under the names
    ``mlp.experts.{gate,up}_proj``) -> (fused parameter, its rows, how many per-expert pieces each stands for)."""
    i_size = config.expert_intermediate_size
    names = {}
    for layer in config.moe_layers:
        ours = f"model.layers.{layer}.mlp.experts"
        names[f"{ours}.gate_proj"] = (f"{ours}.gate_up_proj", slice(0, i_size), config.num_experts)
        names[f"{ours}.up_proj"] = (f"{ours}.gate_up_proj", slice(i_size, 2 * i_size), config.num_experts)
    return names


def expert_checkpoint_names(config: ModelConfig) -> dict[str, tuple[str, int, slice]]:
    """Checkpoint tensor name -> (parameter name, expert, rows) for MoE layers whose names differ on disk.

    transformers keeps experts stacked in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows first;
    ``mlp.experts.down_proj`` [E, H, I]) but save_pretrained writes one tensor per expert and projection:
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, and for Mixtral ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``
    with the router as ``block_sparse_moe.gate.weight``. The empty slice means the whole parameter.
    """
    names: dict[str, tuple[str, int, slice]] = {}
    if config.model_type == "gpt_oss":
        return names  # stacked on disk too (models/gpt_oss_layout.py translates)
    i_size = config.expert_intermediate_size
    mixtral = config.model_type == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for layer in config.moe_layers:
        ours = f"model.layers.{layer}.mlp"
        disk = f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"
        if mixtral:
            names[f"{disk}.gate.weight"] = (f"{ours}.gate.weight", -1, slice(None))
        for e in range(config.num_experts):
            names[f"{disk}.experts.{e}.{gate}.weight"] = (f"{ours}.experts.gate_up_proj", e, slice(0, i_size))
            names[f"{disk}.experts.{e}.{up}.weight"] = (f"{ours}.experts.gate_up_proj", e, slice(i_size, 2 * i_size))
            names[f"{disk}.experts.{e}.{down}.weight"] = (f"{ours}.experts.down_proj", e, slice(None))
    return names


def _sink_name(disk: str) -> str:
    """A per-expert checkpoint name as NF4 experts' modules are named (Mixtral's w1/w3/w2 and block_sparse_moe)."""
    for old, new in ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                     (".w2.", ".down_proj.")):
        disk = disk.replace(old, new)
    return disk


def expert_checkpoint_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with stacked expert tensors split into the per-expert names save_pretrained writes (gpt-oss: in
    its own stacked layout)."""
    if config.model_type == "gpt_oss":
        return gpt_oss_layout.to_checkpoint(state)
    names = expert_checkpoint_names(config)
    if not names:
        return state
    stacked = {param for param, _, _ in names.values()}
    out = {n: t for n, t in state.items() if n not in stacked}
    for disk, (param, expert, rows) in names.items():
        tensor = state[param] if expert < 0 else state[param][expert][rows]
        out[disk] = tensor.contiguous()
    return out


def load_state_into(model: torch.nn.Module, tensors: Iterator[tuple[str, str, torch.Tensor]], source: str) -> None:
    """Copy named tensors into a model's parameters, checking names and shapes.

    Every parameter must be given exactly once (a tied lm_head may be absent);
    extra tensors are an error, since they mean the checkpoint is not this model.
    A module with `load_full_weight` (an NF4 layer) takes its full-precision
    weight as it streams past and quantizes it, so the whole model never exists
    in 16-bit.
    """
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    # A selection bias the checkpoint keeps (DeepSeek-V3's e_score_correction_bias) loads like a parameter.
    params.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    sinks = {f"{n}.weight": m for n, m in model.named_modules() if hasattr(m, "load_full_weight")}
    tied = {n for n, p in params.items() if any(p is q for m, q in params.items() if m != n)}
    config = cast(ModelConfig, model.config) if hasattr(model, "config") else None
    if config is not None and config.model_type == "gpt_oss":  # its router's name, its experts' layout, MXFP4
        # dequantized where the experts live (on a GPU, not half a CPU-minute per gpt-oss-20b layer)
        device = next((p.device for n, p in params.items() if n.endswith("experts.gate_up_proj")), None)
        # NF4 experts (QLoRA) take their weights one expert at a time, quantized as each arrives
        per_expert = {n.removesuffix("experts.0.gate_proj.weight") for n in sinks
                      if n.endswith(".mlp.experts.0.gate_proj.weight")}
        if per_expert and device is None:  # where the NF4 experts quantize
            sink = sinks[f"{min(per_expert)}experts.0.gate_proj.weight"]
            device = getattr(sink, "quantize_on", None) or cast(torch.Tensor, sink.weight_codes).device
        tensors = gpt_oss_layout.to_ours(tensors, device, per_expert)
    pieces = expert_checkpoint_names(config) if config is not None else {}
    stacked = stacked_expert_names(config) if config is not None else {}
    # NF4 experts take each expert's tensors as sinks named mlp.experts.{e}.{gate,up,down}_proj (Mixtral's
    # w1/w3/w2 renamed to them); the stacked parameters they replace are not expected.
    renamed = {disk: _sink_name(disk) for disk in pieces if _sink_name(disk) in sinks}
    pieces = {disk: piece for disk, piece in pieces.items() if piece[0] in params}
    stacked = {name: piece for name, piece in stacked.items() if piece[0] in params}
    pieces_left = {param: 0 for param, _, _ in pieces.values()}
    for param, _, _ in pieces.values():
        pieces_left[param] += 1
    seen: set[str] = set()
    for file_name, name, tensor in tensors:
        name = renamed.get(name, name)
        if name in stacked and name not in seen:
            param, rows, count = stacked[name]
            _copy_checked(params[param][:, rows], tensor, f"{source}/{file_name}", name)
            seen.add(name)
            pieces_left[param] -= count
            if not pieces_left[param]:
                seen.add(param)
            continue
        if name in pieces and name not in seen:
            param, expert, rows = pieces[name]
            _copy_checked(params[param] if expert < 0 else params[param][expert][rows], tensor,
                          f"{source}/{file_name}", name)
            seen.add(name)
            pieces_left[param] -= 1
            if not pieces_left[param]:
                seen.add(param)
            continue
        if name in sinks:
            sinks[name].load_full_weight(tensor, name=f"{source}/{file_name}: {name}")
            seen.add(name)
            continue
        if name not in params:
            if name.endswith("rotary_emb.inv_freq") or _next_token_layer(config, name):
                continue  # older checkpoints store RoPE buffers; we compute them
            raise ModelError(f"{source}/{file_name}: tensor '{name}' does not belong to a "
                             f"{cast(ModelConfig, model.config).model_type} model of this shape")
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ModelError(
                f"{source}/{file_name}: tensor '{name}' has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        seen.add(name)
    expected = [*params, *sinks]
    missing = [n for n in expected if n not in seen and not (n in tied and any(t in seen for t in tied))]
    # A stacked expert tensor that came piece by piece: name the pieces that never came.
    missing = [m for n in missing
               for m in ([d for d, (p, _, _) in pieces.items() if p == n and d not in seen]
                         if n in pieces_left else [n])]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelError(f"{source}: missing tensors {', '.join(missing[:5])}{more}")


def _next_token_layer(config: ModelConfig | None, name: str) -> bool:
    """Whether ``name`` belongs to a DeepSeek-V3 multi-token-prediction layer (``model.layers.{num_layers + i}``,
    ``num_nextn_predict_layers`` of them): released checkpoints carry them for speculative decoding, which
    transformers skips on load too; training and saving leave them out."""
    if config is None or not config.extra.get("num_nextn_predict_layers") or not name.startswith("model.layers."):
        return False
    layer = name.split(".")[2]
    return layer.isdigit() and config.num_layers <= int(layer) < config.num_layers + \
        int(config.extra["num_nextn_predict_layers"])


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor, where: str, name: str) -> None:
    """Copy a checkpoint tensor into (a view of) a parameter, naming it when the shapes differ."""
    if tuple(tensor.shape) != tuple(target.shape):
        raise ModelError(f"{where}: tensor '{name}' has shape {tuple(tensor.shape)}, the model expects "
                         f"{tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(tensor)


def empty_model(
    config: ModelConfig, dtype: torch.dtype, device: str | torch.device, sinks: Sinks | None = None
) -> Transformer:
    """A model with allocated but uninitialised weights (no wasted random init for big models).

    ``sinks(model, dtype, device)`` replaces layers of the model while it is still on the meta device by the
    layers the weights stream into: :func:`entrenar.quant.nf4.sinks.nf4_sinks` makes every linear layer but the
    output head an empty NF4 layer (QLoRA's frozen base). The model itself knows nothing of quantization.
    """
    with torch.device("meta"):
        model = Transformer(config)
    if sinks is not None:
        sinks(model, dtype, device)
    # Cast on the meta device first: allocating in fp32 and casting after held both copies at once, twice
    # the bf16 weights at load (27.9 GiB for a Llama-8B shape whose weights are 14 GiB).
    model = to_empty_tied(model.to(dtype), device)
    model.inv_freq = rope_inv_freq(config).to(device)  # kept in fp32 whatever the weights' dtype
    return model


def stored_elements(files: list[Path]) -> int:
    """How many values the safetensors files hold, from their headers (no tensor data is read)."""
    total = 0
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as reader:
                for name in reader.keys():
                    total += math.prod(reader.get_slice(name).get_shape())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelError(f"{f}: cannot read safetensors file ({e})") from None
    return total


def check_size(config: ModelConfig, files: list[Path], source: str) -> None:
    """Refuse a config that describes more parameters than the weights hold, before allocating them.

    A damaged config.json (``vocab_size: 10**12``) would otherwise ask for
    terabytes before any tensor is compared. Quantized folders hold fewer
    values than parameters (two 4-bit codes a byte), so a quarter of the
    count is enough here; the exact check is per tensor, while loading.
    """
    stored = stored_elements(files)
    needed = config.num_parameters
    if stored * 4 < needed:  # 4: two 4-bit codes a byte in a quantized folder, with margin
        raise ModelError(
            f"{source}/config.json describes a model of {needed:,} parameters but its weights hold {stored:,} "
            f"values (vocab_size {config.vocab_size:,}, hidden_size {config.hidden_size:,}, "
            f"intermediate_size {config.intermediate_size:,}, {config.num_layers} layers): the config does not "
            "belong to these weights"
        )


def load_hf(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    sinks: Sinks | None = None,
) -> Transformer:
    """Load a Hugging Face checkpoint folder into a native model; ``sinks`` as in :func:`empty_model` (an NF4
    base: :func:`entrenar.quant.nf4.sinks.nf4_sinks`)."""
    folder = Path(folder)
    if not folder.exists():
        raise ModelError(f"{folder}: no such model folder")
    config = read_config(folder)
    files = weight_files(folder)
    check_size(config, files, str(folder))
    model = empty_model(config, dtype, device, sinks)
    meta = torch.device(device).type == "meta"  # the structure only (an FSDP rank that receives its shards)
    load_state_into(model, (header_tensors if meta else iter_safetensors)(files), str(folder))
    return model


def _shards(state: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def folder_config(model: Transformer) -> tuple[dict[str, Any], dict[str, str]]:
    """config.json's contents and the model's own extra files (a classifier writes its *ForSequenceClassification
    config and classifier.json)."""
    config = (cast(Callable[[], dict[str, Any]], model.hf_config)() if hasattr(model, "hf_config")
              else model.config.to_hf())
    own_files = cast(Callable[[], dict[str, str]], model.saved_files)() if hasattr(model, "saved_files") else {}
    return config, own_files


def write_weight_shards(target: Path, shards: Iterable[dict[str, torch.Tensor]], count: int) -> None:
    """``count`` shards into ``target``: model.safetensors alone, or model-0000i-of-0000n.safetensors and their
    index. ``shards`` may be produced one at a time (FSDP's streamed save): each is dropped once written."""
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        name = SINGLE_NAME if count == 1 else f"model-{i:05d}-of-{count:05d}.safetensors"
        save_file(shard, str(target / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        total += sum(t.numel() * t.element_size() for t in shard.values())
        del shard
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (target / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def save_hf(
    model: Transformer,
    folder: str | Path,
    max_shard_bytes: int = 5 * 2**30,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write a folder that transformers' from_pretrained loads back.

    The folder is written beside the target and renamed into place, so an
    interrupted save never leaves a half-written model where a good one was.
    """
    folder = Path(folder)
    state = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    check_finite(state, folder, ModelError)
    state = expert_checkpoint_state(model.config, state)
    with atomic.staged_folder(folder) as tmp:
        config, own_files = folder_config(model)
        extra_files = {**own_files, **(extra_files or {})}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        shards = _shards(state, max_shard_bytes)
        write_weight_shards(tmp, shards, len(shards))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
    return folder
