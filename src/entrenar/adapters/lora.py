"""LoRA adapters, injected into any ``nn.Module`` from outside, in PEFT's on-disk format.

A LoRA layer adds a trainable low-rank update to a frozen linear layer:
``y = base(x) + B(A(dropout(x))) * scaling`` with ``scaling = alpha / r``
(or ``alpha / sqrt(r)`` with rsLoRA). ``B`` starts at zero, so a freshly
wrapped model computes exactly what it did before.

Adapter dtype: adapters take the base weight's dtype, upcast to float32 when
that is float16/bfloat16 or not floating point at all (quantized bases). This
is PEFT's default (``autocast_adapter_dtype=True``) and what QLoRA wants:
small fp32 adapters on a low-precision base. The adapter path runs in the
adapter dtype and its sum with the base output is cast back to the base
output's dtype.

On disk an adapter is a folder with ``adapter_config.json`` and
``adapter_model.safetensors`` whose keys are
``base_model.model.<module name>.lora_A.weight`` / ``.lora_B.weight``, so
``peft.PeftModel.from_pretrained`` reads what :func:`save_adapter` writes and
:func:`load_adapter` reads what PEFT's ``save_pretrained`` writes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from entrenar.adapters.experts import (
    LoraExpertWeights,
    expected_expert_shapes,
    expert_lora_names,
    wrap_expert_parameters,
)
from entrenar.adapters.layer import (  # noqa: F401 - re-exported: the layer is used through this module
    LoraLinear,
    adapter_dtype,
    check_hparams,
    lora_layers,
    lora_scaling,
    weight_spec,
)
from entrenar.config import LoraSection, Reject, setting
from entrenar.errors import AdapterError
from entrenar.io import atomic, hub
from entrenar.io.finite import check_finite
from entrenar.models.surgery import ALL_LINEAR, find_linears, replace_module

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

# PEFT config fields whose non-default values change what an adapter means (LoRA variants
# such as DoRA, per-module ranks, extra trained modules). entrenar implements plain LoRA,
# so an adapter that sets any of them is refused, not misread.
_UNSUPPORTED_PEFT_FIELDS = (
    "use_dora",
    "use_bdlora",
    "velora_config",
    "monteclora_config",
    "arrow_config",
    "kasa_config",
    "fan_in_fan_out",
    "lora_bias",
    "layers_to_transform",
    "rank_pattern",
    "alpha_pattern",
    "exclude_modules",
    "trainable_token_indices",
    "layer_replication",
    "use_qalora",
    "alora_invocation_tokens",
)
_VARIANT_INITS = ("mica",)  # init_lora_weights values that select a variant with its own forward
_PARAMETER_NAME = re.compile(r"[\w.]+")


def _target_modules(value: Any) -> str | tuple[str, ...]:
    """PEFT's ``target_modules``: 'all-linear' (any case), a regex over module names, or a list of names."""
    if isinstance(value, str) and value:
        return ALL_LINEAR if value.lower() == ALL_LINEAR else value
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, str) and t for t in value):
        return tuple(value)
    raise Reject("'all-linear', a regex or a non-empty list of module names")


def _target_parameters(value: Any) -> tuple[str, ...] | None:
    """PEFT's ``target_parameters``: null, or parameter names (one, or a list)."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    expected = "null or parameter names such as 'mlp.experts.gate_up_proj'"
    if not isinstance(names, (list, tuple)):
        raise Reject(expected)
    bad = [n for n in names if not isinstance(n, str) or not _PARAMETER_NAME.fullmatch(n)]
    if bad:
        raise Reject(expected, f" ({bad[0]!r} is not one)")
    return tuple(names)


def _no_bias(value: Any) -> str:
    if value == "none":
        return value
    raise Reject("'none' (training biases is not supported)")


@dataclass(frozen=True)
class LoraConfig(LoraSection):
    """What to adapt and how: the recipe's ``lora`` section, with PEFT's conventions for Python callers.

    One schema serves both (every field but ``bias`` is the section's, with its rules). What differs here:
    ``target_modules`` defaults to ``"all-linear"`` and may be a regex, as in PEFT (a recipe without
    ``target_modules`` adapts the attention projections); ``target_parameters`` takes PEFT's names (stacked MoE
    experts, ``mlp.experts.gate_up_proj``, one adapter per expert: :mod:`entrenar.adapters.experts`); ``bias`` is
    PEFT's and stays ``"none"``; errors are :class:`AdapterError`. ``quantize_base`` is for whoever loads the base
    (QLoRA); adapters ignore it.
    """

    section: ClassVar[str] = "LoraConfig"
    target_modules: str | tuple[str, ...] = setting(ALL_LINEAR, _target_modules)
    target_parameters: tuple[str, ...] | None = setting(None, _target_parameters)
    bias: str = setting("none", _no_bias)

    def _refusal(self, key: str, message: str) -> AdapterError:
        return AdapterError(message)

    @property
    def scaling(self) -> float:
        return lora_scaling(self.r, self.alpha, self.use_rslora)

    def to_peft(self, target_modules: Sequence[str] | str, base_model_name_or_path: str | None) -> dict[str, Any]:
        """The ``adapter_config.json`` content PEFT expects (every field PEFT reads for plain LoRA)."""
        alpha = int(self.alpha) if float(self.alpha).is_integer() else self.alpha
        base, revision = hub.split_revision(base_model_name_or_path)  # PEFT reads an id's revision on its own
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "revision": revision,
            "inference_mode": True,
            "r": self.r,
            "lora_alpha": alpha,
            "lora_dropout": self.dropout,
            "target_modules": target_modules if isinstance(target_modules, str) else list(target_modules),
            "use_rslora": self.use_rslora,
            "bias": self.bias,
            "fan_in_fan_out": False,
            "init_lora_weights": True,
            "use_dora": False,
            "lora_bias": False,
            "modules_to_save": None,
            "exclude_modules": None,
            "layers_to_transform": None,
            "layers_pattern": None,
            "rank_pattern": {},
            "alpha_pattern": {},
            "target_parameters": None if self.target_parameters is None else list(self.target_parameters),
        }

    @classmethod
    def from_peft(cls, raw: dict[str, Any], source: str) -> LoraConfig:
        """Read a PEFT ``adapter_config.json`` dict; ``source`` names the file in errors."""
        if raw.get("peft_type") != "LORA":
            raise AdapterError(f"{source}: peft_type is {raw.get('peft_type')!r}; only 'LORA' adapters are supported")
        for key in ("r", "lora_alpha", "target_modules"):
            if raw.get(key) is None:
                raise AdapterError(f"{source}: missing {key!r}")
        for key in _UNSUPPORTED_PEFT_FIELDS:
            if raw.get(key) not in (None, False, {}, []):
                raise AdapterError(
                    f"{source}: {key}={raw[key]!r} is not supported (entrenar loads plain LoRA adapters)"
                )
        if raw.get("init_lora_weights") in _VARIANT_INITS:
            raise AdapterError(
                f"{source}: init_lora_weights={raw['init_lora_weights']!r} is a LoRA variant entrenar does not support"
            )
        try:
            return cls(
                r=raw["r"],
                alpha=raw["lora_alpha"],
                dropout=raw.get("lora_dropout", 0.0),
                target_modules=raw["target_modules"],
                use_rslora=raw.get("use_rslora", False),
                bias=raw.get("bias", "none"),
                target_parameters=raw.get("target_parameters"),
            )
        except AdapterError as err:
            raise AdapterError(f"{source}: {err}") from None


def lora_config_of(section: LoraSection | None) -> LoraConfig | None:
    """The LoraConfig a recipe's ``lora`` section stands for (None: full fine-tuning): the section's values,
    checked as a LoraConfig (PEFT's names for ``target_parameters``)."""
    if section is None or isinstance(section, LoraConfig):
        return section
    return LoraConfig(**{f.name: getattr(section, f.name) for f in fields(section)})


def _require_lora(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    layers = list(lora_layers(model))
    if not layers:
        raise AdapterError(f"{type(model).__name__} has no LoRA layers; call apply_lora or load_adapter first")
    return layers


def _refuse_second_adapter(model: nn.Module) -> None:
    existing = next(lora_layers(model), None)
    if existing is not None:
        raise AdapterError(
            f"{type(model).__name__} already has LoRA layers ({existing[0]}, ...); entrenar holds one adapter per model"
        )


def _shared_weights(model: nn.Module, names: Sequence[str]) -> Iterator[tuple[str, str, str, nn.Module]]:
    """``(layer, param, other, owner)`` for each layer among ``names`` whose parameter ``param`` is also
    the model's parameter ``other``, outside the layer; ``owner`` is the module that holds ``other``.

    Tied embeddings are the usual case: ``lm_head.weight`` is the very
    parameter ``model.embed_tokens.weight``. Only registered parameters are
    compared, so quantized layers are not dequantized to look at them.
    """
    holders: dict[int, list[str]] = {}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(param), []).append(param_name)
    for name in names:
        for local_name, param in model.get_submodule(name).named_parameters():
            others = [n for n in holders.get(id(param), []) if not n.startswith(name + ".")]
            if others:
                yield name, f"{name}.{local_name}", others[0], model.get_submodule(others[0].rpartition(".")[0])
                break


def _refuse_shared_weights(model: nn.Module, names: Sequence[str], *, merging: bool) -> None:
    """Merging into a shared weight would silently change the other module too: refuse it up front."""
    for layer, param, other, owner in _shared_weights(model, names):
        embeddings = isinstance(owner, nn.Embedding)
        fix = "use the adapter unmerged" if merging else f"leave {layer.rsplit('.', 1)[-1]} out of target_modules"
        raise AdapterError(
            f"{param} is tied to {other}; LoRA on it would change {'the embeddings' if embeddings else other} "
            f"when merged — {fix} or untie {'the embeddings' if embeddings else 'them'}"
        )


def _wrap(model: nn.Module, names: Sequence[str], cfg: LoraConfig) -> None:
    _refuse_second_adapter(model)
    layers = {}
    for name in names:  # build every wrapper before swapping any, so a bad layer leaves the model whole
        try:
            layers[name] = LoraLinear(model.get_submodule(name), cfg.r, cfg.alpha, cfg.dropout, cfg.use_rslora)
        except AdapterError as err:
            raise type(err)(f"{name}: {err}") from None
    model.requires_grad_(False)  # the new adapters are not in the model yet and stay trainable
    for name, layer in layers.items():
        replace_module(model, name, layer)


# The recipe's default target_modules: the attention projections.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def family_targets(targets: str | tuple[str, ...], fused_qkv: bool) -> str | tuple[str, ...]:
    """``targets`` for a model whose q, k and v are one ``qkv_proj`` (Phi-3): the recipe's default (the attention
    projections) becomes ``qkv_proj`` and ``o_proj``; any other choice is kept (names the model lacks are
    refused where they are looked up)."""
    return ("qkv_proj", "o_proj") if fused_qkv and targets == ATTENTION_TARGETS else targets


def _for_model(model: nn.Module, cfg: LoraConfig) -> LoraConfig:
    fused = bool(getattr(getattr(model, "config", None), "fused_qkv", False))
    targets = family_targets(cfg.target_modules, fused)
    return cfg if targets == cfg.target_modules else replace(cfg, target_modules=targets)


def apply_lora(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Wrap the layers ``cfg.target_modules`` selects and freeze everything else; return their names.
    The default targets on a model with a fused ``qkv_proj``: see :func:`family_targets`."""
    cfg = _for_model(model, cfg)
    _refuse_second_adapter(model)
    names = find_linears(model, cfg.target_modules)
    _refuse_shared_weights(model, names, merging=False)
    _wrap(model, names, cfg)
    return names + _wrap_experts(model, cfg)


def continue_adapter(model: nn.Module, cfg: LoraConfig, source: str) -> list[str]:
    """Train further the adapter ``model`` was loaded with (from ``source``: a PEFT adapter folder, a LoRA run or
    checkpoint), which ``cfg`` (the recipe's ``lora`` section) must describe: its rank, alpha, rsLoRA and the
    layers it adapts. Anything else is another adapter, refused naming the key (:class:`AdapterError`); the
    section's dropout applies. Adapters on MoE experts are not continued. Returns the adapted layers' names."""
    cfg = _for_model(model, cfg)
    layers = dict(lora_layers(model))
    if cfg.target_parameters or any(type(layer) is not LoraLinear for layer in layers.values()):
        raise AdapterError(f"{source}: adapters on MoE experts or routers cannot be trained further yet; start "
                           "from the base model")
    first = next(iter(layers.values()))
    for key, ours, theirs in (("r", cfg.r, first.r), ("alpha", cfg.alpha, first.alpha),
                              ("use_rslora", cfg.use_rslora, first.use_rslora)):
        if ours != theirs:
            raise AdapterError(f"lora.{key}: {ours!r}, but the adapter {source} brings has {key} {theirs!r}; set "
                               f"lora.{key}: {theirs!r} to train it further, or start from its base model")
    wanted = set(find_linears(model, cfg.target_modules, strict=False))
    if wanted != set(layers):
        differ = sorted(wanted ^ set(layers))
        raise AdapterError(f"lora.target_modules: selects other layers than the adapter {source} adapts "
                           f"({len(wanted)} against {len(layers)}; {differ[0]}, ...); set it to the adapter's "
                           "target_modules, or start from its base model")
    for layer in layers.values():
        layer.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        layer.train(model.training)
    return sorted(layers)


def _wrap_experts(model: nn.Module, cfg: LoraConfig) -> list[str]:

    return wrap_expert_parameters(model, cfg.target_parameters, cfg.r, cfg.alpha, cfg.dropout, cfg.use_rslora)


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (A and B of every LoRA layer), for the optimizer."""
    layers = _require_lora(model)
    # nn.Linear's stubs type its weight as a Tensor; it is a Parameter
    return [cast(nn.Parameter, p) for _, layer in layers for p in (layer.lora_A.weight, layer.lora_B.weight)]


def merge_lora(model: nn.Module) -> list[str]:
    """Merge every LoRA layer into its base weight; return the names merged now.

    An adapter on a weight the model shares elsewhere (one loaded from PEFT
    onto ``lm_head`` of a model with tied embeddings) works unmerged but is
    refused here, before any layer is merged.
    """
    layers = _require_lora(model)
    _refuse_shared_weights(model, [name for name, layer in layers if not layer.merged], merging=True)
    merged = []
    for name, layer in layers:
        if not layer.merged:
            try:
                layer.merge()
            except AdapterError as err:
                raise AdapterError(f"{name}: {err}") from None
            merged.append(name)
    return merged


def unmerge_lora(model: nn.Module) -> list[str]:
    """Undo :func:`merge_lora`; return the names unmerged now."""
    unmerged = []
    for name, layer in _require_lora(model):
        if layer.merged:
            layer.unmerge()
            unmerged.append(name)
    return unmerged


def unload_lora(model: nn.Module, merge: bool = True) -> list[str]:
    """Put the base layers back in place of the LoRA layers (merged into them unless ``merge=False``).

    The model then has its original module and state-dict names again, ready to
    be saved or exported as a plain model.
    """
    layers = _require_lora(model)
    if merge:
        merge_lora(model)
    for name, layer in reversed(layers):  # inner wrappers first (nested expert adapters: experts.base_layer)
        if layer.merged and not merge:
            layer.unmerge()
        replace_module(model, name, layer.base_layer)
    return [name for name, _ in layers]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under the model's own names (``<module>.lora_A.weight``), detached."""
    state = {}
    for name, layer in _require_lora(model):
        state[f"{name}.lora_A.weight"] = layer.lora_A.weight.detach()
        state[f"{name}.lora_B.weight"] = layer.lora_B.weight.detach()
        if isinstance(layer, LoraExpertWeights):  # gpt-oss's gate/up rows as its checkpoint and PEFT order them
            state[f"{name}.lora_B.weight"] = layer.checkpoint_rows(state[f"{name}.lora_B.weight"])
    return state


def _expected_shapes(model: nn.Module, names: Sequence[str], r: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        layer = model.get_submodule(name)
        in_features, out_features = getattr(layer, "in_features", None), getattr(layer, "out_features", None)
        if not isinstance(in_features, int) or not isinstance(out_features, int):
            raise AdapterError(f"{name}: a {type(layer).__name__} without in_features/out_features cannot take LoRA")
        shapes[f"{name}.lora_A.weight"] = (r, in_features)
        shapes[f"{name}.lora_B.weight"] = (out_features, r)
    return shapes


def _check_tensors(state: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], source: str) -> None:
    missing = [key for key in shapes if key not in state]
    if missing:
        raise AdapterError(
            f"{source}: missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    unexpected = [key for key in state if key not in shapes]
    if unexpected:
        raise AdapterError(
            f"{source}: tensor {unexpected[0]!r} belongs to no LoRA layer of the model "
            f"(its target_modules select e.g. {next(iter(shapes)).rsplit('.', 2)[0]!r})"
        )
    for key, shape in shapes.items():
        if tuple(state[key].shape) != shape:
            raise AdapterError(
                f"{source}: tensor {key!r} has shape {list(state[key].shape)}, the model needs {list(shape)}"
            )


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
    """Copy adapter tensors named as :func:`lora_state_dict` names them; every key must fit exactly."""
    layers = _require_lora(model)
    if any(layer.merged for _, layer in layers):
        raise AdapterError(f"{source}: cannot load adapter weights into merged LoRA layers; unmerge first")
    shapes = {}
    for name, layer in layers:
        shapes[f"{name}.lora_A.weight"] = tuple(layer.lora_A.weight.shape)
        shapes[f"{name}.lora_B.weight"] = tuple(layer.lora_B.weight.shape)
    _check_tensors(state, shapes, source)
    with torch.no_grad():
        for name, layer in layers:
            layer.lora_A.weight.copy_(state[f"{name}.lora_A.weight"])
            lora_b = state[f"{name}.lora_B.weight"]
            if isinstance(layer, LoraExpertWeights):
                lora_b = layer.checkpoint_rows(lora_b, to_checkpoint=False)
            layer.lora_B.weight.copy_(lora_b)


def _as_written(targets: str | Sequence[str]) -> str | list[str]:
    return targets if isinstance(targets, str) else list(targets)


def _saved_target_modules(model: nn.Module, cfg: LoraConfig, wrapped: list[str]) -> list[str] | str:
    """``target_modules`` as written to disk; "all-linear" becomes the full names, as PEFT writes it."""
    experts = set(expert_lora_names(model))
    selected = [n for n in find_linears(model, cfg.target_modules) if n not in experts]
    wrapped = [n for n in wrapped if n not in experts]
    if sorted(selected) != sorted(wrapped):
        extra = sorted(set(selected) ^ set(wrapped))
        raise AdapterError(
            f"LoraConfig.target_modules {_as_written(cfg.target_modules)!r} does not describe the model's LoRA layers "
            f"(they differ at {extra[0]!r}); pass the config the adapter was made with"
        )
    return sorted(wrapped) if cfg.target_modules == ALL_LINEAR else _as_written(cfg.target_modules)


def save_adapter(
    model: nn.Module,
    folder: str | os.PathLike,
    cfg: LoraConfig,
    base_model_name_or_path: str | None = None,
    modules_to_save: list[str] | None = None,
    task_type: str = "CAUSAL_LM",
) -> Path:
    """Write the model's adapter to ``folder`` in PEFT's format; return the folder.

    Both files are written to temp files first. The old config is removed
    before the new files are renamed into place, so a crash leaves either the
    old adapter, the new one, or a folder with no config (which no loader
    takes for an adapter), never a config paired with the wrong weights.
    Other files in ``folder`` are left alone.
    """
    layers = _require_lora(model)
    cfg = _for_model(model, cfg)
    for name, layer in layers:
        if (layer.r, layer.alpha, layer.use_rslora) != (cfg.r, cfg.alpha, cfg.use_rslora):
            raise AdapterError(
                f"{name} has r={layer.r}, alpha={layer.alpha}, use_rslora={layer.use_rslora} but the LoraConfig to "
                "save says "
                f"r={cfg.r}, alpha={cfg.alpha}, use_rslora={cfg.use_rslora}"
            )
    target_modules = _saved_target_modules(model, cfg, [name for name, _ in layers])
    peft_config = cfg.to_peft(target_modules, base_model_name_or_path)
    tensors = {PEFT_PREFIX + key: t.contiguous() for key, t in lora_state_dict(model).items()}
    if modules_to_save:  # trained whole beside the adapter (a classification head): PEFT's modules_to_save
        peft_config.update(task_type=task_type, modules_to_save=list(modules_to_save))
        for module in modules_to_save:
            for name, param in model.get_submodule(module).named_parameters():
                tensors[f"{PEFT_PREFIX}{module}.{name}"] = param.detach().contiguous()
    else:
        peft_config["task_type"] = task_type
    config_text = json.dumps(peft_config, indent=2, sort_keys=True) + "\n"

    folder = Path(folder)
    check_finite(tensors, folder / ADAPTER_WEIGHTS, AdapterError)
    folder.mkdir(parents=True, exist_ok=True)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    tmp_weights = atomic.temp_file(weights_path, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    try:
        tmp_config = atomic.temp_file(config_path, lambda p: p.write_text(config_text))
    except BaseException:
        tmp_weights.unlink()
        raise
    config_path.unlink(missing_ok=True)
    os.replace(tmp_weights, weights_path)
    os.replace(tmp_config, config_path)
    atomic.fsync_dir(folder)
    return folder


def read_adapter_config(folder: str | os.PathLike) -> LoraConfig:
    """The :class:`LoraConfig` of the adapter in ``folder`` (PEFT's ``adapter_config.json``)."""
    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterError(f"{folder}: no {ADAPTER_CONFIG}; not an adapter folder (or an interrupted save)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise AdapterError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    except (ValueError, RecursionError) as err:  # not UTF-8, a huge integer, absurd nesting
        raise AdapterError(f"{path}: invalid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return LoraConfig.from_peft(raw, str(path))


def load_adapter(model: nn.Module, folder: str | os.PathLike) -> LoraConfig:
    """Apply the adapter in ``folder`` (made by :func:`save_adapter` or PEFT) to ``model``; return its config.

    Everything is checked before the model is touched: a tensor that is
    missing, has the wrong shape, or belongs to no targeted layer raises
    :class:`AdapterError` naming the tensor and the folder, and leaves the
    model as it was.
    """
    _refuse_second_adapter(model)
    cfg = read_adapter_config(folder)
    weights_path = Path(folder) / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        hint = ""
        if (Path(folder) / "adapter_model.bin").is_file():
            hint = " (adapter_model.bin is a pickle, which entrenar does not load; re-save it with safetensors)"
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS}{hint}")
    try:
        raw = load_file(weights_path)
    except (SafetensorError, OSError) as err:
        raise AdapterError(f"{weights_path}: cannot read safetensors file: {err}") from None

    state = {}
    for key, tensor in raw.items():
        if not key.startswith(PEFT_PREFIX):
            raise AdapterError(
                f"{weights_path}: tensor {key!r} does not start with {PEFT_PREFIX!r}; not a PEFT LoRA adapter"
            )
        state[key[len(PEFT_PREFIX) :]] = tensor

    try:
        names = find_linears(model, cfg.target_modules, strict=False)
    except AdapterError as err:
        raise AdapterError(f"{folder}: {err}") from None
    saved = _saved_modules(model, folder, state, str(weights_path))
    try:
        expert_shapes = expected_expert_shapes(model, cfg.target_parameters, cfg.r)
    except AdapterError as err:
        raise AdapterError(f"{folder}: {err}") from None
    _check_tensors(state, {**_expected_shapes(model, names, cfg.r), **expert_shapes}, str(weights_path))
    _wrap(model, names, cfg)
    _wrap_experts(model, cfg)
    load_lora_state_dict(model, state, str(weights_path))
    with torch.no_grad():
        for param, tensor in saved.values():
            param.copy_(tensor)
    return cfg


def _saved_modules(
    model: nn.Module, folder: str | os.PathLike, state: dict[str, torch.Tensor], where: str
) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    """Take the weights of PEFT's ``modules_to_save`` (stored whole, e.g. a classification head) out of
    ``state``, each checked against the model's parameter of that name and shape."""
    raw = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    modules = raw.get("modules_to_save") or []
    params = dict(model.named_parameters())
    saved = {}
    for key in list(state):
        if not any(key.startswith(m + ".") for m in modules):
            continue
        name = key.replace(".modules_to_save.default.", ".").replace(".modules_to_save.", ".")
        if name not in params:
            raise AdapterError(f"{where}: tensor {key!r} is a saved module the model has no parameter for")
        if sum(p is params[name] for _, p in model.named_parameters(remove_duplicate=False)) > 1:
            raise AdapterError(f"{where}: tensor {key!r} would replace {name}, which the model shares (tied weights)")
        if tuple(params[name].shape) != tuple(state[key].shape):
            raise AdapterError(f"{where}: tensor {key!r} has shape {tuple(state[key].shape)}, the model's "
                               f"{name} has {tuple(params[name].shape)}")
        saved[name] = (params[name], state.pop(key))
    return saved


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LoraConfig",
    "LoraLinear",
    "adapter_dtype",
    "apply_lora",
    "continue_adapter",
    "load_adapter",
    "load_lora_state_dict",
    "lora_layers",
    "lora_parameters",
    "lora_scaling",
    "lora_state_dict",
    "merge_lora",
    "read_adapter_config",
    "save_adapter",
    "unload_lora",
    "unmerge_lora",
]
