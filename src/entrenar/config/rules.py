"""The rules a recipe's values must pass, and the helpers that word what went wrong.

A rule takes a raw value (as YAML or Python gave it) and returns it normalized (``1e-4`` read as a string by
YAML 1.1 becomes a float, a list becomes a tuple), or raises :class:`Reject` saying what it allows; the section
that owns the key turns that into an error naming the key and the value.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from typing import Any

import yaml

from entrenar.errors import ConfigError

# data.format: the record formats of entrenar.data.formats, and the file formats that force a reader. Spelled here
# too, since importing entrenar.data would load torch for `entrenar --help` (tests/data/test_data_formats.py checks
# they agree).
DATA_FORMATS = ("auto", "alpaca", "sharegpt", "messages", "prompt_completion", "text", "jsonl", "json", "csv",
                "parquet")


PREFERENCE_LOSSES = ("dpo", "ipo", "simpo", "orpo", "kto")  # task.loss (entrenar.tasks.preference.losses)

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


class Reject(Exception):
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
        if isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high):
            return value
        raise Reject(expected)

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
            raise Reject(expected)
        if low is not None and (number <= low if low_open else number < low):
            raise Reject(expected)
        if high is not None and (number >= high if high_open else number > high):
            raise Reject(expected)
        return number

    return rule


def _seconds_or_null(value: Any) -> float | None:
    """A duration of at least one second, or null (off)."""
    if value is None:
        return None
    number = _as_number(value)
    if number is None or number < 1:
        raise Reject("a number of seconds >= 1, or null (off)")
    return number


def _choice(*options: str | bool | None) -> Rule:
    expected = "one of: " + ", ".join(_plain_text(o) for o in options)

    def rule(value: Any) -> str | bool | None:
        for option in options:
            if type(value) is type(option) and value == option:  # True must not match 1
                return option
        close = _closest(value, [o for o in options if isinstance(o, str)])
        raise Reject(expected, f" (did you mean '{close}'?)" if close else "")

    return rule


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise Reject("true or false")


def _text(*, nullable: bool = False) -> Rule:
    expected = "a non-empty string" + (" or null" if nullable else "")

    def rule(value: Any) -> str | None:
        if value is None and nullable:
            return None
        if isinstance(value, str) and value.strip():
            return value
        raise Reject(expected)

    return rule


# cuda is NVIDIA's CUDA and AMD's ROCm alike (PyTorch names both so); xpu: Intel GPUs; mps: Apple's Metal.
_DEVICE = re.compile(r"auto|cpu|mps|(cuda|xpu)(:\d+)?")
DEVICE_NAMES = "auto, cpu, cuda, cuda:N, xpu, xpu:N, mps"


def is_device_name(value: Any) -> bool:
    """True for the device names a recipe's model.device and the CLI's --device accept."""
    return isinstance(value, str) and _DEVICE.fullmatch(value) is not None


def _device(value: Any) -> str:
    if is_device_name(value):
        return value
    raise Reject(f"one of: {DEVICE_NAMES}")


_SCHEMA = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _attach(value: Any) -> dict[str, str] | None:
    """data.attach: null, or ``{schema: FILE}`` of SQLite files attached read-only beside data.train's."""
    expected = "null or a mapping {schema name: SQLite file} (e.g. {outcomes: outcomes.db})"
    if value is None:
        return None
    if not isinstance(value, dict) or not value:
        raise Reject(expected)
    for name, path in value.items():
        if not isinstance(name, str) or not _SCHEMA.fullmatch(name) or name.lower() in ("main", "temp"):
            raise Reject(expected, f" (schema name {_show(name)} must be an SQL identifier other than main and temp)")
        if not isinstance(path, str) or not path.strip():
            raise Reject(expected, f" ({name} must name a file, got {_show(path)})")
    return dict(value)


def _modules(value: Any) -> str | tuple[str, ...]:
    expected = "'all-linear' or a non-empty list of module names"
    if value == "all-linear":
        return value
    if isinstance(value, str):
        raise Reject(expected, f" (write [{value}] for a single module)")
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise Reject(expected)


def _optional_number(low: float, *, low_open: bool = False) -> Rule:
    """null, or a number that :func:`_number` accepts."""
    number = _number(low, low_open=low_open)

    def rule(value: Any) -> float | None:
        if value is None:
            return None
        try:
            return number(value)
        except Reject as r:
            raise Reject(f"null or {r.expected}") from None

    return rule


def _qat_modules(value: Any) -> str | tuple[str, ...]:
    """qat.target_modules: what ``lora.target_modules`` takes, or ``lora`` (the layers LoRA adapts)."""
    if value == "lora":
        return value
    try:
        return _modules(value)
    except Reject as r:
        raise Reject("'all-linear', 'lora' or a non-empty list of module names", r.hint) from None


def _parameter_names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise Reject("null or a non-empty list of parameter names", " (e.g. [mlp.experts.gate_up_proj])")


def _betas(value: Any) -> tuple[float, float]:
    expected = "a list of two numbers in [0, 1)"
    if isinstance(value, (list, tuple)) and len(value) == 2:
        first, second = (_as_number(v) for v in value)
        if first is not None and second is not None and 0.0 <= first < 1.0 and 0.0 <= second < 1.0:
            return (first, second)
    raise Reject(expected)


def _lr_scales(value: Any) -> dict[str, float]:
    expected = "a mapping of module-name regex to a number > 0"
    if not isinstance(value, dict):
        raise Reject(expected)
    scales = {}
    for pattern, scale in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise Reject(expected)
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as e:  # sre's parser recurses per nested group
            raise Reject(expected, f" ({_show(pattern)} is not a valid regex: {e})") from None
        number = _as_number(scale)
        if number is None or number <= 0:
            raise Reject(expected, f" (scale of '{pattern}' is {_show(scale)})")
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
    raise Reject("true, false or a bit width in [2, 8]")


def _checkpoint_layers(value: Any) -> bool | int | tuple[int, ...]:
    """Activation checkpointing: true (every layer), false, a number of layers (spread evenly), or layer indices."""
    expected = "true, false, a number of layers, or a list of layer indices"
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                for v in value):
        if len(set(value)) == len(value):
            return tuple(value)
        raise Reject(expected, " (each index once)")
    raise Reject(expected)


def _offload_layers(value: Any) -> bool | int:
    """Activation offload: true (every layer but the last), false, or a number of layers (the first ones)."""
    if isinstance(value, bool) or (isinstance(value, int) and value >= 0):
        return value
    raise Reject("true, false, or a number of layers (the first ones)")


# Metrics where larger is better; any other metric (eval_loss, eval_ppl, ...) is minimised unless `mode` says so.
_MAXIMISED_METRICS = ("accuracy", "acc", "f1", "macro_f1", "micro_f1", "weighted_f1", "precision", "recall", "auc",
                      "exact_match", "mcc", "kappa", "r2", "spearman", "subset_accuracy", "top2_accuracy",
                      "top3_accuracy", "top5_accuracy", "reward")


def _early_stopping(value: Any) -> dict[str, Any] | None:
    """Early stopping: null (off) or {metric, patience, min_delta, mode}; mode defaults from the metric's name."""
    expected = "null or a mapping {metric, patience, min_delta, mode}"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Reject(expected)
    unknown = [k for k in value if k not in ("metric", "patience", "min_delta", "mode")]
    if unknown:
        raise Reject(expected, f" (unknown key {_show(unknown[0])})")
    metric = value.get("metric", "eval_loss")
    if not isinstance(metric, str) or not metric.strip():
        raise Reject(expected, " (metric must be a name such as eval_loss)")
    patience = value.get("patience", 3)
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
        raise Reject(expected, f" (patience must be an integer > 0, got {_show(patience)})")
    min_delta = _as_number(value.get("min_delta", 0.0))
    if min_delta is None or min_delta < 0:
        raise Reject(expected, f" (min_delta must be a number >= 0, got {_show(value.get('min_delta'))})")
    name = metric.removeprefix("eval_")
    mode = value.get("mode", "max" if name in _MAXIMISED_METRICS else "min")
    if mode not in ("min", "max"):
        raise Reject(expected, f" (mode must be min or max, got {_show(mode)})")
    return {"metric": metric, "patience": patience, "min_delta": min_delta, "mode": mode}


def _model_config(value: Any) -> dict[str, Any] | None:
    """model.config: null, or a mapping of config.json keys (checked key by key when the model is built)."""
    if value is None:
        return None
    if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
        return dict(value)
    raise Reject("null or a non-empty mapping of config.json keys", " (e.g. {model_type: llama, hidden_size: 64})")


def _labels(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (str, int)) and not isinstance(v, bool)
                                                          for v in value):
        names = tuple(str(v) for v in value)
        if len(set(names)) == len(names):
            return names
        raise Reject("a list of distinct label names", " (a name is repeated)")
    raise Reject("a non-empty list of label names or null")


def _class_weights(value: Any) -> str | tuple[float, ...]:
    if isinstance(value, str) and value in ("none", "inverse_freq", "sqrt_inverse", "auto"):
        return value
    if isinstance(value, (list, tuple)) and value and all(
            (number := _as_number(v)) is not None and number >= 0 for v in value):
        return tuple(float(v) for v in value)
    raise Reject("none, inverse_freq, sqrt_inverse, auto or a list of non-negative weights")


def _threshold(value: Any) -> str | float | tuple[float, ...]:
    if value == "tune":
        return value
    number = _as_number(value)
    if number is not None and 0.0 < number < 1.0:
        return number
    if isinstance(value, (list, tuple)) and value and all(
            (n := _as_number(v)) is not None and 0.0 < n < 1.0 for v in value):
        return tuple(float(v) for v in value)
    raise Reject("'tune', a probability in (0, 1), or a list of them (one per label)")


def _train_files(value: Any) -> str | tuple[dict[str, Any], ...] | None:
    """data.train: one file or folder, or a list of them to mix, each a path or ``{path, weight, format}`` (weight:
    how many times its examples come in an epoch, default 1; format: its data.format, default the section's)."""
    expected = "a file or folder, or a non-empty list of them (paths or {path, weight, format} mappings)"
    if value is None:
        return None
    if isinstance(value, str) and value.strip():
        return value
    if not isinstance(value, (list, tuple)) or not value:
        raise Reject(expected)
    files = []
    for item in value:
        if isinstance(item, str) and item.strip():
            item = {"path": item}
        if not isinstance(item, dict):
            raise Reject(expected, f" ({_show(item)} is neither)")
        unknown = [k for k in item if k not in ("path", "weight", "format")]
        if unknown:
            raise Reject(expected, f" (unknown key {_show(unknown[0])}; an entry has path, weight, format)")
        path = item.get("path")
        if not isinstance(path, str) or not path.strip():
            raise Reject(expected, f" (an entry without a path: {_show(item)})")
        weight = _as_number(item.get("weight", 1.0))
        if weight is None or weight <= 0:
            raise Reject(expected, f" (the weight of {path} must be a number > 0, got {_show(item.get('weight'))})")
        format = item.get("format")
        if format is not None and format not in DATA_FORMATS:
            close = _closest(format, list(DATA_FORMATS))
            raise Reject(expected, f" (the format of {path} must be one of {', '.join(DATA_FORMATS)}, got "
                                   f"{_show(format)}{f'; did you mean {close!r}?' if close else ''})")
        files.append({"path": path, "weight": weight, "format": format})
    return tuple(files)


def _epochs(value: Any) -> float | None:
    """training.epochs: null (the run's length is training.max_steps) or a number of passes > 0 (1.5 is allowed)."""
    if value is None:
        return None
    number = _as_number(value)
    if number is None or number <= 0:
        raise Reject("a number > 0 or null")
    return number


def _tracker(what: str, keys: tuple[str, ...], choices: dict[str, tuple[str, ...]] | None = None) -> Rule:
    """An experiment tracker (output.mlflow, output.wandb): false or null (off), true (the tracker's defaults), a
    string (the first key: a tracking URI, a project) or a mapping of ``keys``, each a non-empty string or null.
    Normalized to None or a mapping with every key."""
    expected = f"false, true, {what}, or a mapping {{{', '.join(keys)}}}"
    choices = choices or {}

    def rule(value: Any) -> dict[str, str | None] | None:
        if value is None or value is False:
            return None
        if value is True:
            value = {}
        elif isinstance(value, str) and value.strip():
            value = {keys[0]: value}
        if not isinstance(value, dict):
            raise Reject(expected)
        for key in value:
            if key not in keys:
                close = _closest(key, list(keys))
                hint = f"; did you mean '{close}'?" if close else ""
                raise Reject(expected, f" (unknown key {_show(key)}{hint})")
        for key, setting in value.items():
            if setting is not None and not (isinstance(setting, str) and setting.strip()):
                raise Reject(expected, f" ({key} must be a non-empty string or null, got {_show(setting)})")
            if setting is not None and key in choices and setting not in choices[key]:
                raise Reject(expected, f" ({key} must be one of: {', '.join(choices[key])}, got {_show(setting)})")
        return {key: value.get(key) for key in keys}

    return rule


_mlflow = _tracker("a tracking URI or folder", ("tracking_uri", "experiment", "run_name"))
_wandb = _tracker("a project name", ("project", "entity", "run_name", "mode", "dir"),
                  {"mode": ("online", "offline")})
