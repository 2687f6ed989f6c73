"""Quantized model folders: a Hugging Face layout whose linear layers hold integer or NF4 codes.

    save_quantized(model, tokenizer, "out")   # after quantize_model_int / quantize_model_nf4 / convert_qat
    model, tokenizer = entrenar.load("out")   # the same quantized modules, the same outputs

A folder is ``config.json`` + safetensors + tokenizer files, like any model
folder. ``config.json`` carries a ``quantization_config`` entry that says how
to rebuild the layers, so the folder describes itself::

    "quantization_config": {
      "quant_method": "entrenar", "format_version": 1,
      "method": "int", "bits": 4, "symmetric": true, "granularity": "group", "group_size": 32,
      "activation_bits": null, "activation_scale": null,
      "modules": ["model.layers.0.self_attn.q_proj", ...],
      "source": "ptq", "calibration": "minmax"            # how it was made; not needed to load
    }

(NF4: ``"method": "nf4", "bits": 4, "blocksize": 64, "double_quant": true``.)
A quantized layer ``L`` stores the buffers of its module under ``L.<buffer>``:
integer layers ``L.weight_codes`` (int8, or uint8 when asymmetric; two codes
per byte at 4 bits and fewer), ``L.weight_scale`` (fp32 [rows, groups]),
``L.weight_zero`` (uint8, asymmetric only) and ``L.act_scale`` (fp32, static
activation quantization only); NF4 layers ``L.weight_codes``,
``L.weight_absmax`` and, double-quantized, ``L.weight_absmax_scale`` and
``L.weight_absmax_offset`` (see :mod:`entrenar.quant.nf4.format`); ``L.bias`` if any.
Everything else (embeddings, norms, the output head) is stored as usual.

``quant_method: "entrenar"`` is not a transformers method: transformers 5
loads such a folder with the quantized layers freshly initialised (and says
so in its load report), so read it with ``entrenar.load``. Loading checks every tensor's name, shape, dtype and
range against the config, so a truncated or edited file is a :class:`QuantError` naming the
tensor and file, never a model that computes garbage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from entrenar.adapters.lora import LoraLinear
from entrenar.errors import ModelError, QuantError
from entrenar.io import atomic
from entrenar.models.config import rope_inv_freq
from entrenar.models.hf import check_size, header_tensors, iter_safetensors, read_config, save_hf, weight_files
from entrenar.models.saving import generation_config
from entrenar.models.surgery import named_linears, replace_module
from entrenar.models.transformer import Transformer, to_empty_tied
from entrenar.quant.int import (
    BITSTREAM_BITS,
    MAX_BITS,
    MIN_BITS,
    IntQuantTensor,
    QuantLinear,
    codes_per_row_bytes,
    qrange,
)
from entrenar.quant.int import _pack_codes as pack_codes
from entrenar.quant.int import _unpack_codes as unpack_codes
from entrenar.quant.int import _unpack_nibbles as unpack_nibbles
from entrenar.quant.nf4.format import BLOCKSIZES, NF4Linear
from entrenar.quant.qat import FakeQuantLinear, QATConfig, QuantizedLoraLinear, merged_quant_layers, swapped

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer

QUANT_METHOD = "entrenar"
# 2: 2- and 3-bit codes as one bit stream per row (written only for those widths: every other folder is still 1,
# and a format-1 folder of 2 or 3 bits, two codes per byte, is read and repacked)
FORMAT_VERSION = 2
FORMAT_VERSIONS = (1, 2)
GRANULARITIES = ("tensor", "channel", "group")
# Keys that rebuild the layers; anything else in quantization_config is provenance.
_LAYOUT_KEYS = ("method", "bits", "symmetric", "granularity", "group_size", "activation_bits", "activation_scale",
                "blocksize", "double_quant")


# ---------------------------------------------------------------- describing a quantized model


def _describe(layer: QuantLinear | NF4Linear) -> dict[str, Any]:
    """The layout of one quantized layer, in the words of ``quantization_config``."""
    if isinstance(layer, NF4Linear):
        return {"method": "nf4", "bits": 4, "blocksize": layer.blocksize,
                "double_quant": layer.weight_absmax_scale is not None}
    rows, groups = layer.weight_scale.shape
    if rows == 1 and groups == 1:
        granularity, group_size = "tensor", None
    elif groups == 1:
        granularity, group_size = "channel", None
    else:
        granularity, group_size = "group", layer.in_features // groups
    static = layer.act_bits is not None and layer.act_scale is not None
    return {
        "method": "int",
        "bits": layer.bits,
        "symmetric": layer.weight_zero is None,
        "granularity": granularity,
        "group_size": group_size,
        "activation_bits": layer.act_bits,
        "activation_scale": None if layer.act_bits is None else ("static" if static else "dynamic"),
    }


def quantization_config(
    model: nn.Module, info: dict[str, Any] | None = None, group_size: int | None = None
) -> dict[str, Any]:
    """The ``quantization_config`` entry that describes ``model``'s quantized layers.

    Every quantized layer must share one layout (the entry describes them all);
    ``info`` adds provenance such as ``{"source": "ptq", "calibration": "minmax"}``.
    A layer exactly one group wide has one scale per row, as a per-channel
    layer has: with ``group_size`` (the size the layers were quantized with),
    or when the other layers agree on one, it is described as a group layer,
    which is what it is, so the folder keeps one layout.
    """
    adapters = [n for n, m in model.named_modules() if isinstance(m, LoraLinear)]
    if adapters:
        raise QuantError(
            f"{adapters[0]}: the model has LoRA layers; save the adapter on its own (or merge it and quantize again) "
            "before saving a quantized model"
        )
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (QuantLinear, NF4Linear))}
    if not layers:
        raise QuantError(f"{type(model).__name__} has no quantized layers to save (quantize it first)")
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and "lm_head" in layers:
        raise QuantError("lm_head: the output head is tied to the embeddings and cannot be stored quantized")
    described = {name: _describe(layer) for name, layer in layers.items()}
    sizes = {d["group_size"] for d in described.values() if d.get("granularity") == "group"}
    if group_size is None and len(sizes) == 1:
        group_size = sizes.pop()
    if group_size is not None:
        for name, d in described.items():
            if d.get("granularity") == "channel" and layers[name].in_features == group_size:
                d.update(granularity="group", group_size=group_size)
    first, layout = next(iter(layers)), described[next(iter(layers))]
    for name in layers:
        other = described[name]
        if other != layout:
            diff = next(k for k in _LAYOUT_KEYS if other.get(k) != layout.get(k))
            raise QuantError(
                f"{name}: {diff}={other.get(diff)!r} but {first} has {diff}={layout.get(diff)!r}; "
                "a quantized folder holds one layout for all its layers"
            )
    clash = sorted(set(info or {}) & {"quant_method", "format_version", "modules", *_LAYOUT_KEYS})
    if clash:
        raise QuantError(f"info may not set {clash[0]!r}: it is derived from the layers")
    version = FORMAT_VERSION if layout["method"] == "int" and layout["bits"] in BITSTREAM_BITS else 1
    return {"quant_method": QUANT_METHOD, "format_version": version, **layout, "modules": list(layers),
            **(info or {})}


# ---------------------------------------------------------------- writing


def save_quantized(
    model: Transformer,
    tokenizer: Tokenizer | None,
    folder: str | Path,
    info: dict[str, Any] | None = None,
    group_size: int | None = None,
) -> Path:
    """Write ``model`` (its quantized layers as codes and scales) and ``tokenizer`` to ``folder``.

    The folder is built beside the target and renamed into place, so an
    interrupted save leaves the previous folder (or none), never half of one.
    ``group_size``: see :func:`quantization_config`.
    """
    folder = Path(folder)
    entry = quantization_config(model, info, group_size)
    with atomic.staged_folder(folder) as target:
        save_hf(model, target)
        config_path = target / "config.json"
        config = json.loads(config_path.read_text())
        config["quantization_config"] = entry
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(target)
            # the ids that stop generation beyond EOS (end of turn) live only in generation_config.json
            (target / "generation_config.json").write_text(json.dumps(generation_config(tokenizer, None), indent=2)
                                                           + "\n")
    return folder


def save_qat_model(model: nn.Module, tokenizer: Tokenizer | None, folder: str | Path) -> Path:
    """Write the integer model a QAT run trained, leaving ``model`` as it is.

    Each fake-quantized layer is saved as the :class:`QuantLinear` that computes
    what it computes now. With ``qat.quantize_lora`` each adapted layer is saved merged, ``Q(W + BA)``, which is
    what it trained. Otherwise, in LoRA-QAT the adapters stay out: the folder is the
    integer base, and ``load(folder, adapter=...)`` with the run's
    adapter reproduces the trained model exactly (merging the adapter into
    integer weights would re-quantize, i.e. change, the model).
    """
    replacements: dict[str, nn.Module] = {}
    cfg: QATConfig | None = None
    merged = merged_quant_layers(model)
    for name, layer in named_linears(model):
        base = layer.base_layer if isinstance(layer, LoraLinear) else layer
        if isinstance(layer, QuantizedLoraLinear):  # qat.quantize_lora: Q(W + BA) is what was trained
            replacements[name], cfg = merged[name], cast(FakeQuantLinear, base).cfg
        elif isinstance(base, FakeQuantLinear):
            replacements[name], cfg = base.to_quant_linear(), base.cfg
        elif base is not layer:
            replacements[name] = base
    if cfg is None:
        raise QuantError(f"{type(model).__name__} has no fake-quantized layers; call prepare_qat first")
    with swapped(model, replacements):
        info = {"source": "qat", "backward": cfg.backward}
        if cfg.quantize_lora:
            info["lora"] = "merged"  # the adapter is inside the integer weights: load this folder without it
        return save_quantized(cast(Transformer, model), tokenizer, folder, info=info)


# ---------------------------------------------------------------- reading


def read_quantization_config(folder: str | Path) -> dict[str, Any] | None:
    """The folder's entrenar ``quantization_config`` (validated), or None when it has none."""
    path = Path(folder) / "config.json"
    try:
        entry = json.loads(path.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError, RecursionError):  # ValueError: bad JSON or UTF-8
        return None  # not a readable model config: loading it reports why
    if not isinstance(entry, dict) or entry.get("quant_method") != QUANT_METHOD:
        return None
    _check_entry(entry, path)
    return entry


def is_quantized_folder(folder: str | Path) -> bool:
    """True for a folder written by :func:`save_quantized`."""
    return Path(folder).is_dir() and read_quantization_config(folder) is not None


def _check_entry(entry: dict[str, Any], path: Path) -> None:
    def bad(key: str, expected: str) -> QuantError:
        return QuantError(f"{path}: quantization_config.{key} must be {expected}, got {entry.get(key)!r}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if entry.get("format_version") not in FORMAT_VERSIONS:
        raise bad("format_version", f"one of {FORMAT_VERSIONS} (written by a newer entrenar version?)")
    modules = entry.get("modules")
    if not isinstance(modules, list) or not modules or not all(isinstance(m, str) and m for m in modules):
        raise bad("modules", "a non-empty list of module names")
    method = entry.get("method")
    if method == "nf4":
        if entry.get("bits") != 4:
            raise bad("bits", "4 for nf4")
        if entry.get("blocksize") not in BLOCKSIZES:
            raise bad("blocksize", f"one of {BLOCKSIZES}")
        if not isinstance(entry.get("double_quant"), bool):
            raise bad("double_quant", "true or false")
        return
    if method != "int":
        raise bad("method", "'int' or 'nf4'")
    if not (is_int(entry.get("bits")) and MIN_BITS <= entry["bits"] <= MAX_BITS):
        raise bad("bits", f"an integer in [{MIN_BITS}, {MAX_BITS}]")
    if not isinstance(entry.get("symmetric"), bool):
        raise bad("symmetric", "true or false")
    if entry.get("granularity") not in GRANULARITIES:
        raise bad("granularity", f"one of {GRANULARITIES}")
    if entry["granularity"] == "group" and not (is_int(entry.get("group_size")) and entry["group_size"] > 0):
        raise bad("group_size", "a positive integer for granularity 'group'")
    act_bits = entry.get("activation_bits")
    if act_bits is not None:
        if not (is_int(act_bits) and MIN_BITS <= act_bits <= MAX_BITS):
            raise bad("activation_bits", f"null or an integer in [{MIN_BITS}, {MAX_BITS}]")
        if entry.get("activation_scale") not in ("static", "dynamic"):
            raise bad("activation_scale", "'static' or 'dynamic' when activation_bits is set")


def _empty_layer(linear: nn.Linear, entry: dict[str, Any], dtype: torch.dtype, device: torch.device,
                 where: str) -> nn.Module:
    """An uninitialised quantized layer of ``linear``'s shape, laid out as ``entry`` says."""
    out_f, in_f, has_bias = linear.out_features, linear.in_features, linear.bias is not None
    if entry["method"] == "nf4":
        return NF4Linear(in_f, out_f, has_bias, dtype, entry["blocksize"], entry["double_quant"], device)
    bits, symmetric, granularity = entry["bits"], entry["symmetric"], entry["granularity"]
    rows, groups = (1, 1) if granularity == "tensor" else (out_f, 1)
    if granularity == "group":
        if in_f % entry["group_size"]:
            raise QuantError(f"{where}: group_size {entry['group_size']} does not divide in_features {in_f}")
        groups = in_f // entry["group_size"]
    if bits == 4 and in_f % 2:
        raise QuantError(f"{where}: {bits}-bit codes are packed two per byte and need an even in_features, got {in_f}")
    codes_shape = (out_f, codes_per_row_bytes(in_f, bits))
    codes_dtype = torch.int8 if symmetric and bits > 4 else torch.uint8
    q = IntQuantTensor(
        codes=torch.empty(codes_shape, dtype=codes_dtype, device=device),
        scale=torch.empty(rows, groups, dtype=torch.float32, device=device),
        zero=None if symmetric else torch.empty(rows, groups, dtype=torch.uint8, device=device),
        bits=bits,
        shape=torch.Size((out_f, in_f)),
        dtype=dtype,
    )
    bias = torch.empty(out_f, dtype=dtype, device=device) if has_bias else None
    static = entry["activation_bits"] is not None and entry["activation_scale"] == "static"
    act_scale = torch.empty((), dtype=torch.float32, device=device) if static else None
    return QuantLinear(q, bias, act_bits=entry["activation_bits"], act_scale=act_scale)


def _skeleton(folder: Path, entry: dict[str, Any], dtype: torch.dtype, device: torch.device) -> Transformer:
    """The model with its quantized layers in place and nothing loaded yet."""
    config = read_config(folder)
    check_size(config, weight_files(folder), str(folder))  # before a damaged config allocates its size
    with torch.device("meta"):
        model = Transformer(config)
    # Cast on the meta device: allocating the unquantized weights (embeddings, a float head, norms) in fp32 and
    # casting after held both at once (for an 8B shape's table and head, 4 GiB of fp32 to make 2 of bf16).
    model = model.to(dtype)
    where = f"{folder / 'config.json'}: quantization_config.modules"
    layers = {}
    for name in entry["modules"]:
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise QuantError(f"{where}: {name!r} is not a module of this {config.model_type} model") from None
        if not isinstance(linear, nn.Linear):
            raise QuantError(f"{where}: {name!r} is a {type(linear).__name__}, not a linear layer")
        if name == "lm_head" and config.tie_word_embeddings:
            raise QuantError(f"{where}: 'lm_head' is tied to the embeddings and cannot be quantized")
        layers[name] = _empty_layer(linear, entry, dtype, device, f"{where}: {name}")
    for name, layer in layers.items():  # built on the device: a quantized layer's scales never go through meta
        replace_module(model, name, layer)
    model = to_empty_tied(model, device).to(dtype)
    model.inv_freq = rope_inv_freq(config).to(device)
    return model


def _check_values(name: str, layer: nn.Module, entry: dict[str, Any], origin: dict[str, str]) -> None:
    """Refuse codes and scales no quantizer writes: non-finite or non-positive scales, codes off the grid."""

    def fail(buffer: str, problem: str) -> QuantError:
        key = f"{name}.{buffer}"
        return QuantError(f"{origin.get(key, '?')}: tensor '{key}' {problem}")

    if isinstance(layer, NF4Linear):
        for buffer in ("weight_absmax", "weight_absmax_scale", "weight_absmax_offset"):
            t = getattr(layer, buffer)
            if t is not None and t.is_floating_point() and not torch.isfinite(t).all():
                raise fail(buffer, "holds NaN/inf values")
        return
    layer = cast(QuantLinear, layer)  # _skeleton builds every other quantized layer as one
    for buffer in ("weight_scale", "act_scale"):
        t = getattr(layer, buffer)
        if t is not None and not (torch.isfinite(t).all() and (t > 0).all()):
            raise fail(buffer, "holds a scale that is not a finite positive number")
    qmin, qmax = qrange(layer.bits, layer.weight_zero is None)
    if layer.weight_zero is not None and (layer.weight_zero > qmax).any():
        raise fail("weight_zero", f"holds a zero point above {qmax}, the largest {layer.bits}-bit code")
    if layer.bits not in (4, 8):  # 4- and 8-bit storage holds only valid codes
        symmetric = layer.weight_zero is None
        codes = unpack_codes(layer.weight_codes, layer.bits, symmetric, layer.in_features)
        if ((codes < qmin) | (codes > qmax)).any():
            raise fail("weight_codes", f"holds codes outside [{qmin}, {qmax}], the {layer.bits}-bit grid")
        if layer.bits in BITSTREAM_BITS and not torch.equal(pack_codes(codes, layer.bits, symmetric),
                                                             layer.weight_codes):
            raise fail("weight_codes", "has bits set in the padding after a row's last code")


def load_quantized(
    folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    """Load a folder written by :func:`save_quantized` into the same quantized modules.

    ``dtype`` is the compute dtype: unquantized weights and biases are cast to
    it and quantized weights dequantize to it; codes and fp32 scales load as stored.
    """
    folder, device = Path(folder), torch.device(device)
    entry = read_quantization_config(folder)
    if entry is None:
        raise QuantError(f"{folder}: not a quantized entrenar folder (config.json has no quantization_config "
                         f"with quant_method {QUANT_METHOD!r})")
    model = _skeleton(folder, entry, dtype, device)
    quantized = {name: model.get_submodule(name) for name in entry["modules"]}
    quantized_keys = {f"{name}.{k}" for name, layer in quantized.items() for k, _ in layer.state_dict().items()}
    targets = model.state_dict(keep_vars=True)
    files = weight_files(folder)
    origin: dict[str, str] = {}
    legacy = entry["format_version"] == 1 and entry["method"] == "int" and entry["bits"] in BITSTREAM_BITS
    meta = device.type == "meta"  # the structure only (an FSDP rank that receives its shards): headers, no data
    for file_name, key, tensor in (header_tensors if meta else iter_safetensors)(files):
        where = f"{folder / file_name}: tensor '{key}'"
        error = QuantError if key in quantized_keys or key.rsplit(".", 1)[0] in quantized else ModelError
        if key not in targets:
            if key.endswith("rotary_emb.inv_freq"):
                continue  # older checkpoints store RoPE buffers; the model computes them
            raise error(f"{where} does not belong to this model "
                        f"({entry['method']}, {entry['bits']} bits, {len(quantized)} quantized layers)")
        target = targets[key]
        if legacy and key in quantized_keys and key.endswith(".weight_codes"):  # format 1: two codes per byte
            in_features = quantized[key.rsplit(".", 1)[0]].in_features
            if tensor.dim() == 2 and tensor.shape[1] * 2 == in_features and tensor.dtype == torch.uint8:
                symmetric = entry["symmetric"]
                tensor = (torch.empty(target.shape, dtype=torch.uint8, device="meta") if meta else
                          pack_codes(unpack_nibbles(tensor, entry["bits"], symmetric), entry["bits"], symmetric))
        if tuple(tensor.shape) != tuple(target.shape):
            raise error(f"{where} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        exact = key in quantized_keys and not key.endswith(".bias")  # codes and scales load as stored
        if (exact and tensor.dtype != target.dtype) or tensor.is_floating_point() != target.is_floating_point():
            raise error(f"{where} has dtype {tensor.dtype}, expected {target.dtype}")
        with torch.no_grad():
            target.copy_(tensor)
        origin[key] = str(folder / file_name)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    missing = [k for k in targets if k not in origin and k not in tied]
    if missing:
        names = ", ".join(f.name for f in files)
        error = QuantError if missing[0] in quantized_keys else ModelError
        more = f" ({len(missing)} missing in all)" if len(missing) > 1 else ""
        raise error(f"{folder}: tensor '{missing[0]}' is missing from {names}{more}")
    for name, layer in quantized.items():
        if not meta:  # the rank that read the values checks them
            _check_values(name, layer, entry, origin)
    return model
