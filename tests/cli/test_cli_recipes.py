"""`entrenar recipes`: the bundled recipes listed with their first comment line, and printed by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from entrenar.cli.main import main
from entrenar.config import load_recipe
from entrenar.config.catalog import bundled_recipes, describe, find_recipe

REPO = Path(__file__).resolve().parents[2]


def test_lists_the_package_and_checkout_recipes_with_their_first_sentence(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    files = [REPO / "src/entrenar/recipes/quickstart.yaml", *sorted((REPO / "recipes").glob("*.yaml"))]
    assert [r.name for r in bundled_recipes()] == [p.stem for p in files]
    listed = {line.split()[0]: line.split(None, 1)[1] for line in lines[: len(files)]}
    assert listed["quickstart"] == "The bundled quickstart: `entrenar train` with no recipe runs this."
    assert listed["lora-llama"] == "LoRA fine-tuning of a Llama-style model on prompt/completion data."
    assert set(listed) == {p.stem for p in files}


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
    assert err.startswith("error: no bundled recipe named 'lora-lama'; did you mean 'lora-llama'? (bundled: ")
    assert err.count("\n") == 1


def test_describe_takes_the_first_sentence_of_the_opening_comment(tmp_path):
    two_lines = tmp_path / "a.yaml"
    two_lines.write_text("\n#   Full fine-tuning of a model\n# on chat data. More here.\n#\n# later\nmodel: {}\n")
    bare = tmp_path / "b.yaml"
    bare.write_text("model: {}  # not a description\n# late\n")
    long = tmp_path / "c.yaml"
    long.write_text("# " + "word " * 40 + "\n")
    assert (describe(two_lines), describe(bare)) == ("Full fine-tuning of a model on chat data.", "")
    assert describe(long, width=30) == "word word word word word..."


def test_train_help_points_at_the_recipes_command(capsys):
    assert main(["train", "--help"]) == 0
    assert "entrenar recipes" in capsys.readouterr().out


def test_a_checkout_recipe_never_hides_a_package_one(monkeypatch, tmp_path):
    import entrenar.config.catalog as catalog

    (tmp_path / "quickstart.yaml").write_text("# an impostor\nmodel: {}\n")
    (tmp_path / "extra.yaml").write_text("# extra\n")
    monkeypatch.setattr(catalog, "checkout_recipes_dir", lambda: tmp_path)
    assert find_recipe("quickstart").description.startswith("The bundled quickstart")
    assert find_recipe("extra").path == tmp_path / "extra.yaml"
    with pytest.raises(Exception, match="lora-llama"):
        find_recipe("lora-llama")  # only the package's and this checkout's recipes
