"""A merge config plus its inputs' headers -> the list of output tensors, each with its sources and parameters.

Planning reads configs and tensor headers only, so ``--dry-run`` checks a merge
(architectures, layer counts, shapes, vocabularies) without reading a weight.

Output tensors follow the base model's tensor order (the first model's when
there is no base). With ``slices``, the output's layers are the slices' layers
renumbered from 0; tensors outside the layers come from the first slice's
sources (the embeddings) or the last slice's (final norm, output head), as in
mergekit. ``t``, the position gradients are interpolated at, is a layer's index
in its slice over the slice's length minus one, and 0 outside the layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from entrenar.errors import ConfigError, ModelError
from entrenar.merge.config import MergeConfig, ModelRef, Source, evaluate_setting
from entrenar.merge.methods import REQUIRED
from entrenar.merge.stream import Input, TensorInfo

LAYER = re.compile(r"^(?P<prefix>.*?\blayers\.)(?P<index>\d+)(?P<suffix>\..+)$")
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}
# Config fields that must agree for tensors to line up (the layer count is checked per slice).
_ARCH_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim")


@dataclass
class PlannedTensor:
    """One output tensor: where each input's copy is, the resolved parameters, the output shape and dtype."""

    name: str
    info: TensorInfo
    sources: list[tuple[str, str]]  # (model reference, tensor name in it), the base excluded
    base: tuple[str, str] | None
    params: dict[str, Any]  # global parameters, evaluated for this tensor
    model_params: list[dict[str, Any]]  # per source
    t: float
    vocab: bool = False  # rows are tokens (embeddings, output head)


@dataclass
class Plan:
    config: MergeConfig
    tensors: list[PlannedTensor]
    out_config: dict[str, Any]
    out_dtype: torch.dtype
    base_ref: str  # the model whose config and (by default) tokenizer the output takes
    notes: list[str] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # one line per input: family, layers, vocab rows, dtype

    def summary(self) -> str:
        """What will be merged: a short report for ``--dry-run``."""
        cfg = self.config
        total = sum(t.info.nbytes for t in self.tensors)
        lines = [
            f"merge_method: {cfg.merge_method}",
            f"base_model: {self.base_ref if cfg.base_model else '(none)'}",
            "inputs:",
            *[f"  {line}" for line in self.inputs],
            f"output: {len(self.tensors)} tensors, {total / 2**30:.2f} GiB in "
            f"{str(self.out_dtype).removeprefix('torch.')}, "
            f"{self.out_config.get('num_hidden_layers')} layers, vocab_size {self.out_config.get('vocab_size')}",
        ]
        if cfg.parameters:
            lines.append(f"parameters: {cfg.parameters}")
        lines += [f"note: {n}" for n in self.notes]
        shown = self.tensors if len(self.tensors) <= 12 else [*self.tensors[:6], None, *self.tensors[-4:]]
        for t in shown:
            if t is None:
                lines.append(f"  ... {len(self.tensors) - 10} more")
                continue
            src = ", ".join(
                r + (f":{n}" if n != t.name else "")
                + "".join(f" {k}={_short(v)}" for k, v in p.items() if v is not None)
                for (r, n), p in zip(t.sources, t.model_params)
            )
            base = f" (base {t.base[0]})" if t.base else ""
            lines.append(f"  {t.name} {list(t.info.shape)} <- {src}{base}")
        return "\n".join(lines)


def _short(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def _param(name: str, default: Any, tensor: str, t: float, *levels: dict[str, Any] | None) -> Any:
    for level in levels:
        if level and name in level:
            value = evaluate_setting(level[name], tensor, t)
            if value is not None:
                return value
    return default


def check_architectures(cfg: MergeConfig, inputs: dict[str, Input]) -> None:
    """Refuse inputs whose architectures cannot be merged tensor by tensor, naming the field and models."""
    def arch(config: dict[str, Any]) -> dict[str, Any]:
        """The fields, with the defaults transformers fills in when a config leaves them out."""
        out = {key: config.get(key) for key in _ARCH_FIELDS}
        if out["num_key_value_heads"] is None:
            out["num_key_value_heads"] = out["num_attention_heads"]
        if out["head_dim"] is None and out["hidden_size"] and out["num_attention_heads"]:
            out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
        return out

    refs = list(inputs)
    first = arch(inputs[refs[0]].config)
    for ref in refs[1:]:
        other = arch(inputs[ref].config)
        for key in _ARCH_FIELDS:
            if first.get(key) != other.get(key):
                raise ModelError(
                    f"{cfg.source}: {refs[0]} and {ref} differ in {key} ({first.get(key)} vs {other.get(key)}); "
                    "their tensors cannot be merged"
                )


def build_plan(cfg: MergeConfig, inputs: dict[str, Input], vocab_rows: int | None = None) -> Plan:
    """Every output tensor with its sources and parameters; checks shapes and layer counts on the way.

    ``vocab_rows`` is the output's embedding row count when the tokenizer step
    changed it (a union vocabulary); otherwise inputs' vocab rows must agree.
    """
    check_architectures(cfg, inputs)
    spec = cfg.spec
    slices: list[tuple[list[Source], ModelRef | None, dict[str, Any], list[tuple[int, int]]]]
    if cfg.slices is None:
        assert cfg.models is not None  # exactly one of models and slices is set
        base_ref = cfg.base_model.text if cfg.base_model else cfg.models[0].model.text
        n_layers = _layers(inputs[base_ref])
        sources = list(cfg.models)
        base = cfg.base_model
        if (base is not None and base.text not in [s.model.text for s in sources]
                and (spec.base == "required" or spec.name == "nuslerp")):
            sources.append(Source(base, {}, None, cfg.lines("base_model")))
        slices = [(sources, base, {}, [(0, n_layers)] * len(sources))]
        for s in sources:
            if _layers(inputs[s.model.text]) != n_layers:
                raise ModelError(
                    f"{s.where}: {s.model} has {_layers(inputs[s.model.text])} layers but {base_ref} has {n_layers}; "
                    "use slices: with layer_range to merge models of different depths"
                )
    else:
        base_ref = (cfg.slices[0].base_model or cfg.base_model or cfg.slices[0].sources[0].model).text
        slices = []
        for sl in cfg.slices:
            for s in sl.sources:
                have = _layers(inputs[s.model.text])
                if s.slice_range[1] > have:
                    raise ConfigError(f"{s.where}: layer_range {list(s.slice_range)} goes past {s.model}'s "
                                      f"{have} layers")
            slices.append((sl.sources, sl.base_model or cfg.base_model, sl.parameters,
                           [s.slice_range for s in sl.sources]))

    base_input = inputs[base_ref]
    out_config = dict(base_input.config)
    tied = bool(out_config.get("tie_word_embeddings"))
    for ref, model in inputs.items():
        if tied and not model.config.get("tie_word_embeddings") and model.has("lm_head.weight"):
            raise ModelError(
                f"{cfg.source}: {base_ref} ties its output head to the embeddings but {ref} has its own lm_head; "
                "the merge cannot keep both (merge into an untied base)"
            )
    out_dtype = _out_dtype(cfg, base_input)
    names = list(base_input.tensors())
    layer_names = [n for n in names if LAYER.match(n)]
    # As mergekit: embeddings come before the layers (from the first slice), everything else after (the last).
    pre = [n for n in names if not LAYER.match(n) and "embed" in n]
    post = [n for n in names if not LAYER.match(n) and "embed" not in n]
    if not tied and "lm_head.weight" not in names:
        post.append("lm_head.weight")
    if tied and "lm_head.weight" in post:
        post.remove("lm_head.weight")
    per_layer = _layer_suffixes(layer_names)

    plan: list[PlannedTensor] = []

    def add(out_name: str, srcs: list[Source], ranges_index: list[str], base, slice_params, t: float) -> None:
        base_text = base.text if base is not None else None
        sources, model_params, base_loc = [], [], None
        for s, in_name in zip(srcs, ranges_index):
            model = inputs[s.model.text]
            stored = model.resolve(in_name)
            if not model.has(stored):
                raise ModelError(f"{s.model}: has no tensor '{in_name}' (needed for output {out_name})")
            if s.model.text == base_text and spec.base != "none" and spec.name not in ("linear", "passthrough"):
                base_loc = (s.model.text, stored)
                continue
            sources.append((s.model.text, stored))
            mp = {}
            for key, default in spec.tensor_params.items():
                value = _param(key, default, in_name, t, s.parameters, slice_params, cfg.parameters)
                if value is REQUIRED:
                    raise ConfigError(f"{s.where}: {s.model} needs the parameter '{key}' for {spec.name} "
                                      f"(tensor {in_name})")
                mp[key] = value
            model_params.append(mp)
        params = {}
        for key, default in spec.global_params.items():
            value = _param(key, default, out_name, t, slice_params, cfg.parameters)
            if value is REQUIRED:
                raise ConfigError(f"{cfg.source}: {spec.name} needs the parameter '{key}' (tensor {out_name})")
            params[key] = value
        shapes = {inputs[r].tensors()[n].shape for r, n in sources + ([base_loc] if base_loc else [])}
        vocab = out_name in VOCAB_TENSORS
        if vocab and vocab_rows is not None:
            shape = (vocab_rows, *next(iter(shapes))[1:])
        elif len(shapes) > 1:
            what = ", ".join(f"{r} {list(inputs[r].tensors()[n].shape)}"
                             for r, n in sources + ([base_loc] if base_loc else []))
            hint = ("; the vocabularies differ: set tokenizer_source (base, union or a model) to map embeddings by "
                    "token" if vocab else "")
            raise ModelError(f"{cfg.source}: tensor {out_name} has different shapes: {what}{hint}")
        else:
            shape = next(iter(shapes))
        stored_dtype = inputs[(base_loc or sources[0])[0]].tensors()[(base_loc or sources[0])[1]].dtype
        dtype = out_dtype if stored_dtype.is_floating_point else stored_dtype
        plan.append(PlannedTensor(out_name, TensorInfo(tuple(shape), dtype), sources, base_loc, params, model_params,
                                  t, vocab))

    first_sources, first_base, first_params, _ = slices[0]
    for name in pre:
        add(name, first_sources, [name] * len(first_sources), first_base, first_params, 0.0)
    out_layer = 0
    for srcs, base, slice_params, ranges in slices:
        length = ranges[0][1] - ranges[0][0]
        for i in range(length):
            t = i / (length - 1) if length > 1 else 1.0
            for prefix, suffix in per_layer:
                in_names = [f"{prefix}{r[0] + i}{suffix}" for r in ranges]
                add(f"{prefix}{out_layer}{suffix}", srcs, in_names, base, slice_params, t)
            out_layer += 1
    last_sources, last_base, last_params, _ = slices[-1]
    for name in post:
        add(name, last_sources, [name] * len(last_sources), last_base, last_params, 0.0)

    described = []
    for ref, model in inputs.items():
        kinds = [i.dtype for i in model.tensors().values() if i.dtype.is_floating_point]
        stored = str(max(set(kinds), key=kinds.count)).removeprefix("torch.") if kinds else "?"
        embed = model.tensors().get("model.embed_tokens.weight")
        described.append(f"{ref}: {model.config.get('model_type')}, {model.config.get('num_hidden_layers')} layers, "
                         f"{embed.shape[0] if embed else '?'} vocab rows, {stored}")
    n_out = out_layer
    if n_out != out_config.get("num_hidden_layers"):
        _relayer_config(out_config, slices, inputs, n_out)
    if vocab_rows is not None:
        out_config["vocab_size"] = vocab_rows
    return Plan(cfg, plan, out_config, out_dtype, base_ref, inputs=described)


def _layers(model: Input) -> int:
    n = model.config.get("num_hidden_layers")
    if not isinstance(n, int):
        raise ModelError(f"{model.reference}: config has no num_hidden_layers")
    return n


def _layer_suffixes(layer_names: list[str]) -> list[tuple[str, str]]:
    """The (prefix, suffix) of each tensor in layer 0, in order: the per-layer template."""
    out = []
    for name in layer_names:
        m = LAYER.match(name)
        assert m is not None  # layer_names are the names LAYER matches
        if m.group("index") == "0":
            out.append((m.group("prefix"), m.group("suffix")))
    return out


def _relayer_config(config: dict[str, Any], slices, inputs: dict[str, Input], n_out: int) -> None:
    """A sliced output's config: its layer count, and per-layer lists (layer_types) taken from the sources."""
    n_in = config.get("num_hidden_layers")
    config["num_hidden_layers"] = n_out
    for key, value in list(config.items()):
        if isinstance(value, list) and len(value) == n_in and key not in ("architectures",):
            picked = []
            for srcs, _, _, ranges in slices:
                source = inputs[srcs[0].model.text].config.get(key) or value
                picked += list(source[ranges[0][0] : ranges[0][1]])
            config[key] = picked
    if isinstance(config.get("max_window_layers"), int):
        config["max_window_layers"] = min(config["max_window_layers"], n_out)


def _out_dtype(cfg: MergeConfig, base: Input) -> torch.dtype:
    """out_dtype, else dtype, else the dtype the base's weights are stored in."""
    name = cfg.out_dtype or cfg.dtype
    if name:
        return _TORCH_DTYPES[name]
    kinds = [i.dtype for i in base.tensors().values() if i.dtype.is_floating_point]
    return max(set(kinds), key=kinds.count) if kinds else torch.float32


__all__ = ["Plan", "PlannedTensor", "VOCAB_TENSORS", "build_plan", "check_architectures"]
