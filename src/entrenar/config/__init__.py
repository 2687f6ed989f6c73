"""The run recipe: a YAML file <-> typed dataclasses, plus ``--set`` overrides.

A recipe has nine sections (model, data, lora, qat, optimizer, schedule,
training, output, moe). Each is a frozen dataclass whose fields carry a default and a rule;
the rules run whenever a section is built, so a ``Recipe`` in hand is valid.
Errors name the file, the line, the dotted key and what is allowed, because a
typo found after an hour of training costs that hour.

``recipes/lora-llama.yaml`` documents every key with a comment.
"""

from __future__ import annotations

import difflib
import importlib.resources
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import yaml

from entrenar.errors import ConfigError

__all__ = [
    "DataSection",
    "LoraSection",
    "ModelSection",
    "OptimizerSection",
    "OutputSection",
    "QatSection",
    "Recipe",
    "ScheduleSection",
    "TrainingSection",
    "load_recipe",
    "recipe_changes",
    "save_recipe",
]

QUICKSTART = "recipes/quickstart.yaml"  # package data of `entrenar`
MAX_SEQ_LEN = 2**22  # 4x the longest contexts models train at today; a row this long is 128 MiB of index tensors


# --------------------------------------------------------------------------
# Message helpers


def _unknown(at: str, dotted: str, key: Any, allowed: list[str]) -> ConfigError:
    close = _closest(key, allowed)
    hint = f"; did you mean '{close}'?" if close else ""
    return ConfigError(f"{at}: unknown key '{_printable(dotted)}' (allowed: {', '.join(allowed)}{hint})")


def _printable(text: str, limit: int = 80) -> str:
    """``text`` for a one-line message: control characters escaped, cut to ``limit`` characters."""
    shown = text if text.isprintable() else repr(text)[1:-1]
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _closest(value: Any, options: list[str]) -> str | None:
    """The option a typo most likely meant, if any is close."""
    if not isinstance(value, str):
        return None
    close = difflib.get_close_matches(value, options, n=1)
    return close[0] if close else None


def _show(value: Any) -> str:
    """A value as the user would write it in YAML: 'eight', true, null, [1, 2]."""
    if isinstance(value, str):
        return repr(value) if len(value) <= 80 else repr(value[:77]) + "..."
    if isinstance(value, tuple):
        value = list(value)
    if value is None or isinstance(value, (bool, list, dict)):
        text = yaml.safe_dump(value, default_flow_style=True, width=1_000_000).strip()
        text = text.removesuffix("...").strip()
        return text if len(text) <= 80 else text[:77] + "..."
    return str(value)


def _plain_text(option: Any) -> str:
    return option if isinstance(option, str) else _show(option)


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and not prefix:  # sections only; lr_scale stays whole
            flat.update(_flatten(value, f"{key}."))
        else:
            flat[prefix + key] = value
    return flat


# --------------------------------------------------------------------------
# Rules: each takes a raw value and returns it normalized, or raises _Reject.


class _Reject(Exception):
    """A value broke a rule; ``expected`` says what the rule allows."""

    def __init__(self, expected: str, hint: str = "") -> None:
        super().__init__(expected)
        self.expected = expected
        self.hint = hint


Rule = Callable[[Any], Any]

# PyYAML follows YAML 1.1, where a float needs a dot: `1e-4` loads as a string.
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def _as_number(value: Any) -> float | None:
    """``value`` as a finite float, accepting ints and numeric strings but not bools."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) or isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        number = float(value)
    else:
        return None
    return number if math.isfinite(number) else None


def _integer(low: int, high: int | None = None, *, nullable: bool = False) -> Rule:
    if high is not None:
        expected = f"an integer in [{low}, {high}]"
    else:
        expected = "an integer > 0" if low == 1 else f"an integer >= {low}"
    if nullable:
        expected += " or null"

    def rule(value: Any) -> int | None:
        if value is None and nullable:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            if value >= low and (high is None or value <= high):
                return value
        raise _Reject(expected)

    return rule


def _number(
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> Rule:
    if low is not None and high is not None:
        expected = f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        expected = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        expected = "a number"

    def rule(value: Any) -> float:
        number = _as_number(value)
        if number is None:
            raise _Reject(expected)
        if low is not None and (number <= low if low_open else number < low):
            raise _Reject(expected)
        if high is not None and (number >= high if high_open else number > high):
            raise _Reject(expected)
        return number

    return rule


def _choice(*options: str | bool | None) -> Rule:
    expected = "one of: " + ", ".join(_plain_text(o) for o in options)

    def rule(value: Any) -> str | bool | None:
        for option in options:
            if type(value) is type(option) and value == option:  # True must not match 1
                return option
        close = _closest(value, [o for o in options if isinstance(o, str)])
        raise _Reject(expected, f" (did you mean '{close}'?)" if close else "")

    return rule


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _Reject("true or false")


def _text(*, nullable: bool = False) -> Rule:
    expected = "a non-empty string" + (" or null" if nullable else "")

    def rule(value: Any) -> str | None:
        if value is None and nullable:
            return None
        if isinstance(value, str) and value.strip():
            return value
        raise _Reject(expected)

    return rule


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
DEVICE_NAMES = "auto, cpu, cuda, cuda:N"


def is_device_name(value: Any) -> bool:
    """True for the device names a recipe's model.device and the CLI's --device accept."""
    return isinstance(value, str) and _DEVICE.fullmatch(value) is not None


def _device(value: Any) -> str:
    if is_device_name(value):
        return value
    raise _Reject(f"one of: {DEVICE_NAMES}")


def _modules(value: Any) -> str | tuple[str, ...]:
    expected = "'all-linear' or a non-empty list of module names"
    if value == "all-linear":
        return value
    if isinstance(value, str):
        raise _Reject(expected, f" (write [{value}] for a single module)")
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise _Reject(expected)


def _parameter_names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise _Reject("null or a non-empty list of parameter names", " (e.g. [mlp.experts.gate_up_proj])")


def _betas(value: Any) -> tuple[float, float]:
    expected = "a list of two numbers in [0, 1)"
    if isinstance(value, (list, tuple)) and len(value) == 2:
        pair = [_as_number(v) for v in value]
        if all(b is not None and 0.0 <= b < 1.0 for b in pair):
            return (pair[0], pair[1])
    raise _Reject(expected)


def _lr_scales(value: Any) -> dict[str, float]:
    expected = "a mapping of module-name regex to a number > 0"
    if not isinstance(value, dict):
        raise _Reject(expected)
    scales = {}
    for pattern, scale in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise _Reject(expected)
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as e:  # sre's parser recurses per nested group
            raise _Reject(expected, f" ({_show(pattern)} is not a valid regex: {e})") from None
        number = _as_number(scale)
        if number is None or number <= 0:
            raise _Reject(expected, f" (scale of '{pattern}' is {_show(scale)})")
        scales[pattern] = number
    return scales


def _activation_bits(value: Any) -> bool | int:
    """QAT activations: false (off), true (8 bits) or a bit width."""
    if value is None or value is False:
        return False
    if value is True:
        return 8
    if isinstance(value, int) and 2 <= value <= 8:
        return value
    raise _Reject("true, false or a bit width in [2, 8]")


def _checkpoint_layers(value: Any) -> bool | int | tuple[int, ...]:
    """Activation checkpointing: true (every layer), false, a number of layers (spread evenly), or layer indices."""
    expected = "true, false, a number of layers, or a list of layer indices"
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        if len(set(value)) == len(value):
            return tuple(value)
        raise _Reject(expected, " (each index once)")
    raise _Reject(expected)


def _offload_layers(value: Any) -> bool | int:
    """Activation offload: true (every layer but the last), false, or a number of layers (the first ones)."""
    if isinstance(value, bool) or (isinstance(value, int) and value >= 0):
        return value
    raise _Reject("true, false, or a number of layers (the first ones)")


# Metrics where larger is better; any other metric (eval_loss, eval_ppl, ...) is minimised unless `mode` says so.
_MAXIMISED_METRICS = ("accuracy", "acc", "f1", "macro_f1", "micro_f1", "weighted_f1", "precision", "recall", "auc",
                      "exact_match", "mcc", "kappa", "r2", "spearman", "subset_accuracy", "top2_accuracy",
                      "top3_accuracy", "top5_accuracy")


def _early_stopping(value: Any) -> dict[str, Any] | None:
    """Early stopping: null (off) or {metric, patience, min_delta, mode}; mode defaults from the metric's name."""
    expected = "null or a mapping {metric, patience, min_delta, mode}"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _Reject(expected)
    unknown = [k for k in value if k not in ("metric", "patience", "min_delta", "mode")]
    if unknown:
        raise _Reject(expected, f" (unknown key {_show(unknown[0])})")
    metric = value.get("metric", "eval_loss")
    if not isinstance(metric, str) or not metric.strip():
        raise _Reject(expected, " (metric must be a name such as eval_loss)")
    patience = value.get("patience", 3)
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
        raise _Reject(expected, f" (patience must be an integer > 0, got {_show(patience)})")
    min_delta = _as_number(value.get("min_delta", 0.0))
    if min_delta is None or min_delta < 0:
        raise _Reject(expected, f" (min_delta must be a number >= 0, got {_show(value.get('min_delta'))})")
    name = metric.removeprefix("eval_")
    mode = value.get("mode", "max" if name in _MAXIMISED_METRICS else "min")
    if mode not in ("min", "max"):
        raise _Reject(expected, f" (mode must be min or max, got {_show(mode)})")
    return {"metric": metric, "patience": patience, "min_delta": min_delta, "mode": mode}


def _model_config(value: Any) -> dict[str, Any] | None:
    """model.config: null, or a mapping of config.json keys (checked key by key when the model is built)."""
    if value is None:
        return None
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        return dict(value)
    raise _Reject("null or a non-empty mapping of config.json keys", " (e.g. {model_type: llama, hidden_size: 64})")


def _key(default: Any, rule: Rule) -> Any:
    """A dataclass field with a default and the rule its values must pass."""
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


# --------------------------------------------------------------------------
# Sections


class _BadValue(ConfigError):
    """A ConfigError about one dotted key; loaders prefix it with where the key was written."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class _Section:
    """Checks and normalizes every field when built, so an instance is always valid."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            key = f"{self.section}.{f.name}"
            try:
                object.__setattr__(self, f.name, f.metadata["rule"](value))
            except _Reject as r:
                raise _BadValue(key, f"'{key}' must be {r.expected}, got {_show(value)}{r.hint}") from None


@dataclass(frozen=True)
class ModelSection(_Section):
    """Which weights to load, in which dtype, on which device."""

    section: ClassVar[str] = "model"
    path: str | None = _key(None, _text(nullable=True))
    dtype: str = _key("auto", _choice("auto", "float32", "bfloat16", "float16"))
    device: str = _key("auto", _device)
    init: str = _key("pretrained", _choice("pretrained", "random"))  # random: built from `config` (EXPERIMENTS.md)
    config: dict[str, Any] | None = _key(None, _model_config)  # init random: a config.json-style mapping
    tokenizer: str | None = _key(None, _text(nullable=True))  # init random: a tokenizer.json; null: byte-level

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.init == "random":
            if self.config is None:
                raise _BadValue("model.config", "'model.config' is required when 'model.init' is random (a "
                                                "mapping of config.json keys: model_type, hidden_size, ...)")
            if self.path is not None:
                raise _BadValue("model.path", f"'model.path' must be null when 'model.init' is random (the model is "
                                              f"built from model.config), got {_show(self.path)}")
        else:
            for key in ("config", "tokenizer"):
                if getattr(self, key) is not None:
                    raise _BadValue(f"model.{key}", f"'model.{key}' is for 'model.init: random'; a pretrained "
                                                    "model takes both from model.path")


@dataclass(frozen=True)
class DataSection(_Section):
    """Where the examples come from and how they become token sequences."""

    section: ClassVar[str] = "data"
    train: str | None = _key(None, _text(nullable=True))
    validation: str | None = _key(None, _text(nullable=True))
    validation_split: float = _key(0.0, _number(0.0, 0.5, high_open=True))
    format: str = _key("auto", _choice("auto", "jsonl", "json", "csv", "parquet", "text"))
    text_field: str = _key("text", _text())
    prompt_field: str = _key("prompt", _text())
    completion_field: str = _key("completion", _text())
    messages_field: str = _key("messages", _text())
    label_field: str = _key("label", _text())  # task.type classification: the label (name, id, list, number)
    train_on: str = _key("all", _choice("all", "completion"))
    # one input and one target at least; at most MAX_SEQ_LEN, and 8x the model's context (checked when it is loaded)
    seq_len: int = _key(512, _integer(2, MAX_SEQ_LEN))
    packing: bool = _key(True, _boolean)
    # each batch as one row of its real tokens (no padding computed); auto: on a CPU for causal-LM training (no
    # fixed shapes to keep there, so padding is only work) unless the documents are too small to attend one by
    # one (hidden size x mean example length under 8192, the quickstart's case)
    padding_free: str | bool = _key("auto", _choice("auto", True, False))
    add_eos: bool = _key(True, _boolean)
    on_error: str = _key("raise", _choice("raise", "skip"))
    shuffle: bool = _key(True, _boolean)
    query: str | None = _key(None, _text(nullable=True))  # a SQLite train/validation file: the SELECT giving its rows

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.query is not None:
            from entrenar.data.sqlite import check_query, is_sqlite

            try:
                check_query(self.query)
            except ConfigError as e:
                raise _BadValue("data.query", str(e).replace("data.query", "'data.query'", 1)) from None
            if not any(f is not None and is_sqlite(f) for f in (self.train, self.validation)):
                raise _BadValue("data.query", f"'data.query' reads a SQLite file (.db, .sqlite, .sqlite3), and "
                                              f"data.train is {_show(self.train)}")


@dataclass(frozen=True)
class LoraSection(_Section):
    """Low-rank adapters; the recipe's ``lora: null`` means full fine-tuning instead."""

    section: ClassVar[str] = "lora"
    r: int = _key(8, _integer(1))
    alpha: float = _key(16.0, _number(0.0, low_open=True))
    dropout: float = _key(0.0, _number(0.0, 1.0, high_open=True))
    target_modules: str | tuple[str, ...] = _key(("q_proj", "k_proj", "v_proj", "o_proj"), _modules)
    target_parameters: tuple[str, ...] | None = _key(None, _parameter_names)  # MoE experts, e.g. [mlp.experts.gate_up_proj]
    use_rslora: bool = _key(False, _boolean)
    quantize_base: str | None = _key(None, _choice(None, "nf4"))


@dataclass(frozen=True)
class QatSection(_Section):
    """Quantization-aware training (fake-quantized linear layers); ``qat: null`` (the default) is off.
    With ``lora`` set too it is LoRA-QAT: a frozen fake-quantized base under full-precision adapters."""

    section: ClassVar[str] = "qat"
    bits: int = _key(4, _integer(2, 8))
    granularity: str = _key("channel", _choice("tensor", "channel", "group"))
    group_size: int = _key(128, _integer(1))
    backward: str = _key("ste", _choice("ste", "clipped_ste", "lsq", "ewgs"))
    activations: bool | int = _key(False, _activation_bits)


@dataclass(frozen=True)
class MoeSection(_Section):
    """Router losses, balancing and diagnostics of mixture-of-experts models (ignored by dense models when left
    at the defaults)."""

    section: ClassVar[str] = "moe"
    aux_loss: float = _key(0.0, _number(0.0))  # weight of the Switch load-balancing loss (0: off)
    z_loss: float = _key(0.0, _number(0.0))  # weight of the ST-MoE router z-loss (0: off)
    bias_update_rate: float = _key(0.0, _number(0.0))  # aux-loss-free balancing: per-expert bias step (0: off)
    router_lr_scale: float = _key(1.0, _number(0.0, low_open=True))  # router learning rate multiplier
    freeze_router: bool = _key(False, _boolean)  # full fine-tuning: keep the router weights as loaded
    experts: str = _key("auto", _choice("auto", "loop", "grouped"))  # auto: one grouped product on CUDA
    dead_after: int = _key(100, _integer(1))  # an expert with no tokens for this many steps counts as dead
    collapse_entropy: float = _key(0.3, _number(0.0, 1.0))  # warn when a layer's normalised entropy falls below
    collapse_share: float = _key(0.5, _number(0.0, 1.0))  # warn when one expert takes more than this share


@dataclass(frozen=True)
class OptimizerSection(_Section):
    """The optimizer and its per-group learning-rate scales."""

    section: ClassVar[str] = "optimizer"
    name: str = _key("adamw", _choice("adamw", "sgd"))
    lr: float = _key(2e-4, _number(0.0, low_open=True))
    weight_decay: float = _key(0.0, _number(0.0))
    betas: tuple[float, float] = _key((0.9, 0.999), _betas)
    eps: float = _key(1e-8, _number(0.0, low_open=True))
    momentum: float = _key(0.9, _number(0.0, 1.0, high_open=True))
    fused: str | bool = _key("auto", _choice("auto", True, False))
    lr_scale: dict[str, float] = _key({}, _lr_scales)


@dataclass(frozen=True)
class ScheduleSection(_Section):
    """The learning-rate schedule: linear warmup, then the named shape."""

    section: ClassVar[str] = "schedule"
    name: str = _key("cosine", _choice("cosine", "linear", "constant"))
    warmup_steps: int = _key(0, _integer(0))
    min_lr_ratio: float = _key(0.1, _number(0.0, 1.0))


@dataclass(frozen=True)
class TrainingSection(_Section):
    """Step counts, batch shape, precision, and how often to log, evaluate and save."""

    section: ClassVar[str] = "training"
    max_steps: int = _key(1000, _integer(1))
    batch_size: int = _key(4, _integer(1))
    grad_accum: int = _key(1, _integer(1))
    max_grad_norm: float = _key(1.0, _number(0.0))
    precision: str = _key("fp32", _choice("fp32", "bf16", "fp16"))
    activation_checkpointing: bool | int | tuple[int, ...] = _key(False, _checkpoint_layers)
    # what layers keep for backward waits in pinned CPU memory (a checkpointed layer: its input) (CUDA): every
    # layer but the last (true), or the first N
    offload_activations: bool | int = _key(False, _offload_layers)
    # the frozen input-embedding table stays in pinned CPU memory, read by the GPU (LoRA/QLoRA on CUDA); auto: on
    # for a causal-LM LoRA/QLoRA run on one CUDA device with every layer checkpointed and untied embeddings
    offload_embeddings: str | bool = _key("auto", _choice("auto", True, False))
    # QLoRA: the blocks' NF4 base weights stay in pinned CPU memory, each block's copied to the GPU as it runs
    # (one CUDA device, quantize_base: nf4); auto: on when every layer is checkpointed, without compile
    offload_weights: str | bool = _key("auto", _choice("auto", True, False))
    compile: bool = _key(False, _boolean)
    # forward and backward of each micro-batch replayed from a CUDA graph (fixed shapes; not padding-free);
    # auto: on a single CUDA device for LoRA/QLoRA on packed causal-LM batches of a dense model (or an MoE one
    # whose experts run grouped in bf16), without compile or fp16
    cuda_graphs: str | bool = _key("auto", _choice("auto", True, False))
    # read each step's loss and norm while the GPU runs the next step's forward and backward (a non-finite
    # update is dropped on the device); auto: on one CUDA device with a fused optimizer and no fp16 scaler
    overlap_steps: str | bool = _key("auto", _choice("auto", True, False))
    kernels: str | bool = _key("auto", _choice("auto", True, False))  # auto: on CUDA when Triton imports, and on a CPU (PyTorch paths)
    # LoRA adapter products in the fused layer: fp32 as PEFT runs them, or bf16 on the tensor cores (the adapter
    # weights and the optimizer stay fp32)
    adapter_math: str = _key("fp32", _choice("fp32", "bf16"))
    seed: int = _key(0, _integer(0, 2**32 - 1))  # numpy's seed range
    # the same bits on every rerun and resume on a GPU too: PyTorch's deterministic algorithms (an op without one
    # is refused, naming it) and a fixed cuBLAS workspace; a CPU run is deterministic either way
    deterministic: bool = _key(False, _boolean)
    eval_every: int = _key(0, _integer(0))
    eval_batches: int | None = _key(None, _integer(1, nullable=True))
    log_every: int = _key(10, _integer(1))
    save_every: int = _key(0, _integer(0))
    keep_last: int = _key(3, _integer(1))
    cpu_threads: int | None = _key(None, _integer(1, nullable=True))  # None: torch's default
    # a step whose loss or gradient norm is NaN/inf: stop the run, or skip its update (at most max_skipped_steps in a row)
    nonfinite: str = _key("stop", _choice("stop", "skip"))
    max_skipped_steps: int = _key(5, _integer(1))
    early_stopping: dict[str, Any] | None = _key(None, _early_stopping)  # None: off
    # many processes (entrenar train --nproc-per-node N): ddp, fsdp, or auto (ddp when a replica fits one device)
    parallel: str = _key("auto", _choice("auto", "ddp", "fsdp"))
    # rows per optimizer step over all processes; None: batch_size x grad_accum x processes (accumulation derived)
    global_batch_size: int | None = _key(None, _integer(1, nullable=True))
    dist_timeout_s: float = _key(300.0, _number(1.0))  # a collective waits this long for a dead or hung rank
    replica_check_every: int = _key(50, _integer(0))  # steps between replica checks (and at the end); 0: never


@dataclass(frozen=True)
class OutputSection(_Section):
    """Where the run writes checkpoints, metrics and its resolved recipe."""

    section: ClassVar[str] = "output"
    name: str = _key("run", _text())
    dir: str | None = _key(None, _text(nullable=True))  # None: runs/<name>
    tensorboard: bool = _key(False, _boolean)  # also write TensorBoard event files (the `tensorboard` extra)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dir is None:
            object.__setattr__(self, "dir", f"runs/{self.name}")


def _labels(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, int)) and not isinstance(v, bool)
                                                          for v in value):
        names = tuple(str(v) for v in value)
        if len(set(names)) == len(names):
            return names
        raise _Reject("a list of distinct label names", " (a name is repeated)")
    raise _Reject("a non-empty list of label names or null")


def _class_weights(value: Any) -> str | tuple[float, ...]:
    if isinstance(value, str) and value in ("none", "inverse_freq", "sqrt_inverse", "auto"):
        return value
    if isinstance(value, (list, tuple)) and value and all(_as_number(v) is not None and _as_number(v) >= 0 for v in value):
        return tuple(float(v) for v in value)
    raise _Reject("none, inverse_freq, sqrt_inverse, auto or a list of non-negative weights")


def _threshold(value: Any) -> str | float | tuple[float, ...]:
    if value == "tune":
        return value
    number = _as_number(value)
    if number is not None and 0.0 < number < 1.0:
        return number
    if isinstance(value, (list, tuple)) and value and all(
            (n := _as_number(v)) is not None and 0.0 < n < 1.0 for v in value):
        return tuple(float(v) for v in value)
    raise _Reject("'tune', a probability in (0, 1), or a list of them (one per label)")


@dataclass(frozen=True)
class TaskSection(_Section):
    """What the run learns: next tokens (causal_lm) or a label per text (classification, entrenar.tasks)."""

    section: ClassVar[str] = "task"
    type: str = _key("causal_lm", _choice("causal_lm", "classification"))
    problem_type: str = _key("single_label", _choice("single_label", "multi_label", "regression"))
    labels: tuple[str, ...] | None = _key(None, _labels)  # names in class-id order; null: num_labels or from the data
    num_labels: int | None = _key(None, _integer(1, nullable=True))
    pooling: str = _key("last", _choice("last", "mean"))
    class_weights: str | tuple[float, ...] = _key("none", _class_weights)
    label_smoothing: float = _key(0.0, _number(0.0, 1.0, high_open=True))
    threshold: str | float | tuple[float, ...] = _key("tune", _threshold)  # multi_label decision threshold(s)
    metric: str | None = _key(None, _text(nullable=True))  # best checkpoint; null: macro_f1 (rmse for regression)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.labels is not None and self.num_labels is not None and self.num_labels != len(self.labels):
            raise _BadValue("task.num_labels", f"'task.num_labels' is {self.num_labels} but 'task.labels' names "
                                               f"{len(self.labels)}")


_SECTIONS: dict[str, type[_Section]] = {
    cls.section: cls
    for cls in (
        ModelSection,
        DataSection,
        LoraSection,
        QatSection,
        OptimizerSection,
        ScheduleSection,
        TrainingSection,
        OutputSection,
        TaskSection,
        MoeSection,
    )
}


@dataclass(frozen=True)
class Recipe:
    """A whole run. ``lora=None`` means full fine-tuning; ``qat=None`` no quantization-aware training."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    lora: LoraSection | None = None
    qat: QatSection | None = None
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    output: OutputSection = field(default_factory=OutputSection)
    task: TaskSection = field(default_factory=TaskSection)
    moe: MoeSection = field(default_factory=MoeSection)

    def __post_init__(self) -> None:
        # The few checks that span sections. model.path and data.train both null is the bundled quickstart.
        if self.model.path is None and self.model.init != "random" and (
                self.data.train is not None or self.data.validation is not None):
            given = "data.train" if self.data.train is not None else "data.validation"
            raise _BadValue(  # reported where the data was named
                given,
                f"'model.path' is required (a model folder or .gguf file) when '{given}' is set; only a recipe "
                "with neither model.path nor data runs the bundled quickstart",
            )
        if (self.model.path is not None or self.model.init == "random") and self.data.train is None:
            raise _BadValue(
                "data.train",
                "'data.train' is required (a data file or folder) when model.path is set"
                + (" or model.init is random" if self.model.init == "random" else ""),
            )
        if self.model.init == "random" and self.task.type != "causal_lm":
            raise _BadValue("model.init", f"'model.init' random builds a language model; task.type "
                                          f"{self.task.type} needs a pretrained model.path")
        if self.data.validation is not None and self.data.validation_split > 0:
            raise _BadValue(
                "data.validation_split",
                f"'data.validation_split' must be 0 when 'data.validation' names a file, "
                f"got {self.data.validation_split:g}",
            )
        if self.qat is not None and self.lora is not None and self.lora.quantize_base is not None:
            raise _BadValue(
                "lora.quantize_base",
                f"'lora.quantize_base' must be null when 'qat' is set, got {_show(self.lora.quantize_base)} "
                "(QAT fake-quantizes full-precision weights; LoRA-QAT is 'qat' with a plain 'lora' section)",
            )
        if self.model.device == "cpu":  # settings that only mean something on a GPU, asked for explicitly
            for key, what in (("offload_activations", "moves activations from GPU to CPU memory"),
                              ("offload_embeddings", "moves the embedding table from GPU to CPU memory"),
                              ("offload_weights", "moves the NF4 base weights from GPU to CPU memory"),
                              ("cuda_graphs", "replays GPU launches")):
                if getattr(self.training, key) not in (False, 0, "auto"):  # true, or a layer count
                    raise _BadValue(f"training.{key}", f"'training.{key}' {what}; model.device is 'cpu'")
        if self.training.offload_embeddings is True and self.lora is None:
            raise _BadValue(
                "training.offload_embeddings",
                "'training.offload_embeddings' keeps a frozen embedding table in CPU memory, and full fine-tuning "
                "trains it (add a 'lora' section, or turn it off)",
            )
        if self.training.offload_weights is True and (self.lora is None or self.lora.quantize_base != "nf4"):
            raise _BadValue(
                "training.offload_weights",
                "'training.offload_weights' streams NF4 base weights from CPU memory (QLoRA); this recipe has "
                "no NF4 base (set lora.quantize_base: nf4, or turn it off)",
            )
        if self.training.cuda_graphs is True and self.data.padding_free is True:
            raise _BadValue(
                "training.cuda_graphs",
                "'training.cuda_graphs' needs batches of one layout, and 'data.padding_free' changes it with every "
                "batch (turn one of them off)",
            )
        if self.training.precision == "fp16" and self.model.device == "cpu":
            raise _BadValue(
                "training.precision",
                "'training.precision' fp16 needs a CUDA device but model.device is 'cpu' "
                "(use bf16 or fp32 on CPU)",
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and scalars (YAML/JSON-ready), every key present."""
        out: dict[str, Any] = {}
        for f in fields(self):
            section = getattr(self, f.name)
            out[f.name] = None if section is None else {
                g.name: _plain(getattr(section, g.name)) for g in fields(section)
            }
        return out

    def to_yaml(self) -> str:
        """The full recipe as YAML, in section order."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>") -> Recipe:
        """Validate a dict shaped like a recipe file (missing keys take defaults).

        ``source`` names the origin in error messages.
        """
        return _build(d, _Where(source), default_name="run")


def load_recipe(path: str | Path | None, overrides: Iterable[str] = ()) -> Recipe:
    """Read a recipe file (``None``: the bundled quickstart) and apply ``--set`` overrides.

    Each override is ``dotted.key=value``; the value is parsed as YAML and checked
    like a value in the file. ``output.name`` defaults to the file's stem.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not one string")
    if path is None:
        text = importlib.resources.files("entrenar").joinpath(QUICKSTART).read_text(encoding="utf-8")
        source, stem = f"entrenar/{QUICKSTART}", "quickstart"
    else:
        path = Path(path)
        source, stem = str(path), path.stem
        if not path.exists():
            raise ConfigError(f"recipe file not found: {path}")
        if not path.is_file():
            raise ConfigError(f"recipe path is not a file: {path}")
        text = read_yaml_text(path, "recipe")
    raw, where = _parse(text, source)
    for item in overrides:
        _apply_override(raw, item, where)
    return _build(raw, where, default_name=stem)


def save_recipe(recipe: Recipe, path: str | Path) -> None:
    """Write the resolved recipe as YAML (atomically), so a resume can compare against it."""
    from entrenar.io import atomic

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Resolved recipe: every default and --set override applied. Written by entrenar.\n"
    atomic.write_text(path, header + recipe.to_yaml())


def recipe_changes(old: Recipe, new: Recipe) -> list[str]:
    """Dotted keys whose values differ, as ``"key: old -> new"`` lines (empty if equal)."""
    a, b = _flatten(old.to_dict()), _flatten(new.to_dict())
    keys = dict.fromkeys([*a, *b])  # ordered union
    return [f"{k}: {_show(a.get(k))} -> {_show(b.get(k))}" for k in keys if a.get(k) != b.get(k)]


# --------------------------------------------------------------------------
# Parsing, locating and building


class _Where:
    """Maps a dotted key to where its value was written: a file line or a ``--set``."""

    def __init__(self, source: str, lines: dict[str, int] | None = None) -> None:
        self.source = source
        self._marks = {key: f"{source} line {line}" for key, line in (lines or {}).items()}

    def set_by(self, key: str, label: str) -> None:
        """``key`` (and all below it) now comes from an override labelled ``label``."""
        for old in [k for k in self._marks if k == key or k.startswith(key + ".")]:
            del self._marks[old]
        self._marks[key] = label

    def __call__(self, key: str) -> str:
        parts = key.split(".")
        for n in range(len(parts), 0, -1):  # a missing key is reported at its section
            mark = self._marks.get(".".join(parts[:n]))
            if mark is not None:
                return mark
        return self.source


_MAX_DEPTH = 32  # a recipe needs 4 levels (section, key, lr_scale pattern); PyYAML recurses once per level


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing nesting deeper than ``_MAX_DEPTH`` before its recursion can overflow."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self._depth >= _MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(None, None, f"nested more than {_MAX_DEPTH} levels deep", mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_yaml_text(path: Path, what: str = "file") -> str:
    """A YAML file's text; unreadable or non-UTF-8 bytes are a ConfigError naming the file (and line)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path} line {line}: not UTF-8 text (byte 0x{data[e.start]:02X})") from None


def load_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """YAML text -> (value, its node), with every problem (control characters, nesting, a scalar Python cannot
    build, any PyYAML error) a one-line ConfigError naming ``source``, line and column. Shared by recipes and
    merge configs."""
    try:
        return _load_yaml(text)
    except _YamlProblem as e:
        raise e.at(source) from None


class _YamlProblem(Exception):
    """What is wrong with a YAML text and where (1-based line and column, when known)."""

    def __init__(self, problem: str, line: int | None = None, column: int | None = None) -> None:
        super().__init__(problem)
        self.problem, self.line, self.column = problem, line, column

    def at(self, source: str) -> ConfigError:
        where = f" line {self.line}, column {self.column}" if self.line is not None else ""
        return ConfigError(f"{source}{where}: malformed YAML: {self.problem}")


def _load_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """YAML text -> (value, its node); any problem, PyYAML's or Python's, is a ``_YamlProblem``."""
    try:
        loader = _Loader(text)  # the reader refuses control characters here
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1
        column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        raise _YamlProblem(f"character U+{e.character:04X} is not allowed (YAML forbids control characters)",
                           line, column) from None
    try:
        node = loader.get_single_node()
        try:
            value = loader.construct_document(node) if node is not None else None
        except (ValueError, OverflowError, TypeError) as e:  # a scalar that fits its tag's pattern but not Python
            raise _scalar_problem(node, e) from None
    except yaml.MarkedYAMLError as e:
        raise _yaml_problem(e) from None
    except yaml.YAMLError as e:
        raise _YamlProblem(str(e)) from None
    except RecursionError:
        raise _YamlProblem("nested too deeply to read") from None
    finally:
        loader.dispose()
    return value, node


def _scalar_problem(root: yaml.Node, error: Exception) -> _YamlProblem:
    """The first scalar under ``root`` that cannot be built (an integer of thousands of digits, a date with
    month 13), found by building each scalar alone."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            try:
                yaml.SafeLoader("").construct_object(node)
            except (ValueError, OverflowError, TypeError, yaml.YAMLError) as e:
                mark = node.start_mark
                if "integer string conversion" in str(e):  # Python's guard against quadratic int parsing
                    problem = f"an integer of {len(node.value):,} digits is too long (at most {sys.get_int_max_str_digits()})"
                else:
                    problem = f"cannot read {_show(node.value)} as {node.tag.rsplit(':', 1)[-1]}: {str(e)[:200]}"
                return _YamlProblem(problem, mark.line + 1, mark.column + 1)
        elif isinstance(node, yaml.MappingNode):
            stack.extend(n for pair in reversed(node.value) for n in reversed(pair))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed(node.value))
    return _YamlProblem(str(error)[:200])


def _parse(text: str, source: str) -> tuple[dict[str, Any], _Where]:
    """YAML text -> (top-level dict, line of every key)."""
    try:
        raw, node = _load_yaml(text)
    except _YamlProblem as e:
        raise e.at(source) from None
    if raw is None:
        raise ConfigError(f"{source}: the recipe is empty (expected sections: {', '.join(_SECTIONS)})")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{source} line {node.start_mark.line + 1}: the top level must be a mapping of sections "
            f"({', '.join(_SECTIONS)}), got {_show(raw)}"
        )
    lines: dict[str, int] = {}
    _key_lines(node, source, "", lines, depth=3)  # section.key.lr_scale-pattern at most
    return raw, _Where(source, lines)


def _yaml_problem(e: yaml.MarkedYAMLError) -> _YamlProblem:
    """PyYAML's error as a ``_YamlProblem``: its 0-based marks made 1-based, its texts joined."""

    def at(mark: yaml.Mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    text = e.problem or "cannot parse"
    if e.context:
        started = ""
        if e.context_mark and e.problem_mark and e.context_mark.line != e.problem_mark.line:
            started = f" (started at {at(e.context_mark)})"
        text = f"{e.context}{started}: {text}"
    mark = e.problem_mark
    return _YamlProblem(text, mark.line + 1, mark.column + 1) if mark else _YamlProblem(text)


def _key_lines(node: yaml.Node, source: str, prefix: str, lines: dict[str, int], depth: int) -> None:
    """Record the 1-based line of every mapping key; reject duplicate keys (YAML keeps the last)."""
    if depth == 0 or not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key, line = prefix + key_node.value, key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"{source} line {line}: duplicate key '{key}' (first at line {seen[key]})")
        seen[key] = lines[key] = line
        _key_lines(value_node, source, key + ".", lines, depth - 1)


def _apply_override(raw: dict[str, Any], item: str, where: _Where) -> None:
    """Apply one ``dotted.key=value`` to the raw recipe dict; the value replaces what was there."""
    label = f"--set {_printable(item)}"
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"{label}: expected KEY=VALUE, e.g. optimizer.lr=1e-4")
    try:
        value, _ = _load_yaml(text)
    except _YamlProblem as e:
        column = f" (column {e.column})" if e.column is not None else ""
        raise ConfigError(f"{label}: the value is not valid YAML{column}: {e.problem}") from None
    parts = key.split(".")
    if parts[0] not in _SECTIONS:
        raise _unknown(label, parts[0], parts[0], list(_SECTIONS))
    if len(parts) == 1:
        raw[key] = value
    else:
        allowed = [f.name for f in fields(_SECTIONS[parts[0]])]
        if parts[1] not in allowed:
            raise _unknown(label, ".".join(parts[:2]), parts[1], allowed)
        model = raw.get("model")
        if len(parts) == 3 and parts[:2] == ["model", "config"] and isinstance(model, dict) \
                and isinstance(model.get("config"), dict):  # one key of model.config (a size, say)
            model["config"] = {**model["config"], parts[2]: value}
            where.set_by(key, label)
            return
        if len(parts) > 2:
            raise ConfigError(
                f"{label}: unknown key '{key}' ('{'.'.join(parts[:2])}' is set as a whole, "
                f"e.g. --set '{'.'.join(parts[:2])}={{...}}')"
            )
        if raw.get(parts[0]) is None:  # absent, or `lora: null` that this override turns on
            raw[parts[0]] = {}
        if isinstance(raw[parts[0]], dict):  # otherwise the file's own error is reported
            raw[parts[0]][parts[1]] = value
    where.set_by(key, label)


def _build(raw: Any, where: _Where, default_name: str) -> Recipe:
    """Raw recipe dict -> Recipe; every error names where its key was written."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where.source}: a recipe must be a mapping of sections, got {_show(raw)}")
    for name in raw:
        if name not in _SECTIONS:
            raise _unknown(where(str(name)), str(name), name, list(_SECTIONS))
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        value = raw.get(name)
        if name in ("lora", "qat") and value is None:
            sections[name] = None
            continue
        if name == "output" and value is None:
            value = {}
        if name == "output" and isinstance(value, dict) and value.get("name") is None:
            value = {**value, "name": default_name}
        sections[name] = _build_section(cls, value, where)
    try:
        return Recipe(**sections)
    except _BadValue as e:
        raise ConfigError(f"{where(e.key)}: {e}") from None


def _build_section(cls: type[_Section], value: Any, where: _Where) -> _Section:
    """One raw section (a dict, or None for all defaults) -> its dataclass."""
    name = cls.section
    allowed = [f.name for f in fields(cls)]
    if value is None:  # an empty section header: all defaults
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(
            f"{where(name)}: '{name}' must be a mapping of keys ({', '.join(allowed)}), got {_show(value)}"
        )
    for key in value:
        if key not in allowed:
            dotted = f"{name}.{key}"
            raise _unknown(where(dotted), dotted, key, allowed)
    try:
        return cls(**value)
    except _BadValue as e:
        raise ConfigError(f"{where(e.key)}: {e}") from None

# Keys a resumed run may change: how long it runs, how often it reports, when it stops on faults or early, and
# how it runs (not what it computes).
RESUMABLE_KEYS = ("training.max_steps", "training.eval_every", "training.log_every", "training.save_every",
                  "training.keep_last", "training.eval_batches", "training.cpu_threads", "training.kernels",
                  "training.compile", "training.nonfinite", "training.max_skipped_steps",
                  "training.early_stopping", "training.parallel", "training.global_batch_size",
                  "training.dist_timeout_s", "training.replica_check_every",
                  "training.cuda_graphs", "training.overlap_steps", "training.deterministic",
                  "training.offload_embeddings", "training.offload_weights", "data.padding_free")
