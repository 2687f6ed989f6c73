"""``--set dotted.key=value`` overrides: each value read as YAML and put into the raw recipe before it is
checked, so an override is refused exactly as the same value in the file would be, naming the ``--set``."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from entrenar.config.rules import _printable, _unknown
from entrenar.config.sections import _SECTIONS
from entrenar.config.yaml_source import Where, _load_yaml, _YamlProblem
from entrenar.errors import ConfigError


def apply_override(raw: dict[str, Any], item: str, where: Where) -> None:
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
