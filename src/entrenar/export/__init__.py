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

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from entrenar.io import atomic
from entrenar.io.finite import check_finite
from entrenar.io.json_files import read_json_object
from entrenar.errors import AdapterError, ConfigError, ModelError
from entrenar.loading import load
from entrenar.device import SAFETENSORS_DTYPES, resolve_dtype

if TYPE_CHECKING:
    from entrenar.models.transformer import Transformer
    from entrenar.loading.runs import ModelSource
    from entrenar.data.tokenizer import Tokenizer

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what a stored weight dtype can be


def export(
    model_path: str | Path,
    adapter: str | Path | None,
    output: str | Path,
    merge: bool = False,
    gguf: str | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Export ``model_path`` with ``adapter`` (a PEFT LoRA folder, or None); return the paths written.

    See the module docstring for what each combination writes. ``gguf`` is one
    of :data:`entrenar.export.gguf_write.GGUF_TYPES`; with an ``output`` ending
    in ``.gguf`` only that file is written, otherwise it goes to
    ``<output>/model-<gguf>.gguf`` beside the Hugging Face files.
    """
    from entrenar.adapters.lora import ADAPTER_CONFIG
    from entrenar.export.gguf_write import check_gguf_type
    from entrenar.io.outputs import check_output
    from entrenar.loading.runs import resolve_model_and_adapter

    output = Path(output)
    qtype = check_gguf_type(gguf) if gguf is not None else None
    gguf_only = output.suffix == ".gguf"
    if gguf_only and qtype is None:
        raise ConfigError(
            f"{output}: the output is a .gguf file but no GGUF type was given (gguf=/--gguf: f16, q8_0, ...)"
        )
    if dtype is not None:
        import entrenar

        resolve_dtype(dtype, "cpu")  # an unknown name fails now
    if not Path(model_path).exists():
        raise ModelError(f"{model_path}: no such model folder or GGUF file")
    source = resolve_model_and_adapter(model_path, adapter)
    if source.adapter is not None and not (source.adapter / ADAPTER_CONFIG).is_file():
        what = f"is not an adapter folder (no {ADAPTER_CONFIG})" if source.adapter.exists() else "no such adapter folder"
        raise AdapterError(f"{source.adapter}: {what}")
    if qtype is not None and source.model.is_dir() and not (source.model / "tokenizer.json").is_file():
        from entrenar.loading import require_tokenizer

        require_tokenizer(None, source.model)  # a GGUF file carries the vocabulary: say so before any work
    inputs = {"base model": source.model, "adapter": source.adapter, "checkpoint": source.checkpoint,
              "model": Path(model_path)}
    _check_output(output, {k: v for k, v in inputs.items() if v is not None})
    check_output(output, overwrite=overwrite, is_file=gguf_only)  # before minutes of loading and merging
    lora_checkpoint = source.checkpoint is not None and source.recipe is not None and source.recipe.lora is not None
    has_adapter = source.adapter is not None or lora_checkpoint
    merge = merge or qtype is not None or not has_adapter

    if not merge:
        if source.adapter is not None:
            return [export_adapter(source.model, source.adapter, output)]
        return [_export_checkpoint_adapter(source, output)]

    model, tokenizer = load_merged(model_path, adapter, dtype)
    if gguf_only:
        from entrenar.export.gguf_write import write_gguf

        output.parent.mkdir(parents=True, exist_ok=True)
        return [write_gguf(model, tokenizer, output, qtype, name=output.stem)]
    from entrenar.io.outputs import replace_files

    with replace_files(output) as target:
        written = save_merged(model, tokenizer, target, qtype, base=source.model, name=output.name)
    return [output / p.relative_to(target) if p != target else output for p in written]


# -- adapter only ---------------------------------------------------------------


def export_adapter(model_path: Path, adapter: Path, output: Path) -> Path:
    """Load ``adapter`` against the base's shapes and re-save it in PEFT's format at ``output``.

    The base is built on the meta device, so checking an adapter against a
    large model reads its config, not its weights. The adapter keeps its
    stored dtype; its config is rewritten in full (``target_modules``
    expanded from "all-linear", every field PEFT reads).
    """
    from safetensors.torch import load_file

    from entrenar.adapters import lora
    from entrenar.io.outputs import replace_files

    skeleton = _meta_model(model_path)
    cfg = lora.load_adapter(skeleton, adapter)  # checks every tensor's name and shape against the base
    weights = adapter / lora.ADAPTER_WEIGHTS
    state = {key.removeprefix(lora.PEFT_PREFIX): t for key, t in load_file(weights).items()}
    for name, layer in lora.lora_layers(skeleton):  # materialise only the adapter, in the dtype it was saved in
        for part in ("lora_A", "lora_B"):
            getattr(layer, part).to_empty(device="cpu").to(state[f"{name}.{part}.weight"].dtype)
    lora.load_lora_state_dict(skeleton, state, str(weights))

    base_name = _read_json(adapter / lora.ADAPTER_CONFIG).get("base_model_name_or_path") or str(model_path)
    with replace_files(output) as target:
        lora.save_adapter(skeleton, target, cfg, base_model_name_or_path=base_name)
    return output


def _export_checkpoint_adapter(source: ModelSource, output: Path) -> Path:
    """A LoRA run's checkpoint as a PEFT adapter folder (its weights on the base, saved as the run saves them)."""
    from entrenar.loading import load
    from entrenar.adapters import lora
    from entrenar.io.outputs import replace_files
    from entrenar.adapters.lora import lora_config_of

    model, _ = load(source.checkpoint, device="cpu", dtype=stored_dtype(source.model))
    with replace_files(output) as target:
        lora.save_adapter(model, target, lora_config_of(source.recipe.lora), base_model_name_or_path=str(source.model))
    return output


def _meta_model(model_path: Path) -> Transformer:
    """The base's architecture with no storage (meta device): enough to check an adapter's shapes."""
    from entrenar.models.config import ModelConfig
    from entrenar.models.transformer import Transformer

    if model_path.suffix == ".gguf":
        from entrenar.models.gguf import read_gguf

        config = ModelConfig.from_hf(read_gguf(model_path).hf_config, source=str(model_path))
    else:
        from entrenar.models.hf import read_config

        config = read_config(model_path)
    with torch.device("meta"):
        return Transformer(config)


# -- merged ---------------------------------------------------------------------


def load_merged(
    model_path: Path, adapter: Path | None, dtype: str | torch.dtype | None = None
) -> tuple[Transformer, Tokenizer | None]:
    """The model with ``adapter`` (if any) merged in and the LoRA layers removed (a plain model), and its tokenizer.

    ``model_path`` may be a run (:mod:`entrenar.loading.runs`); ``dtype`` None keeps the input's stored dtype.
    """
    import entrenar
    from entrenar.adapters.lora import lora_layers, unload_lora
    from entrenar.loading.runs import resolve_model_and_adapter

    source = resolve_model_and_adapter(model_path, adapter)
    if source.model.suffix != ".gguf":
        _refuse_quantized_checkpoint(source.model)
    if dtype is not None:
        torch_dtype = resolve_dtype(dtype, "cpu")
    elif source.checkpoint is not None and source.recipe is not None and source.recipe.lora is None:
        torch_dtype = _checkpoint_dtype(source.checkpoint)  # a full fine-tune's weights, as it trained them
    else:
        torch_dtype = stored_dtype(source.model)
    model, tokenizer = load(model_path, adapter=adapter, dtype=torch_dtype, device="cpu")
    if any(True for _ in lora_layers(model)):
        unload_lora(model, merge=True)
    return model, tokenizer


def save_merged(
    model: Transformer,
    tokenizer: Tokenizer | None,
    output: Path,
    qtype: str | None = None,
    base: Path | None = None,
    name: str | None = None,
) -> list[Path]:
    """Write a Hugging Face folder (weights, config, tokenizer, generation config) and optionally a GGUF in it.

    ``model.config`` gets the dtype the weights are saved in (``dtype`` in
    config.json), which transformers 5 loads them as. ``name`` is the GGUF's
    ``general.name`` (default: the folder's name). Without a tokenizer no
    tokenizer files are written.
    """
    from entrenar.export.gguf_write import write_gguf
    from entrenar.models.hf import save_hf

    check_finite(model.state_dict(), output, ModelError)  # before the folder is staged or config.dtype changed
    dtype = next(model.parameters()).dtype
    extra = {k: v for k, v in model.config.extra.items() if k != "torch_dtype"}
    model.config = model.config.replace(extra={**extra, "dtype": _DTYPE_NAMES.get(dtype, str(dtype))})
    generation = _generation_config(tokenizer, base)
    written = [output]
    if qtype is not None and tokenizer is None:
        raise ModelError(f"{output}: a GGUF file needs the model's tokenizer, and the model has none")
    with atomic.staged_folder(output) as target:
        save_hf(model, target)
        if tokenizer is not None:
            tokenizer.save(target)
        (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if qtype is not None:
            file_name = f"model-{qtype}.gguf"
            write_gguf(model, tokenizer, target / file_name, qtype, name=name or output.name)
            written.append(output / file_name)
    return written


def _generation_config(tokenizer: Tokenizer | None, base: Path | None) -> dict[str, Any]:
    """The base's generation_config.json (sampling defaults) with the tokenizer's special ids.

    Several end-of-sequence ids (Llama 3 Instruct stops on three) are written
    as a list, which is how transformers and entrenar's tokenizer read them.
    """
    config: dict[str, Any] = {}
    if base is not None and base.is_dir():
        config = _read_json(base / "generation_config.json")
    if tokenizer is None:
        config.pop("transformers_version", None)
        return config
    eos = tokenizer.eos_ids
    if tokenizer.bos_id is not None:
        config["bos_token_id"] = tokenizer.bos_id
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if "pad_token" in tokenizer.special_tokens:
        config["pad_token_id"] = tokenizer.pad_id
    config.pop("transformers_version", None)
    return config


def _refuse_quantized_checkpoint(folder: Path) -> None:
    """A checkpoint saved quantized (bitsandbytes, GPTQ, AWQ...) has no float weights to merge into."""
    config = _read_json(folder / "config.json")
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
    from safetensors import safe_open

    from entrenar.train.checkpoint import MODEL_FILE

    with safe_open(str(checkpoint / MODEL_FILE), framework="pt") as f:
        for name in f.keys():
            kind = f.get_slice(name).get_dtype()
            if SAFETENSORS_DTYPES.get(kind) in _WEIGHT_DTYPES:
                return SAFETENSORS_DTYPES[kind]
    return torch.float32


def stored_dtype(model_path: Path) -> torch.dtype:
    """The floating dtype the base's weights are stored in (see the module docstring)."""
    if model_path.suffix == ".gguf":
        from entrenar.models.gguf import read_gguf

        kinds = {
            kind
            for name, kind in read_gguf(model_path).quant_types().items()
            if not name.endswith(("norm.weight", "bias"))
        }
        if kinds == {"F32"}:
            return torch.float32
        return torch.bfloat16 if kinds == {"BF16"} else torch.float16
    from safetensors import safe_open

    from entrenar.models.hf import weight_files

    with safe_open(str(weight_files(model_path)[0]), framework="pt") as f:
        for name in f.keys():
            kind = f.get_slice(name).get_dtype()
            if SAFETENSORS_DTYPES.get(kind) in _WEIGHT_DTYPES:
                return SAFETENSORS_DTYPES[kind]
    return torch.float32


# -- paths ------------------------------------------------------------------------


def _check_output(output: Path, inputs: dict[str, Path]) -> None:
    """Refuse outputs that would overwrite or delete an input."""
    out = output.resolve()
    for what, path in inputs.items():
        src = path.resolve()
        if out == src:
            raise ConfigError(f"{output}: the output is the {what}; choose another path (an output never replaces "
                              "an input)")
        if out in src.parents:
            raise ConfigError(f"{output}: the output contains the {what} ({path}); replacing it would delete it")
        if src.is_dir() and src in out.parents:
            raise ConfigError(f"{output}: the output is inside the {what} ({path}); choose a path outside it")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} where there is none."""
    return read_json_object(path) if path.is_file() else {}


__all__ = ["export", "export_adapter", "load_merged", "save_merged", "stored_dtype"]
