"""The recipes that come with entrenar: the package's own, and a checkout's recipes/ folder.

`entrenar recipes` lists them with the first sentence of each file's opening
comment as its description, and prints one by name, ready to copy and edit.
"""

from __future__ import annotations

import difflib
import importlib.resources
from dataclasses import dataclass
from pathlib import Path

from entrenar.errors import ConfigError


@dataclass(frozen=True)
class BundledRecipe:
    name: str  # the file name without .yaml
    path: Path
    description: str  # the first sentence of the file's opening comment


def checkout_recipes_dir() -> Path | None:
    """recipes/ of the source checkout entrenar runs from (src layout), or None for an installed package."""
    root = Path(__file__).resolve().parents[3]
    folder = root / "recipes"
    return folder if (root / "pyproject.toml").is_file() and folder.is_dir() else None


def describe(path: Path, width: int = 110) -> str:
    """The first sentence of a recipe's opening comment, cut to `width` characters; '' when it opens with none."""
    lines: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line.startswith("#"):
            if line or lines:
                break
            continue
        text = line.lstrip("#").strip()
        if not text:
            break  # a blank comment line ends the opening paragraph
        lines.append(text)
    text = " ".join(lines)
    end = text.find(". ")
    sentence = text[: end + 1] if end >= 0 else text
    if len(sentence) > width:
        sentence = sentence[: width - 3].rsplit(" ", 1)[0] + "..."
    return sentence


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
    names = [r.name for r in recipes]
    close = difflib.get_close_matches(stem, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"no bundled recipe named {name!r}{hint} (bundled: {', '.join(names)}; `entrenar recipes` "
                      "lists them)")
