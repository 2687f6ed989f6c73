"""`entrenar recipes`: the bundled recipes listed with their first comment line, and printed by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from entrenar.cli.main import main
from entrenar.config import load_recipe
from entrenar.recipe_catalog import bundled_recipes, describe, find_recipe

REPO = Path(__file__).resolve().parents[2]


def test_lists_the_package_and_checkout_recipes_with_their_first_comment_line(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    files = [REPO / "src/entrenar/recipes/quickstart.yaml", *sorted((REPO / "recipes").glob("*.yaml"))]
    for path in files:
        first = next(l for l in path.read_text().splitlines() if l.startswith("#")).lstrip("# ").strip()
        assert any(l.split()[0] == path.stem and l.endswith(first) for l in lines if l), (path, lines)
    assert [r.name for r in bundled_recipes()] == [p.stem for p in files]


def test_every_bundled_recipe_has_a_description_and_loads():
    for recipe in bundled_recipes():
        assert recipe.description, recipe.path
        load_recipe(recipe.path)  # a listed recipe is a valid one


def test_prints_a_recipe_by_name_with_or_without_yaml(capsys):
    assert main(["recipes", "smollm2-lora-chat"]) == 0
    assert capsys.readouterr().out == (REPO / "recipes/smollm2-lora-chat.yaml").read_text()
    assert main(["recipes", "quickstart.yaml", "--path"]) == 0
    assert capsys.readouterr().out == f"{REPO / 'src/entrenar/recipes/quickstart.yaml'}\n"


def test_an_unknown_name_is_one_error_line_naming_the_known_ones(capsys):
    assert main(["recipes", "lora-lama"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no bundled recipe named 'lora-lama'") and "lora-llama" in err
    assert err.count("\n") == 1


def test_describe_takes_the_first_comment_line_only_before_any_key(tmp_path):
    commented = tmp_path / "a.yaml"
    commented.write_text("\n#   Full fine-tuning, fast.  \n# more\nmodel: {}\n")
    bare = tmp_path / "b.yaml"
    bare.write_text("model: {}  # not a description\n# late\n")
    assert (describe(commented), describe(bare)) == ("Full fine-tuning, fast.", "")


def test_train_help_points_at_the_recipes_command(capsys):
    assert main(["train", "--help"]) == 0
    assert "entrenar recipes" in capsys.readouterr().out


def test_a_checkout_recipe_never_hides_a_package_one(monkeypatch, tmp_path):
    import entrenar.recipe_catalog as catalog

    (tmp_path / "quickstart.yaml").write_text("# an impostor\nmodel: {}\n")
    (tmp_path / "extra.yaml").write_text("# extra\n")
    monkeypatch.setattr(catalog, "checkout_recipes_dir", lambda: tmp_path)
    assert find_recipe("quickstart").description.startswith("The bundled quickstart")
    assert find_recipe("extra").path == tmp_path / "extra.yaml"
    with pytest.raises(Exception, match="lora-llama"):
        find_recipe("lora-llama")  # only the package's and this checkout's recipes
