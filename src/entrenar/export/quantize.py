"""Post-training quantization of a whole model folder: what ``entrenar quantize`` runs.

    result = quantize_pretrained("model", "model-int4", "int4", group_size=32, data="valid.jsonl")
    for layer in result.layers: print(layer)          # how far each quantized weight moved
    print(result.before.perplexity, result.after.perplexity)

Every linear layer but the output head is quantized (the head stays in full
precision, as in QLoRA, GPTQ and llama.cpp's defaults: it is one layer and
the most sensitive one). The result is written by
:func:`entrenar.quant.checkpoint.save_quantized`, so ``entrenar.load`` reads it back.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from entrenar.errors import ConfigError, QuantError
from entrenar.evaluation.loss import evaluate_file
from entrenar.evaluation.rules import EvalRules, eval_rules
from entrenar.export import stored_dtype
from entrenar.io import hub
from entrenar.io.outputs import check_output, replace_files
from entrenar.loading import load, read_model_config
from entrenar.loading.runs import resolve_model_and_adapter
from entrenar.models.surgery import ALL_LINEAR, find_linears
from entrenar.models.transformer import Transformer
from entrenar.quant.checkpoint import is_quantized_folder, quantization_config, save_quantized
from entrenar.quant.int import (
    MAX_BITS,
    MIN_BITS,
    Calibration,
    LayerError,
    QuantLinear,
    quantize_model_int,
    weight_error,
)
from entrenar.quant.nf4.format import BLOCKSIZES, NF4Linear, quantize_model_nf4

if TYPE_CHECKING:
    from entrenar.evaluation.loss import EvalResult

NF4_BLOCKSIZE = 64  # bitsandbytes' (and QLoRA's) default
DEFAULT_PERCENTILE = 99.9


@dataclass
class QuantizeResult:
    """What :func:`quantize_pretrained` did: the folder, each layer's error, and perplexity around it."""

    output: Path
    method: str
    layers: list[LayerError]
    bytes_before: int  # bytes of the quantized layers' weights before and after
    bytes_after: int
    before: EvalResult | None = None
    after: EvalResult | None = None
    config: dict[str, Any] = field(default_factory=dict)
    disk_before: int = 0  # bytes on disk of the input (folder or GGUF file) and of the written folder
    disk_after: int = 0
    dtype: str = ""  # the dtype the unquantized weights (embeddings, norms, the head) are stored in
    rules: EvalRules | None = None  # how ``data`` was scored (with ``data``)
    run_dir: Path | None = None  # the run whose recipe gave those rules


def parse_method(method: str) -> tuple[str, int]:
    """``"nf4"`` -> ("nf4", 4); ``"int<b>"`` -> ("int", b) for b in 2..8."""
    if method == "nf4":
        return "nf4", 4
    m = re.fullmatch(r"int(\d+)", method)
    if m is None:
        raise QuantError(f"unknown quantization method {method!r} (supported: nf4, int8, int4, or int2 to int8)")
    bits = int(m.group(1))
    if not MIN_BITS <= bits <= MAX_BITS:
        raise QuantError(f"{method}: unsupported bit width {bits}; integer quantization supports {MIN_BITS} to "
                         f"{MAX_BITS} bits")
    return "int", bits


def check_options(
    method: str, symmetric: bool, calibration: Calibration, percentile: float | None
) -> tuple[str, int, float]:
    """(kind, bits, percentile) of settings that go together; raises before any weight is read."""
    kind, bits = parse_method(method)
    if calibration not in ("minmax", "percentile"):
        raise QuantError(f"calibration must be 'minmax' or 'percentile', got {calibration!r}")
    if percentile is not None and calibration != "percentile":
        raise QuantError(f"percentile {percentile} is used only with calibration 'percentile', not {calibration!r}")
    if percentile is not None and not 0 < percentile <= 100:
        raise QuantError(f"percentile must be in (0, 100], got {percentile}")
    if kind == "nf4" and (not symmetric or calibration != "minmax"):
        raise QuantError("nf4 scales each block by its absolute maximum; asymmetric and percentile calibration "
                         "apply to integer methods (int8, int4)")
    return kind, bits, DEFAULT_PERCENTILE if percentile is None else percentile


def quantize_model(
    model: nn.Module,
    method: str,
    group_size: int | None = None,
    symmetric: bool = True,
    calibration: Calibration = "minmax",
    percentile: float | None = None,
) -> tuple[list[LayerError], dict[str, Any]]:
    """Quantize every linear layer of ``model`` but the output head, in place.

    ``method`` is "nf4" or "int<bits>". ``group_size``: the NF4 block size
    (default 64), or the integer group size (default None: one scale per output
    channel). ``percentile`` goes with ``calibration="percentile"`` (default
    99.9). Returns each layer's error and the provenance to store beside the
    layout (:func:`~entrenar.quant.checkpoint.save_quantized`'s ``info``).
    Nothing is replaced unless every layer quantizes.
    """
    kind, bits, percentile = check_options(method, symmetric, calibration, percentile)
    check_shapes(model, method, group_size)
    if kind == "nf4":
        names = find_linears(model, ALL_LINEAR)
        originals = {name: cast(nn.Linear, model.get_submodule(name)) for name in names}
        quantize_model_nf4(model, ALL_LINEAR, blocksize=group_size or NF4_BLOCKSIZE)
        errors = [weight_error(originals[n].weight, cast(NF4Linear, model.get_submodule(n)).weight, n) for n in names]
        return errors, {"source": "ptq"}
    errors = quantize_model_int(model, ALL_LINEAR, bits=bits, group_size=group_size, symmetric=symmetric,
                                calibration=calibration, percentile=percentile)
    info: dict[str, Any] = {"source": "ptq", "calibration": calibration}
    if calibration == "percentile":
        info["percentile"] = percentile
    return errors, info


def _check_paths(model_path: Path, output: Path, overwrite: bool) -> None:
    """Refuse an output that is, or contains, the input; an earlier output without ``overwrite``; an output
    that cannot be written (checked now, not after the model is read)."""
    src, out = model_path.resolve(), output.resolve()
    if out == src:
        raise ConfigError(f"{output}: the output is the input model; choose another folder (quantize never "
                          "overwrites its input)")
    if out in src.parents:
        raise ConfigError(f"{output}: the output contains the input model {model_path}; replacing it would delete "
                          "the input")
    check_output(output, overwrite=overwrite)


def suggest_group_sizes(widths: list[int], wanted: int) -> list[int]:
    """Up to three group sizes that divide every width: powers of two from 16 up, nearest ``wanted`` first,
    listed largest first."""
    common = math.gcd(*widths)
    fits = [2**k for k in range(4, 16) if common % 2**k == 0]
    nearest = sorted(fits, key=lambda g: (abs(math.log2(g) - math.log2(max(wanted, 1))), -g))[:3]
    return sorted(nearest, reverse=True)


def check_shapes(model: nn.Module, method: str, group_size: int | None) -> None:
    """Refuse a layout some layer cannot take, before any weight is read or any evaluation runs.

    ``model`` may live on the meta device (only shapes are read). A group
    size must divide every quantized layer's input width; the error names
    the first layer it does not fit and suggests sizes that fit them all.
    """
    kind, bits = parse_method(method)
    if kind == "nf4":
        if group_size is not None and group_size not in BLOCKSIZES:
            raise QuantError(f"nf4 block size {group_size} is not supported (choose one of "
                             f"{', '.join(map(str, BLOCKSIZES))}; default {NF4_BLOCKSIZE})")
        return
    widths = {name: cast(nn.Linear, model.get_submodule(name)).in_features for name in find_linears(model, ALL_LINEAR)}
    if bits == 4:  # 2 and 3 bits: one bit stream per row, any width
        odd = [(n, w) for n, w in widths.items() if w % 2]
        if odd:
            raise QuantError(f"{odd[0][0]}: {bits}-bit codes are packed two per byte and need an even input width, "
                             f"got {odd[0][1]}; use int5 or more bits")
    if group_size is None:
        return
    bad = [(n, w) for n, w in widths.items() if w % group_size]
    if bad:
        name, width = bad[0]
        sizes = suggest_group_sizes(list(widths.values()), group_size)
        widths_text = ", ".join(str(w) for w in sorted(set(widths.values())))
        hint = (f"group sizes that divide every layer: {', '.join(map(str, sizes))}; or" if sizes else
                "no power-of-two group size from 16 up divides every layer;")
        raise QuantError(
            f"group size {group_size} does not divide the input width of {len(bad)} of {len(widths)} layers, "
            f"e.g. {name} ({width}); the layer widths are {widths_text}. {hint} leave the group size out "
            "(no --group-size) for one scale per output channel"
        )


def disk_size(path: Path) -> int:
    """Bytes on disk of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _weight_bytes(model: nn.Module, names: list[str], itemsize: int | None = None) -> int:
    """Bytes of the named layers' weights: quantized as stored, full-precision at ``itemsize`` (default: as held)."""
    total = 0
    for name in names:
        layer = model.get_submodule(name)
        if isinstance(layer, nn.Linear):
            total += layer.weight.numel() * (itemsize or layer.weight.element_size())
        else:
            total += cast("QuantLinear | NF4Linear", layer).quantized.nbytes
    return total


def quantize_pretrained(
    model_path: str | Path,
    output: str | Path,
    method: str,
    group_size: int | None = None,
    symmetric: bool = True,
    calibration: Calibration = "minmax",
    percentile: float | None = None,
    data: str | Path | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    seq_len: int | None = None,
    batch_size: int = 4,
    overwrite: bool = False,
    train_on: str | None = None,
    add_eos: bool | None = None,
) -> QuantizeResult:
    """Load ``model_path``, quantize it (:func:`quantize_model`) and write it to ``output``.

    With ``data`` (a data file as ``entrenar eval`` takes it), the loss and
    perplexity are measured before and after, on the same batches, by eval's
    rules (:func:`entrenar.evaluation.rules.eval_rules`): ``seq_len``,
    ``train_on`` and ``add_eos`` when given, else a run folder's recipe (its
    field names too), else eval's defaults. ``dtype``
    is the dtype to load and compute in; what stays unquantized (embeddings,
    norms, the output head) is stored in the input's own dtype, so a bf16
    model's folder holds bf16 embeddings. Settings, layer shapes and the
    output are all checked before the model is read; an existing non-empty
    output needs ``overwrite`` and keeps files that are not ours
    (:mod:`entrenar.io.outputs`). The output may not be, or contain, the input.
    """
    model_path, output = hub.resolve(model_path), Path(output)  # a Hub id: its cached snapshot
    check_options(method, symmetric, calibration, percentile)  # bad settings fail before the model is read
    _check_paths(model_path, output, overwrite)
    if is_quantized_folder(model_path):
        raise QuantError(f"{model_path}: the model is already quantized; quantize the full-precision model instead")
    with torch.device("meta"):
        check_shapes(Transformer(read_model_config(model_path)), method, group_size)
    source = resolve_model_and_adapter(model_path)
    if source.adapter is not None or source.checkpoint is not None:
        raise QuantError(f"{model_path}: is a LoRA run or checkpoint; export it merged first (entrenar export "
                         "--merge) and quantize that folder")
    keep_dtype = stored_dtype(source.model)
    rules = eval_rules(source.recipe, seq_len, train_on, add_eos)
    model, tokenizer = load(model_path, dtype=dtype, device=device)

    def evaluate() -> EvalResult | None:
        if data is None:
            return None
        return evaluate_file(model, tokenizer, data, batch_size=batch_size, **rules.kwargs())

    before = evaluate()
    names = find_linears(model, ALL_LINEAR)
    bytes_before = _weight_bytes(model, names, keep_dtype.itemsize)  # as the input stores them
    errors, info = quantize_model(model, method, group_size, symmetric, calibration, percentile)
    after = evaluate()
    model.to(keep_dtype)  # quantized layers keep their codes and fp32 scales; the rest goes back to the input's dtype
    extra = {k: v for k, v in model.config.extra.items() if k != "torch_dtype"}
    model.config = model.config.replace(extra={**extra, "dtype": str(keep_dtype).removeprefix("torch.")})
    layout_group = group_size if parse_method(method)[0] == "int" else None
    with replace_files(output) as target:
        save_quantized(model, tokenizer, target, info=info, group_size=layout_group)
    if tokenizer is None:
        warnings.warn(f"{output}: written without a tokenizer, as {model_path} has none; eval, generate, chat and "
                      "training need one: copy the tokenizer files (tokenizer.json, tokenizer_config.json) of the "
                      "model it came from into it", stacklevel=2)
    return QuantizeResult(output=output, method=method, layers=errors, bytes_before=bytes_before,
                          bytes_after=_weight_bytes(model, names), before=before, after=after,
                          config=quantization_config(model, info, layout_group),
                          disk_before=disk_size(source.model), disk_after=disk_size(output),
                          dtype=str(keep_dtype).removeprefix("torch."),
                          rules=rules if data is not None else None, run_dir=source.run_dir)
