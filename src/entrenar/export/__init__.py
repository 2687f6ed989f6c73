"""Export a model, with or without its adapter: as a PEFT adapter, as a Hugging Face folder, or as GGUF.

    export(base, adapter, "out")                          # the adapter, validated and re-saved (PEFT format)
    export(base, adapter, "out", merge=True)              # base + adapter merged: a Hugging Face model folder
    export(base, adapter, "out", gguf="q8_0")             # ... plus out/model-q8_0.gguf for llama.cpp
    export(base, adapter, "m.gguf", gguf="f16")           # only the GGUF file
    export("runs/full-ft", None, "m.gguf", gguf="q8_0")   # a full fine-tune (or any model) without adapter

``base`` is a Hugging Face folder, a ``.gguf`` file or a training run (its
folder, ``best/`` or ``checkpoints/step-N``, see :mod:`entrenar.loading.runs`); a
quantized GGUF base is dequantized on load, so the adapter is merged into
floating-point weights. GGUF needs a merged model (llama.cpp runs plain
weights), so asking for GGUF merges. Without an adapter the model is written
as it is (in ``dtype`` if given).

Weights are kept in the input's stored dtype unless ``dtype`` says otherwise:
a Hugging Face folder's safetensors dtype (a full fine-tune's checkpoint: the
dtype it trained in); for a GGUF base, F32 and BF16 files keep their type and
F16 or quantized ones become float16. The LoRA update is computed in float32
and added with one rounding to that dtype.

Everything that can be checked is checked before any weight is read: the
options, the inputs, and that the output can be written. An existing
non-empty output needs ``overwrite=True`` (``--overwrite``); even then only
the files an export writes are replaced (and files of an earlier export that
this one does not write, such as old shards, removed): other files in the
folder are kept (:mod:`entrenar.io.outputs`). An export never writes over its
inputs: an output that is, or contains, the base model or the adapter is
refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from entrenar.adapters import lora
from entrenar.device import resolve_dtype
from entrenar.errors import AdapterError, ConfigError, ModelError
from entrenar.export.gguf_meta import GeneralMetadata, describe
from entrenar.export.gguf_write import check_gguf_type, write_gguf
from entrenar.io import atomic, hub
from entrenar.io.checkpoint_files import MODEL_FILE
from entrenar.io.outputs import check_output, refuse_overlap, replace_files
from entrenar.io.safetensors_dtypes import SAFETENSORS_DTYPES
from entrenar.loading import load, require_tokenizer
from entrenar.loading.runs import ModelSource, resolve_model_and_adapter
from entrenar.models.config import ModelConfig
from entrenar.models.gguf import read_gguf
from entrenar.models.hf import read_config, weight_files
from entrenar.models.saving import prepare_for_saving, read_json_object, write_model_files
from entrenar.models.surgery import replace_module
from entrenar.models.transformer import Transformer
from entrenar.quant.nf4.format import NF4Linear

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer

_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what a stored weight dtype can be


def export(
    model_path: str | Path,
    adapter: str | Path | None,
    output: str | Path,
    merge: bool = False,
    gguf: str | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    merge_base: str = "full",
) -> list[Path]:
    """Export ``model_path`` with ``adapter`` (a PEFT LoRA folder, or None); return the paths written.

    ``merge_base`` matters for a QLoRA run (``lora.quantize_base: nf4``) only: "full" merges the adapter into the
    full-precision base, "trained" into the dequantized NF4 base it was trained on (:func:`load_merged`).

    See the module docstring for what each combination writes. ``gguf`` is one
    of :data:`entrenar.export.gguf_write.GGUF_TYPES`; with an ``output`` ending
    in ``.gguf`` only that file is written, otherwise it goes to
    ``<output>/model-<gguf>.gguf`` beside the Hugging Face files.
    """
    output = Path(output)
    qtype = check_gguf_type(gguf) if gguf is not None else None
    gguf_only = output.suffix == ".gguf"
    if gguf_only and qtype is None:
        raise ConfigError(
            f"{output}: the output is a .gguf file but no GGUF type was given (gguf=/--gguf: f16, q8_0, ...)"
        )
    if dtype is not None:
        resolve_dtype(dtype, "cpu")  # an unknown name fails now
    check_merge_base(merge_base)
    model_path = hub.resolve(model_path)  # a Hub id: its cached snapshot
    if not model_path.exists():
        raise ModelError(f"{model_path}: no such model folder or GGUF file")
    source = resolve_model_and_adapter(model_path, adapter)
    if source.adapter is not None and not (source.adapter / lora.ADAPTER_CONFIG).is_file():
        what = (f"is not an adapter folder (no {lora.ADAPTER_CONFIG})" if source.adapter.exists()
                else "no such adapter folder")
        raise AdapterError(f"{source.adapter}: {what}")
    if qtype is not None and source.model.is_dir() and not (source.model / "tokenizer.json").is_file():
        require_tokenizer(None, source.model)  # a GGUF file carries the vocabulary: say so before any work
    inputs = {"base model": source.model, "adapter": source.adapter, "checkpoint": source.checkpoint,
              "model": Path(model_path)}
    refuse_overlap(output, {k: v for k, v in inputs.items() if v is not None})
    check_output(output, overwrite=overwrite, is_file=gguf_only)  # before minutes of loading and merging
    lora_checkpoint = source.checkpoint is not None and source.recipe is not None and source.recipe.lora is not None
    has_adapter = source.adapter is not None or lora_checkpoint
    merge = merge or qtype is not None or not has_adapter

    if not merge:
        if source.adapter is not None:
            return [export_adapter(source.model, source.adapter, output)]
        return [_export_checkpoint_adapter(source, output)]

    model, tokenizer = load_merged(model_path, adapter, dtype, merge_base=merge_base)
    # general.name: the base model's name and the adapter's or run's, not the output's
    general = describe(source.model, source.adapter, source.run_dir) if qtype is not None else None
    if gguf_only:
        assert qtype is not None and tokenizer is not None  # both refused above when missing
        output.parent.mkdir(parents=True, exist_ok=True)
        return [write_gguf(model, tokenizer, output, qtype, general=general)]
    with replace_files(output) as target:
        written = save_merged(model, tokenizer, target, qtype, base=source.model, general=general)
    return [output / p.relative_to(target) if p != target else output for p in written]


# -- adapter only ---------------------------------------------------------------


def export_adapter(model_path: Path, adapter: Path, output: Path) -> Path:
    """Load ``adapter`` against the base's shapes and re-save it in PEFT's format at ``output``.

    The base is built on the meta device, so checking an adapter against a
    large model reads its config, not its weights. The adapter keeps its
    stored dtype; its config is rewritten in full (``target_modules``
    expanded from "all-linear", every field PEFT reads).
    """
    skeleton = _meta_model(model_path)
    cfg = lora.load_adapter(skeleton, adapter)  # checks every tensor's name and shape against the base
    weights = adapter / lora.ADAPTER_WEIGHTS
    state = {key.removeprefix(lora.PEFT_PREFIX): t for key, t in load_file(weights).items()}
    for name, layer in lora.lora_layers(skeleton):  # materialise only the adapter, in the dtype it was saved in
        for part in ("lora_A", "lora_B"):
            getattr(layer, part).to_empty(device="cpu").to(state[f"{name}.{part}.weight"].dtype)
    lora.load_lora_state_dict(skeleton, state, str(weights))

    config = read_json_object(adapter / lora.ADAPTER_CONFIG)
    base_name = config.get("base_model_name_or_path") or str(model_path)
    if isinstance(config.get("revision"), str) and config["revision"]:
        base_name = f"{base_name}@{config['revision']}"  # save_adapter writes it back as PEFT's "revision"
    with replace_files(output) as target:
        lora.save_adapter(skeleton, target, cfg, base_model_name_or_path=base_name)
    return output


def _export_checkpoint_adapter(source: ModelSource, output: Path) -> Path:
    """A LoRA run's checkpoint as a PEFT adapter folder (its weights on the base, saved as the run saves them)."""
    assert source.checkpoint is not None and source.recipe is not None  # only a LoRA run's checkpoint comes here
    model, _ = load(source.checkpoint, device="cpu", dtype=stored_dtype(source.model))
    with replace_files(output) as target:
        cfg = lora.lora_config_of(source.recipe.lora)
        assert cfg is not None  # the run has a lora section
        lora.save_adapter(model, target, cfg, base_model_name_or_path=str(source.model))
    return output


def _meta_model(model_path: Path) -> Transformer:
    """The base's architecture with no storage (meta device): enough to check an adapter's shapes."""
    if model_path.suffix == ".gguf":
        config = ModelConfig.from_hf(read_gguf(model_path).hf_config, source=str(model_path))
    else:
        config = read_config(model_path)
    with torch.device("meta"):
        return Transformer(config)


# -- merged ---------------------------------------------------------------------


def load_merged(
    model_path: str | Path, adapter: str | Path | None, dtype: str | torch.dtype | None = None,
    merge_base: str = "full",
) -> tuple[Transformer, Tokenizer | None]:
    """The model with ``adapter`` (if any) merged in and the LoRA layers removed (a plain model), and its tokenizer.

    ``model_path`` may be a run (:mod:`entrenar.loading.runs`); ``dtype`` None keeps the input's stored dtype.
    ``merge_base="trained"`` on a QLoRA run merges into the base the adapter was trained on: the base loaded in
    NF4 and dequantized (what training and its evaluation computed with); "full" (or any other run) into the
    full-precision base.
    """
    source = resolve_model_and_adapter(model_path, adapter)
    if source.model.suffix != ".gguf":
        _refuse_quantized_checkpoint(source.model)
    if dtype is not None:
        torch_dtype = resolve_dtype(dtype, "cpu")
    elif source.checkpoint is not None and source.recipe is not None and source.recipe.lora is None:
        torch_dtype = _checkpoint_dtype(source.checkpoint)  # a full fine-tune's weights, as it trained them
    else:
        torch_dtype = stored_dtype(source.model)
    quantized = source.quantize_base if check_merge_base(merge_base) == "trained" else None
    model, tokenizer = load(model_path, adapter=adapter, dtype=torch_dtype, device="cpu", quantize=quantized)
    if quantized is not None:
        dequantize_nf4_layers(model, torch_dtype)
    if any(True for _ in lora.lora_layers(model)):
        lora.unload_lora(model, merge=True)
    return model, tokenizer


def save_merged(
    model: Transformer,
    tokenizer: Tokenizer | None,
    output: Path,
    qtype: str | None = None,
    base: Path | None = None,
    name: str | None = None,
    general: GeneralMetadata | None = None,
) -> list[Path]:
    """Write a Hugging Face folder (weights, config, tokenizer, generation config) and optionally a GGUF in it.

    The folder is :func:`entrenar.models.saving.save_model_folder`'s (``model.config`` gets the dtype the weights
    are saved in, which transformers 5 loads them as; without a tokenizer no tokenizer files are written), with
    ``model-<qtype>.gguf`` beside its files when ``qtype`` is given. ``name`` is the GGUF's ``general.name``
    (default: ``general``'s name, else the folder's), ``general`` the model-describing metadata it carries.
    """
    generation = prepare_for_saving(model, tokenizer, output, base)
    written = [output]
    if qtype is not None and tokenizer is None:
        raise ModelError(f"{output}: a GGUF file needs the model's tokenizer, and the model has none")
    with atomic.staged_folder(output) as target:
        write_model_files(model, tokenizer, target, generation)
        if qtype is not None:
            assert tokenizer is not None  # refused above
            file_name = f"model-{qtype}.gguf"
            default = None if general is not None and general.name else output.name
            write_gguf(model, tokenizer, target / file_name, qtype, name=name or default, general=general)
            written.append(output / file_name)
    return written


MERGE_BASES = ("full", "trained")


def check_merge_base(merge_base: str) -> str:
    """``merge_base`` when it is one of :data:`MERGE_BASES`, else a ConfigError."""
    if merge_base not in MERGE_BASES:
        raise ConfigError(f"merge base {merge_base!r} must be one of {', '.join(MERGE_BASES)}")
    return merge_base


def dequantize_nf4_layers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Replace every NF4 linear layer (under a LoRA layer or not) by a plain one holding its dequantized weight."""
    for name, module in list(model.named_modules()):
        if isinstance(module, NF4Linear):
            replace_module(model, name, module.to_linear(dtype))
    left = sorted({type(m).__name__ for m in model.modules() if "NF4" in type(m).__name__})
    if left:
        raise ModelError(f"merge base 'trained': cannot dequantize {', '.join(left)} layers; use merge base 'full'")


def _refuse_quantized_checkpoint(folder: Path) -> None:
    """A checkpoint saved quantized (bitsandbytes, GPTQ, AWQ...) has no float weights to merge into."""
    config = read_json_object(folder / "config.json")
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise ModelError(
            f"{folder / 'config.json'}: the checkpoint is quantized (quantization_config.quant_method={method!r}); "
            "the adapter cannot be merged into quantized weights. Export from the unquantized base model "
            "(or a GGUF of it, which is dequantized on load)"
        )


def _checkpoint_dtype(checkpoint: Path) -> torch.dtype:
    """The floating dtype of a training checkpoint's weights."""
    return _first_weight_dtype(checkpoint / MODEL_FILE)


def _first_weight_dtype(file: Path) -> torch.dtype:
    """The dtype of the first floating weight in a safetensors file's header (float32 if none)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                kind = f.get_slice(name).get_dtype()
                if SAFETENSORS_DTYPES.get(kind) in _WEIGHT_DTYPES:
                    return SAFETENSORS_DTYPES[kind]
    except OSError:
        raise
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise ModelError(f"{file}: cannot read safetensors file ({e})") from None
    return torch.float32


def stored_dtype(model_path: Path) -> torch.dtype:
    """The floating dtype the base's weights are stored in (see the module docstring)."""
    if model_path.suffix == ".gguf":
        kinds = {
            kind
            for name, kind in read_gguf(model_path).quant_types().items()
            if not name.endswith(("norm.weight", "bias"))
        }
        if kinds == {"F32"}:
            return torch.float32
        return torch.bfloat16 if kinds == {"BF16"} else torch.float16
    return _first_weight_dtype(weight_files(model_path)[0])


__all__ = ["MERGE_BASES", "check_merge_base", "dequantize_nf4_layers", "export", "export_adapter", "load_merged",
           "save_merged", "stored_dtype"]
