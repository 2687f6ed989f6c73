"""`entrenar recipes`: the bundled recipes listed with their first comment line, and printed by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_helpers import run_cli

from entrenar.cli.main import main
from entrenar.config import load_recipe
from entrenar.config.catalog import bundled_recipes, describe, find_recipe

REPO = Path(__file__).resolve().parents[2]


def test_lists_the_package_and_checkout_recipes_with_their_first_sentence(capsys):
    assert main(["recipes"]) == 0
    lines = capsys.readouterr().out.splitlines()
    files = [*sorted((REPO / "src/entrenar/recipes").glob("*.yaml")), *sorted((REPO / "recipes").glob("*.yaml"))]
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


@pytest.mark.parametrize("name, bits, r, alpha, targets, checkpointing", [
    ("piq3_r16", 3, 16, 32, "all-linear", False),
    ("piq2_r8", 2, 8, 16, "all-linear", False),
    ("minimal", 2, 4, 8, ["q_proj", "v_proj"], True),
])
def test_the_lora_qat_presets_train_as_the_original_specifies(capsys, workspace, name, bits, r, alpha, targets,
                                                             checkpointing):
    """The original's presets, by name: two steps of each on the tiny model (its widths are 32, so groups of 16)."""
    import json

    out_dir = workspace / name
    code, out, err = run_cli(capsys, "train", name, "--no-progress", "--set", f"model.path={workspace / 'model'}",
                             "--set", f"data.train={workspace / 'train.jsonl'}", "--set", "model.device=cpu",
                             "--set", "qat.group_size=16", "--set", "data.seq_len=32", "--set", "training.max_steps=2",
                             "--set", "training.batch_size=2", "--set", "training.grad_accum=1",
                             "--set", "schedule.warmup_steps=0",
                             "--set", f"output.dir={out_dir}")
    assert code == 0, err
    adapter = json.loads((out_dir / "adapter" / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (r, alpha)
    quantized = json.loads((out_dir / "quantized" / "config.json").read_text())["quantization_config"]
    assert (quantized["bits"], quantized["backward"], quantized["group_size"]) == (bits, "lsq", 16)
    # QAT on the adapted layers only
    adapted = {m.rsplit(".", 1)[1] for m in quantized["modules"]}
    assert adapted == ({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
                       if targets == "all-linear" else set(targets))
    recipe = load_recipe(out_dir / "recipe.yaml")
    assert recipe.training.activation_checkpointing is checkpointing
    assert (recipe.qat.scale_lr, recipe.optimizer.lr) == (1e-3, 1e-4)
    assert "merged integer" in out  # the merged integer model's held-out loss against the unmerged one
