"""mergekit's merge YAML, read into typed objects; anything entrenar would not honour is refused by name.

    merge_method: ties
    base_model: path/to/base
    models:
      - model: path/to/math-finetune
        parameters: {weight: 0.5, density: 0.5}
      - model: path/to/base+path/to/code-adapter     # a model with a LoRA adapter merged in on the fly
        parameters:
          weight: [0.2, 0.8]                         # a gradient: interpolated over the layers
          density: [{filter: mlp, value: 0.7}, {value: 0.4}]   # first filter found in the tensor name wins
    parameters: {normalize: true, lambda: 1.0}
    dtype: bfloat16

Parameter values are resolved per output tensor exactly as mergekit does it
(:func:`evaluate_setting`): a scalar; a list of numbers interpolated at ``t`` (a
layer's position in its slice, 0 for the first layer and 1 for the last, 0 for
tensors outside the layers); a list of ``{filter, value}`` whose first entry
whose filter is a substring of the tensor name (or is absent or ``*``) gives the
value. A model's own value wins over the slice's, which wins over the global one.

Errors name the file and line of the key at fault.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from entrenar.config import Where, key_lines, load_yaml, read_yaml_text
from entrenar.errors import ConfigError, ModelError
from entrenar.io import hub
from entrenar.merge.methods import METHODS, REQUIRED, RESCALE_NORMS

TOP_KEYS = ("merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype",
            "tokenizer_source", "chat_template", "seed")
# mergekit keys entrenar does not honour, with why; refused rather than silently ignored.
UNSUPPORTED = {
    "modules": "per-module merges (multimodal models) are not supported; use models or slices",
    "tokenizer": "the 'tokenizer:' block (per-token embedding sources) is not supported; use tokenizer_source",
    "residual_weight": "residual_weight is not supported",
}
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16", "float64": "float64"}
CHAT_TEMPLATES = ("auto", "chatml")


# -- parameter values -----------------------------------------------------------------


def evaluate_setting(setting: Any, tensor_name: str, t: float) -> Any:
    """A parameter's value for one tensor (None when a filter list matches nothing): see the module docstring."""
    if isinstance(setting, (bool, int, float, str)) or setting is None:
        return setting
    if isinstance(setting, dict):
        setting = [setting]
    if all(isinstance(e, (int, float)) and not isinstance(e, bool) for e in setting):
        scaled = t * (len(setting) - 1)
        i0 = int(scaled)
        i1 = min(len(setting) - 1, i0 + 1)
        frac = scaled - i0
        return (1 - frac) * setting[i0] + frac * setting[i1]
    if all(isinstance(e, (bool, int, float, str)) for e in setting):
        return setting[int(t * (len(setting) - 1))]
    for cond in setting:
        pattern = cond.get("filter")
        if pattern is None or pattern == "*" or (tensor_name and pattern in tensor_name):
            return evaluate_setting(cond["value"], tensor_name, t)
    return None


def _check_setting(value: Any, where: str, key: str) -> None:
    """Refuse values that are none of: scalar, list of scalars, list of {filter, value}."""
    def scalar(v: Any) -> bool:
        return isinstance(v, (bool, int, float, str)) and not (isinstance(v, float) and not math.isfinite(v))

    if scalar(value):
        return
    items = [value] if isinstance(value, dict) else value
    if isinstance(items, list) and items and all(scalar(v) for v in items):
        return
    if isinstance(items, list) and items and all(isinstance(v, dict) for v in items):
        for cond in items:
            extra = set(cond) - {"filter", "value"}
            if extra or "value" not in cond:
                raise ConfigError(
                    f"{where}: parameter '{key}': each conditional entry needs 'value' and optionally 'filter'"
                    + (f" (unknown key '{sorted(extra)[0]}')" if extra else "")
                )
            if cond.get("filter") is not None and not isinstance(cond["filter"], str):
                raise ConfigError(f"{where}: parameter '{key}': filter must be a string, got {cond['filter']!r}")
            _check_setting(cond["value"], where, key)
        return
    raise ConfigError(
        f"{where}: parameter '{key}' must be a number, a list of numbers (a gradient over the layers) "
        f"or a list of {{filter, value}}, got {value!r}"
    )


_TEXT_PARAMETERS = ("rescale_norm", "consensus_method")  # the only parameters whose values are words


def _leaves(setting: Any) -> list[Any]:
    """The scalars of a setting: itself, a gradient's entries, or each conditional entry's value."""
    if isinstance(setting, dict):
        return _leaves(setting.get("value"))
    if isinstance(setting, list):
        return [leaf for item in setting for leaf in _leaves(item)]
    return [setting]


# -- the config --------------------------------------------------------------------


@dataclass
class ModelRef:
    """An input: a Hugging Face folder or .gguf file, optionally ``+`` a PEFT LoRA adapter folder; either may be a
    Hub id (``org/name``, ``org/name@revision``, as mergekit writes them)."""

    text: str
    path: Path
    adapter: Path | None = None
    where: str = ""  # file and line it was written at

    @classmethod
    def parse(cls, text: Any, where: str, root: Path | None) -> ModelRef:
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}: a model must be a path (a Hugging Face folder or .gguf file) or a Hub id "
                              f"(org/name), got {text!r}")
        model, _, adapter = text.strip().partition("+")
        try:
            return cls(text.strip(), _resolve(model, root), _resolve(adapter, root) if adapter else None, where)
        except ModelError as e:
            raise ModelError(f"{where}: {e}") from None

    def __str__(self) -> str:
        return self.text


def _resolve(text: str, root: Path | None) -> Path:
    """A path as written; relative ones that do not exist from here are tried beside the config file, then as a
    Hub id (``org/name[@revision]``: the cached snapshot, fetched first when the Hub is reachable)."""
    path = Path(text).expanduser()
    if not path.is_absolute() and not path.exists() and root is not None and (root / path).exists():
        return root / path
    return hub.resolve(text)


@dataclass
class Source:
    """One model feeding a slice (or the whole merge), with its own parameters."""

    model: ModelRef
    parameters: dict[str, Any] = field(default_factory=dict)
    layer_range: tuple[int, int] | None = None
    where: str = ""

    @property
    def slice_range(self) -> tuple[int, int]:
        """``layer_range`` of a source under ``slices:``, where parsing requires one."""
        assert self.layer_range is not None, f"{self.where}: a slice source without layer_range"
        return self.layer_range


@dataclass
class Slice:
    sources: list[Source]
    parameters: dict[str, Any] = field(default_factory=dict)
    base_model: ModelRef | None = None
    where: str = ""


@dataclass
class MergeConfig:
    """A parsed merge config. Exactly one of ``models`` and ``slices`` is set."""

    merge_method: str
    base_model: ModelRef | None
    models: list[Source] | None
    slices: list[Slice] | None
    parameters: dict[str, Any]
    dtype: str | None = None
    out_dtype: str | None = None
    tokenizer_source: str | ModelRef | None = None
    chat_template: str | None = None
    seed: int = 0
    adapters: bool = False  # every model is a PEFT LoRA adapter folder: the output is one adapter
    source: str = "<config>"
    text: str = ""
    lines: Where = field(default_factory=lambda: Where("<config>"))

    @property
    def spec(self):
        return _spec(self.merge_method, self.adapters)

    def references(self) -> list[ModelRef]:
        """Every input once, in order of first mention (the base first)."""
        refs: dict[str, ModelRef] = {}
        if self.base_model is not None:
            refs[self.base_model.text] = self.base_model
        for src in self.models or []:
            refs.setdefault(src.model.text, src.model)
        for sl in self.slices or []:
            if sl.base_model is not None:
                refs.setdefault(sl.base_model.text, sl.base_model)
            for src in sl.sources:
                refs.setdefault(src.model.text, src.model)
        if isinstance(self.tokenizer_source, ModelRef):
            refs.setdefault(self.tokenizer_source.text, self.tokenizer_source)
        return list(refs.values())


def load_config(config: str | Path | dict[str, Any]) -> MergeConfig:
    """Read a merge config from a YAML file, YAML text, or an already-parsed dict."""
    if isinstance(config, dict):
        return parse_config(config, Where("<config>"), None, yaml.safe_dump(config, sort_keys=False))
    path = Path(config)
    if "\n" not in str(config) and path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"{path}: no such merge config file")
        text, source, root = read_yaml_text(path, "merge config"), str(path), path.parent
    else:
        text, source, root = str(config), "<config>", None
    raw, node = load_yaml(text, source)  # the recipe reader's checks: control characters, nesting, encoding
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a merge config must be a mapping with merge_method and models or slices")
    return parse_config(raw, Where(source, key_lines(node, source, sequences=True)), root, text)


def parse_config(raw: dict[str, Any], lines: Where, root: Path | None, text: str = "") -> MergeConfig:
    for key in raw:
        if key in UNSUPPORTED:
            raise ConfigError(f"{lines(key)}: '{key}': {UNSUPPORTED[key]}")
        if key not in TOP_KEYS:
            raise ConfigError(f"{lines(key)}: unknown key '{key}' (allowed: {', '.join(TOP_KEYS)})")
    method = raw.get("merge_method")
    if method not in METHODS:
        where = lines("merge_method") if "merge_method" in raw else lines.source
        what = f"unknown merge_method {method!r}" if method is not None else "missing merge_method"
        raise ConfigError(f"{where}: {what} (supported: {', '.join(METHODS)})")
    adapters = _all_adapters(raw.get("models"), root)
    spec = _spec(method, adapters)
    if ("models" in raw) == ("slices" in raw):
        raise ConfigError(f"{lines.source}: give exactly one of 'models' and 'slices'")

    base = ModelRef.parse(raw["base_model"], lines("base_model"), root) if raw.get("base_model") else None
    models = slices = None
    if "models" in raw:
        models = [_source(item, f"models[{i}]", lines, root, spec, slice_ok=False)
                  for i, item in enumerate(_list(raw["models"], "models", lines))]
    else:
        slices = [_slice(item, f"slices[{i}]", lines, root, spec)
                  for i, item in enumerate(_list(raw["slices"], "slices", lines))]
    parameters = _parameters(raw.get("parameters"), "parameters", lines, spec, per_model=False)

    cfg = MergeConfig(
        merge_method=method, base_model=base, models=models, slices=slices, parameters=parameters,
        dtype=_dtype(raw, "dtype", lines), out_dtype=_dtype(raw, "out_dtype", lines),
        adapters=adapters, source=lines.source, text=text, lines=lines,
    )
    ts = raw.get("tokenizer_source")
    if ts is not None:
        if ts in ("base", "union"):
            cfg.tokenizer_source = ts
        else:
            cfg.tokenizer_source = ModelRef.parse(ts, lines("tokenizer_source"), root)
    template = raw.get("chat_template")
    if template is not None:
        if not isinstance(template, str) or (template not in CHAT_TEMPLATES and "{" not in template):
            raise ConfigError(
                f"{lines('chat_template')}: chat_template must be {', '.join(CHAT_TEMPLATES)} or a Jinja template, "
                f"got {template!r}"
            )
        cfg.chat_template = template
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"{lines('seed')}: seed must be an integer, got {seed!r}")
    cfg.seed = seed
    _check_structure(cfg)
    return cfg


def _spec(method: str, adapters: bool):
    """The method's parameters; merging adapters needs no base and takes a target ``rank``."""
    spec = METHODS[method]
    if not adapters:
        return spec
    return replace(spec, base="none", global_params={**spec.global_params, "rank": None})


def _all_adapters(models: Any, root: Path | None) -> bool:
    """Whether every model entry is a PEFT adapter folder (then the merge's output is an adapter)."""
    if not isinstance(models, list) or not models:
        return False
    paths = [m.get("model") if isinstance(m, dict) else m for m in models]
    return all(isinstance(p, str) and "+" not in p and _is_adapter(p, root) for p in paths)


def _is_adapter(text: str, root: Path | None) -> bool:
    try:
        return (_resolve(text, root) / "adapter_config.json").is_file()
    except ModelError:
        return False  # reported where the model is parsed, with its line


def _list(value: Any, key: str, lines: Where) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{lines(key)}: '{key}' must be a non-empty list")
    return value


def _dtype(raw: dict[str, Any], key: str, lines: Where) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if value not in DTYPES:
        raise ConfigError(f"{lines(key)}: {key} {value!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[value]


def _parameters(value: Any, path: str, lines: Where, spec, per_model: bool) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{lines(path)}: '{path}' must be a mapping of parameter names to values")
    allowed = dict(spec.tensor_params) if per_model else {**spec.global_params, **spec.tensor_params}
    for key, setting in value.items():
        if key not in allowed:
            names = ", ".join(allowed) or "none"
            scope = "per-model " if per_model else ""
            raise ConfigError(
                f"{lines(f'{path}.{key}')}: parameter '{key}' is not a {scope}parameter of {spec.name} "
                f"(it takes: {names})"
            )
        _check_setting(setting, lines(f"{path}.{key}"), key)
        if key not in _TEXT_PARAMETERS:
            for leaf in _leaves(setting):
                if isinstance(leaf, str):
                    raise ConfigError(f"{lines(f'{path}.{key}')}: parameter '{key}' must be a number "
                                      f"(or true/false), got {leaf!r}")
        if key == "rescale_norm" and setting not in RESCALE_NORMS:
            raise ConfigError(f"{lines(f'{path}.{key}')}: rescale_norm must be one of {', '.join(RESCALE_NORMS)}")
        if key == "consensus_method" and setting not in ("sum", "count"):
            raise ConfigError(f"{lines(f'{path}.{key}')}: consensus_method must be sum or count")
    return dict(value)


def _source(item: Any, path: str, lines: Where, root: Path | None, spec, slice_ok: bool) -> Source:
    allowed = ("model", "parameters", "layer_range") if slice_ok else ("model", "parameters")
    if isinstance(item, str):
        item = {"model": item}
    if not isinstance(item, dict) or "model" not in item:
        raise ConfigError(f"{lines(path)}: each entry needs 'model:' (a path)")
    for key in item:
        if key not in allowed:
            raise ConfigError(f"{lines(f'{path}.{key}')}: unknown key '{key}' (allowed: {', '.join(allowed)})")
    layer_range = None
    if slice_ok:
        lr = item.get("layer_range")
        if (not isinstance(lr, list) or len(lr) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in lr) or not 0 <= lr[0] < lr[1]):
            raise ConfigError(f"{lines(f'{path}.layer_range')}: layer_range must be [start, end) "
                              f"with 0 <= start < end, got {lr!r}")
        layer_range = (lr[0], lr[1])
    params = _parameters(item.get("parameters"), f"{path}.parameters", lines, spec, per_model=True)
    return Source(ModelRef.parse(item["model"], lines(f"{path}.model"), root), params, layer_range, lines(path))


def _slice(item: Any, path: str, lines: Where, root: Path | None, spec) -> Slice:
    if not isinstance(item, dict) or "sources" not in item:
        raise ConfigError(f"{lines(path)}: each slice needs 'sources:'")
    for key in item:
        if key in UNSUPPORTED:
            raise ConfigError(f"{lines(f'{path}.{key}')}: {UNSUPPORTED[key]}")
        if key not in ("sources", "parameters", "base_model"):
            raise ConfigError(f"{lines(f'{path}.{key}')}: unknown key '{key}' "
                              "(allowed: sources, parameters, base_model)")
    sources = [_source(s, f"{path}.sources[{i}]", lines, root, spec, slice_ok=True)
               for i, s in enumerate(_list(item["sources"], f"{path}.sources", lines))]
    lengths = {s.slice_range[1] - s.slice_range[0] for s in sources}
    if len(lengths) > 1:
        raise ConfigError(f"{lines(path)}: all sources of a slice must span the same number of layers, "
                          f"got {sorted(lengths)}")
    base = ModelRef.parse(item["base_model"], lines(f"{path}.base_model"), root) if item.get("base_model") else None
    params = _parameters(item.get("parameters"), f"{path}.parameters", lines, spec, per_model=False)
    return Slice(sources, params, base, lines(path))


def _check_structure(cfg: MergeConfig) -> None:
    """Method-level rules that need no weights: base presence, model counts, required parameters."""
    spec, lines = cfg.spec, cfg.lines
    if cfg.models is not None:
        groups = [(cfg.models, cfg.base_model, lines("models"))]
    else:
        assert cfg.slices is not None  # exactly one of models and slices is set
        groups = [(sl.sources, sl.base_model or cfg.base_model, sl.where) for sl in cfg.slices]
    for sources, base, where in groups:
        names = [s.model.text for s in sources]
        others = [n for n in names if base is None or n != base.text]
        if cfg.adapters and base is not None:
            raise ConfigError(f"{lines('base_model')}: merging adapters takes no base_model (the base is left alone)")
        if spec.base == "required" and base is None:
            raise ConfigError(f"{lines.source}: merge_method {spec.name} needs base_model")
        if spec.name == "passthrough" and len(sources) != 1:
            raise ConfigError(f"{where}: passthrough takes exactly one source per slice (or one model), "
                              f"got {len(sources)}")
        if spec.name == "slerp" and len(others) != 1:
            raise ConfigError(f"{where}: slerp merges base_model with exactly one other model, "
                              f"got {len(others)} others")
        if spec.name == "nuslerp" and len(others) != 2:
            raise ConfigError(f"{where}: nuslerp merges exactly two models (plus an optional base_model), "
                              f"got {len(others)}")
        if spec.name == "model_stock" and len(others) < 2:
            raise ConfigError(f"{where}: model_stock needs at least two models besides base_model, "
                              f"got {len(others)}")
        if cfg.slices is not None and spec.base == "required" and base is not None and base.text not in names:
            raise ConfigError(f"{where}: base_model {base.text} must be one of the slice's sources")
        if len(set(names)) != len(names):
            raise ConfigError(f"{where}: a model is listed twice")
    for key, default in spec.global_params.items():
        if (default is REQUIRED and key not in cfg.parameters
                and not any(key in sl.parameters for sl in cfg.slices or [])):
            raise ConfigError(f"{lines.source}: merge_method {spec.name} needs the parameter '{key}' "
                              "(under parameters:)")


__all__ = ["MergeConfig", "ModelRef", "Slice", "Source", "evaluate_setting", "load_config", "parse_config"]
