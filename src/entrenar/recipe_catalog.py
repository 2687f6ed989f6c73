"""The recipes that come with entrenar: the package's own, and a checkout's recipes/ folder.

`entrenar recipes` lists them with the first comment line of each file as its
description, and prints one by name, ready to copy and edit.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path

from entrenar.errors import ConfigError


@dataclass(frozen=True)
class BundledRecipe:
    name: str  # the file name without .yaml
    path: Path
    description: str  # the file's first comment line


def checkout_recipes_dir() -> Path | None:
    """recipes/ of the source checkout entrenar runs from (src layout), or None for an installed package."""
    root = Path(__file__).resolve().parents[2]
    folder = root / "recipes"
    return folder if (root / "pyproject.toml").is_file() and folder.is_dir() else None


def describe(path: Path) -> str:
    """The first comment line of a recipe file, without its '#'; '' when it opens with none."""
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line:
            return ""
    return ""


def bundled_recipes() -> list[BundledRecipe]:
    """The package's recipes, then the checkout's (a name already taken is not listed twice), each sorted."""
    folders = [Path(str(importlib.resources.files("entrenar").joinpath("recipes")))]
    if (checkout := checkout_recipes_dir()) is not None:
        folders.append(checkout)
    found: dict[str, BundledRecipe] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.yaml")):
            found.setdefault(path.stem, BundledRecipe(path.stem, path, describe(path)))
    return list(found.values())


def find_recipe(name: str) -> BundledRecipe:
    """The bundled recipe called `name` (with or without .yaml)."""
    stem = name.removesuffix(".yaml")
    recipes = bundled_recipes()
    for recipe in recipes:
        if recipe.name == stem:
            return recipe
    known = ", ".join(r.name for r in recipes)
    raise ConfigError(f"no bundled recipe named {name!r} (bundled: {known}; `entrenar recipes` lists them)")
