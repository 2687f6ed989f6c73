"""JSON files read with errors that name the file: what is wrong and where, never a decoder's traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from entrenar.errors import EntrenarError, ModelError


def read_json(path: Path, error: type[EntrenarError] = ModelError, what: str = "a model file") -> Any:
    """A JSON file's value. Invalid JSON (with its line), bytes that are not UTF-8, nesting too deep to decode
    and integers too long to read raise ``error`` naming the file; ``what`` says what the file should be."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise error(f"{path} line {e.lineno}: invalid JSON: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}): not a JSON file") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply to be {what}") from None
    except ValueError as e:  # an integer of thousands of digits (Python's int-string limit)
        raise error(f"{path}: invalid JSON: {e}") from None


def read_json_object(path: Path, error: type[EntrenarError] = ModelError, what: str = "a model file") -> dict[str, Any]:
    """As :func:`read_json`, for a file that must hold one JSON object (config.json and its kind)."""
    data = read_json(path, error, what)
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
