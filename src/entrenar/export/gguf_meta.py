"""The ``general.*`` metadata of an exported GGUF: what describes the model, carried over from its input.

A GGUF input's keys that describe the model (license, organization, base
name, size label, languages, tags...) are copied as stored; keys that describe
a file (architecture, file type, quantization version, alignment) are not, the
writer sets those. A Hugging Face folder gives its license and languages from
the README's front matter and its name from ``config.json``'s
``_name_or_path``. ``general.name`` is the base model's name, plus the
adapter's or run's name when one was merged in ("SmolLM2 135M Instruct +
my-run"), never the output folder's name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

# general.* keys that describe the file, not the model: the writer sets them.
_FILE_KEYS = ("general.architecture", "general.type", "general.file_type", "general.quantization_version",
              "general.alignment", "general.name", "general.quantized_by")  # fmt: skip
# Folder names inside a run that say nothing about it.
_GENERIC = {"adapter", "best", "model", "checkpoints", "final"}


@dataclass
class GeneralMetadata:
    """``general.name`` and the other model-describing ``general.*`` keys (value, gguf value type or None)."""

    name: str | None
    keys: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def _gguf_general(path: Path) -> tuple[str | None, dict[str, tuple[Any, Any]]]:
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    keys: dict[str, tuple[Any, Any]] = {}
    name = None
    for key, f in reader.fields.items():
        if not key.startswith("general."):
            continue
        if key == "general.name":
            name = str(f.contents())
        if key in _FILE_KEYS:
            continue
        kind = f.types[0]
        sub = f.types[-1] if kind == GGUFValueType.ARRAY else None
        keys[key] = (f.contents(), (kind, sub))
    return name, keys


def _front_matter(readme: Path) -> dict[str, Any]:
    """The YAML front matter of a model card, or {} if there is none (or it is not a mapping)."""
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    try:
        meta = yaml.safe_load(text[3:end]) if end > 0 else None
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def _hf_general(folder: Path) -> tuple[str | None, dict[str, tuple[Any, Any]]]:
    keys: dict[str, tuple[Any, Any]] = {}
    name = None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    source = config.get("_name_or_path") if isinstance(config, dict) else None
    if isinstance(source, str) and source.strip():
        org, _, base = source.strip().rstrip("/").rpartition("/")
        name = base
        if org and "/" not in org and not Path(source).is_absolute():
            keys["general.organization"] = (org, None)
    card = _front_matter(folder / "README.md")
    if isinstance(card.get("license"), str):
        keys["general.license"] = (card["license"], None)
    languages = card.get("language")
    if isinstance(languages, str):
        languages = [languages]
    if isinstance(languages, list) and all(isinstance(x, str) for x in languages) and languages:
        keys["general.languages"] = (languages, None)
    return name, keys


def _label(path: Path | None, run_dir: Path | None) -> str | None:
    """A human name for an adapter or run: the run's folder, else the adapter folder (its parent if generic)."""
    if run_dir is not None:
        return run_dir.name
    if path is None:
        return None
    for part in (path, path.parent):  # runs/NAME/adapter -> NAME
        if part.name and part.name not in _GENERIC and not part.name.startswith("step-"):
            return part.name
    return None


def describe(base: Path, adapter: Path | None = None, run_dir: Path | None = None) -> GeneralMetadata:
    """The ``general.*`` metadata for a model exported from ``base`` with ``adapter`` (or a run) merged in."""
    if base.suffix == ".gguf" and base.is_file():
        name, keys = _gguf_general(base)
    elif base.is_dir():
        name, keys = _hf_general(base)
    else:
        name, keys = None, {}
    name = name or base.stem or None
    label = _label(adapter, run_dir) if adapter is not None or run_dir is not None else None
    if label and name and label != name:
        name = f"{name} + {label}"
    return GeneralMetadata(name or label, keys)


__all__ = ["GeneralMetadata", "describe"]
