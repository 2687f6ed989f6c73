"""Where a Hugging Face folder's safetensors weights are, without importing the model code.

Kept apart from :mod:`entrenar.models.hf` so tools that only read tensors
(``entrenar merge``) do not pay for importing the model stack.
"""

from __future__ import annotations

from pathlib import Path

from entrenar.errors import ModelError
from entrenar.io.json_files import read_json

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a folder, from its index when sharded."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{index}: 'weight_map' must be an object of tensor name -> file name, "
                             f"got {type(weight_map).__name__ if weight_map is not None else 'nothing'}")
        for value in weight_map.values():
            if not isinstance(value, str) or value in ("", ".", "..") or Path(value).name != value:
                raise ModelError(f"{index}: 'weight_map' names {value!r}, not a file name in the folder")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    elif (folder / SINGLE_NAME).is_file():
        files = [folder / SINGLE_NAME]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder}: no safetensors weights found (pytorch_model.bin is not loaded: it is a pickle)")
    for f in files:
        if not f.is_file():
            raise ModelError(f"{folder}: weight file {f.name} named in {INDEX_NAME} is missing")
    return files
