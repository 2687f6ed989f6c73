"""The recipe: defaults, round trips, overrides, and errors that say where and what."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest
import yaml

from entrenar.config import (
    RESUMABLE_KEYS,
    LoraSection,
    ModelSection,
    QatSection,
    Recipe,
    TrainingSection,
    load_recipe,
    recipe_changes,
    save_recipe,
)
from entrenar.errors import ConfigError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"

# Line numbers below are asserted in error messages: keep this text's layout.
BASE = """\
model:
  path: models/tiny
data:
  train: data/train.jsonl
optimizer:
  lr: 1e-4
training:
  batch_size: 8
"""


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(path: Path | None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(path, overrides)
    return str(info.value)


def every_non_default() -> Recipe:
    """A recipe where every section differs from its defaults."""
    return Recipe(
        model=ModelSection(path="m", dtype="bfloat16", device="cuda:1"),
        data=dataclasses.replace(Recipe().data, train="t", validation="v", format="csv", train_on="completion"),
        lora=LoraSection(r=4, alpha=8, target_modules=("q_proj",), quantize_base="nf4"),
        optimizer=dataclasses.replace(
            Recipe().optimizer, name="sgd", betas=(0.8, 0.9), fused=True, lr_scale={"lora_B": 16}
        ),
        schedule=dataclasses.replace(Recipe().schedule, name="linear", warmup_steps=3, min_lr_ratio=0.0),
        training=TrainingSection(max_steps=7, precision="bf16", eval_batches=2, seed=5),
        output=dataclasses.replace(Recipe().output, name="x", dir="/tmp/x"),
    )


# ---------------------------------------------------------------- loading


def test_file_values_and_defaults(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE, "my-run.yaml"))
    assert recipe.model.path == "models/tiny"
    assert recipe.optimizer.lr == 1e-4  # YAML 1.1 reads `1e-4` as a string
    assert isinstance(recipe.optimizer.lr, float)
    assert recipe.training.batch_size == 8
    assert recipe.training.max_steps == TrainingSection().max_steps
    assert recipe.lora is None  # absent = full fine-tuning
    assert (recipe.output.name, recipe.output.dir) == ("my-run", "runs/my-run")


def test_int_accepted_where_float_expected(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["optimizer.lr=1", "lora.alpha=32"])
    assert recipe.optimizer.lr == 1.0 and isinstance(recipe.optimizer.lr, float)
    assert recipe.lora.alpha == 32.0


def test_bundled_quickstart_loads():
    recipe = load_recipe(None)
    assert recipe.model.path is None and recipe.data.train is None
    assert recipe.output.name == "quickstart"
    assert recipe.output.dir == "runs/quickstart"


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_recipes_load(path):
    recipe = load_recipe(path)
    assert (recipe.model.path is not None or recipe.model.init == "random") and recipe.data.train is not None


def test_lora_llama_example_documents_every_key():
    """recipes/lora-llama.yaml is the reference: every key present, each with a comment,
    and a value that differs from the default says so in its comment."""
    path = RECIPES / "lora-llama.yaml"
    text = path.read_text().splitlines()
    node = yaml.compose(path.read_text())
    written = {}
    for section_key, section in node.value:
        if section.tag.endswith(":null"):  # an optional section left off: its keys are documented in comments
            for line in text[section_key.start_mark.line + 1:]:
                if not line.startswith("#   "):
                    break
                written[f"{section_key.value}.{line[4:].split(':')[0]}"] = line
            continue
        for key, _ in section.value:
            written[f"{section_key.value}.{key.value}"] = text[key.start_mark.line]
    defaults = Recipe(lora=LoraSection(), qat=QatSection()).to_dict()
    values = load_recipe(path).to_dict()
    for section, keys in defaults.items():
        for key, default in keys.items():
            dotted = f"{section}.{key}"
            assert dotted in written, f"{dotted} missing from {path.name}"
            assert "#" in written[dotted], f"{dotted} has no comment"
            if values[section] is not None and values[section][key] != default:
                assert "default" in written[dotted].split("#", 1)[1], f"{dotted}: comment must give the default"


# ---------------------------------------------------------------- round trips


def test_to_dict_from_dict_round_trip():
    recipe = every_non_default()
    d = recipe.to_dict()
    assert d["lora"]["target_modules"] == ["q_proj"]  # plain lists, YAML/JSON-ready
    assert Recipe.from_dict(d) == recipe
    assert Recipe.from_dict(Recipe().to_dict()) == Recipe()


def test_save_and_reload_is_equal(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE), ["lora.r=4", "optimizer.lr_scale={lora_B: 16}"])
    out = tmp_path / "run" / "recipe.yaml"
    save_recipe(recipe, out)
    assert load_recipe(out) == recipe
    assert not list(out.parent.glob("*.tmp"))
    full = every_non_default()
    save_recipe(full, out)
    assert load_recipe(out) == full


def test_recipe_changes_names_the_keys():
    a = every_non_default()
    b = dataclasses.replace(a, optimizer=dataclasses.replace(a.optimizer, lr=1e-3), lora=None)
    changes = recipe_changes(a, b)
    assert "optimizer.lr: 0.0002 -> 0.001" in changes
    assert "lora.r: 4 -> null" in changes and "lora.alpha: 8.0 -> null" in changes
    assert not any(c.startswith("model.") for c in changes)
    assert recipe_changes(a, a) == []


# The tuple train/loop.py kept by hand (RESUMABLE_CHANGES) before the fields were marked: the same keys, in order.
RESUMABLE_BEFORE = ("training.max_steps", "training.eval_every", "training.log_every", "training.save_every",
                    "training.keep_last", "training.eval_batches", "training.cpu_threads", "training.kernels",
                    "training.compile", "training.nonfinite", "training.max_skipped_steps",
                    "training.early_stopping", "training.parallel", "training.global_batch_size",
                    "training.dist_timeout_s", "training.replica_check_every",
                    "training.cuda_graphs", "training.overlap_steps", "training.deterministic",
                    "training.offload_embeddings", "training.offload_weights", "data.padding_free",
                    "schedule.on_extend")


def test_resumable_keys_are_the_marked_fields():
    assert (*RESUMABLE_BEFORE, "training.epochs",  # a run's length in epochs, as max_steps
            "training.stall_startup_s", "training.stall_timeout_s",  # hung-rank bounds
            "training.tiled_mlp") == RESUMABLE_KEYS  # the MLP in tiles: the same values, less memory
    for key in RESUMABLE_KEYS:  # each names a field of a section
        section, name = key.split(".")
        assert name in Recipe().to_dict()[section]


# ---------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    "override, get, expected",
    [
        ("optimizer.lr=2e-4", lambda r: r.optimizer.lr, 2e-4),
        ("training.batch_size=2", lambda r: r.training.batch_size, 2),
        ("data.packing=false", lambda r: r.data.packing, False),
        ("data.format=parquet", lambda r: r.data.format, "parquet"),
        ("training.eval_batches=null", lambda r: r.training.eval_batches, None),
        ("optimizer.betas=[0.9, 0.95]", lambda r: r.optimizer.betas, (0.9, 0.95)),
        ("optimizer.fused=true", lambda r: r.optimizer.fused, True),
        (
            "optimizer.lr_scale={lora_B: 16, 'router\\.': 0.5}",
            lambda r: r.optimizer.lr_scale,
            {"lora_B": 16.0, "router\\.": 0.5},
        ),
        ("lora.target_modules=[q_proj,v_proj]", lambda r: r.lora.target_modules, ("q_proj", "v_proj")),
        ("lora.target_modules=all-linear", lambda r: r.lora.target_modules, "all-linear"),
        ("lora.r=4", lambda r: (r.lora.r, r.lora.alpha), (4, 16.0)),  # turns LoRA on, rest defaults
        ("model.device=cuda:0", lambda r: r.model.device, "cuda:0"),
        ("output.name=exp1", lambda r: (r.output.name, r.output.dir), ("exp1", "runs/exp1")),
    ],
)
def test_override_each_type(tmp_path, override, get, expected):
    assert get(load_recipe(write(tmp_path, BASE), [override])) == expected


def test_override_section_null_and_mapping(tmp_path):
    path = write(tmp_path, BASE + "lora:\n  r: 32\n  alpha: 64\n")
    assert load_recipe(path).lora.r == 32
    assert load_recipe(path, ["lora=null"]).lora is None
    # a whole section replaces the file's: keys it does not name take defaults
    assert load_recipe(path, ["lora={r: 4}"]).lora == LoraSection(r=4)
    assert load_recipe(path, ["lora.r=4", "lora.r=2"]).lora.r == 2  # the last one wins


# ---------------------------------------------------------------- errors


def test_unknown_key_names_file_line_and_suggestion(tmp_path):
    path = write(tmp_path, BASE.replace("  lr: 1e-4", "  lr: 1e-4\n  lrr: 3"))
    msg = error_of(path)
    assert msg.startswith(f"{path} line 7: unknown key 'optimizer.lrr'")
    assert "allowed: name, lr, weight_decay" in msg and "did you mean 'lr'?" in msg


def test_unknown_section_suggests(tmp_path):
    path = write(tmp_path, BASE + "optimiser:\n  lr: 1\n")
    msg = error_of(path)
    assert msg.startswith(f"{path} line 9: unknown key 'optimiser'") and "did you mean 'optimizer'?" in msg


def test_bad_value_names_line_key_and_rule(tmp_path):
    path = write(tmp_path, BASE.replace("batch_size: 8", "batch_size: eight"))
    assert error_of(path) == f"{path} line 8: 'training.batch_size' must be an integer > 0, got 'eight'"


@pytest.mark.parametrize(
    "line, expected",
    [
        ("batch_size: true", "'training.batch_size' must be an integer > 0, got true"),  # bool is not an int
        ("batch_size: 0", "'training.batch_size' must be an integer > 0, got 0"),
        ("batch_size: 2.0", "'training.batch_size' must be an integer > 0, got 2.0"),
        ("seed: -1", "'training.seed' must be an integer in [0, 4294967295], got -1"),
        ("precision: bf61", "'training.precision' must be one of: fp32, bf16, fp16, got 'bf61' (did you mean 'bf16'?)"),
        ("max_grad_norm: .nan", "'training.max_grad_norm' must be a number >= 0, got nan"),
        ("eval_batches: 0", "'training.eval_batches' must be an integer > 0 or null, got 0"),
        ("offload_activations: -1",
         "'training.offload_activations' must be true, false, or a number of layers (the first ones), got -1"),
        ("offload_activations: 'first'",
         "'training.offload_activations' must be true, false, or a number of layers (the first ones), got 'first'"),
    ],
)
def test_value_rules(tmp_path, line, expected):
    path = write(tmp_path, BASE.replace("batch_size: 8", line))
    assert error_of(path) == f"{path} line 8: {expected}"


def test_override_value_error_names_the_override(tmp_path):
    msg = error_of(write(tmp_path, BASE), ["optimizer.lr=abc"])
    assert msg == "--set optimizer.lr=abc: 'optimizer.lr' must be a number > 0, got 'abc'"


def test_error_inside_overridden_section_names_the_override(tmp_path):
    path = write(tmp_path, BASE)
    msg = error_of(path, ["optimizer={lr: 0, betas: [0.9, 0.99]}"])
    assert msg.startswith("--set optimizer={lr: 0, betas: [0.9, 0.99]}: 'optimizer.lr' must be a number > 0")
    # a key the override did not touch is still reported at its line in the file
    msg = error_of(write(tmp_path, BASE.replace("batch_size: 8", "batch_size: -8")), ["optimizer.lr=1"])
    assert msg.startswith(f"{path} line 8: 'training.batch_size'")


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optimizer.lrr=1", "--set optimizer.lrr=1: unknown key 'optimizer.lrr' (allowed: name, lr,"),
        ("optimiser.lr=1", "--set optimiser.lr=1: unknown key 'optimiser' (allowed: model, data,"),
        ("optimizer.lr_scale.x=2", "--set optimizer.lr_scale.x=2: unknown key 'optimizer.lr_scale.x'"),
        ("optimizer.lr", "--set optimizer.lr: expected KEY=VALUE"),
        ("optimizer.lr=[1", "--set optimizer.lr=[1: the value is not valid YAML"),
        ("optimizer={lrr: 1}", "--set optimizer={lrr: 1}: unknown key 'optimizer.lrr'"),
        (
            "lora.target_modules=q_proj",
            "--set lora.target_modules=q_proj: 'lora.target_modules' must be 'all-linear' or a non-empty list",
        ),
    ],
)
def test_bad_overrides(tmp_path, override, expected):
    assert error_of(write(tmp_path, BASE), [override]).startswith(expected)


@pytest.mark.parametrize(
    "lines, expected",
    [
        ("  betas: [0.9]", "'optimizer.betas' must be a list of two numbers in [0, 1), got [0.9]"),
        ("  lr_scale: {'a[': 2}", "'optimizer.lr_scale' must be a mapping of module-name regex to a number > 0"),
        ("  lr_scale: {lora_B: 0}", "(scale of 'lora_B' is 0)"),
        ("  fused: 1", "'optimizer.fused' must be one of: auto, true, false, got 1"),
    ],
)
def test_optimizer_rules(tmp_path, lines, expected):
    path = write(tmp_path, BASE.replace("  lr: 1e-4", lines))
    msg = error_of(path)
    assert msg.startswith(f"{path} line 6: ") and expected in msg


def test_missing_file(tmp_path):
    assert error_of(tmp_path / "nope.yaml") == f"recipe file not found: {tmp_path / 'nope.yaml'}"
    assert error_of(tmp_path).startswith("recipe path is not a file")


def test_malformed_yaml_gives_line_and_column(tmp_path):
    path = write(tmp_path, "model:\n  path: [a, b\ndata: 1\n")
    msg = error_of(path)
    assert msg.startswith(f"{path} line 3, column 5: malformed YAML: while parsing a flow sequence (started at line 2")


def test_top_level_must_be_a_mapping(tmp_path):
    assert error_of(write(tmp_path, "- model\n- data\n")).endswith(
        "line 1: the top level must be a mapping of sections "
        "(model, data, lora, qat, optimizer, schedule, training, output, task, moe, reward), got [model, data]"
    )
    assert "the recipe is empty" in error_of(write(tmp_path, "# nothing\n"))
    path = write(tmp_path, BASE + "schedule: cosine\n")
    assert error_of(path) == (
        f"{path} line 9: 'schedule' must be a mapping of keys (name, warmup_steps, min_lr_ratio, on_extend), "
        "got 'cosine'"
    )


def test_duplicate_key_is_an_error(tmp_path):
    path = write(tmp_path, BASE + "  batch_size: 16\n")
    assert error_of(path) == f"{path} line 9: duplicate key 'training.batch_size' (first at line 8)"


def test_train_data_required_unless_quickstart(tmp_path):
    path = write(tmp_path, "model:\n  path: m\ndata:\n  seq_len: 64\n")
    assert error_of(path) == f"{path} line 3: 'data.train' is required (a data file or folder) when model.path is set"
    assert load_recipe(None, ["data.train=null"]).data.train is None  # the quickstart needs none


def test_fp16_on_cpu_is_an_error(tmp_path):
    msg = error_of(write(tmp_path, BASE), ["model.device=cpu", "training.precision=fp16"])
    assert msg.startswith("--set training.precision=fp16: 'training.precision' fp16 needs a CUDA device")
    assert load_recipe(write(tmp_path, BASE), ["model.device=cpu", "training.precision=bf16"])


def test_validation_file_and_split_conflict(tmp_path):
    path = write(tmp_path, BASE.replace("  train: data/train.jsonl",
                                        "  train: t\n  validation: v\n  validation_split: 0.1"))
    assert error_of(path) == (f"{path} line 6: 'data.validation_split' must be 0 when 'data.validation' names a "
                              "file, got 0.1")


def test_sections_validate_when_built_in_python():
    with pytest.raises(ConfigError, match=r"'training.batch_size' must be an integer > 0, got 0"):
        TrainingSection(batch_size=0)
    with pytest.raises(ConfigError, match=r"'data.train' is required"):
        Recipe(model=ModelSection(path="m"))
    with pytest.raises(ConfigError, match=r"'lora.r' must be an integer > 0"):
        dataclasses.replace(LoraSection(), r=-1)


def test_from_dict_names_its_source():
    with pytest.raises(ConfigError) as info:
        Recipe.from_dict({"training": {"batch_size": "8"}}, source="checkpoint recipe")
    assert str(info.value) == "checkpoint recipe: 'training.batch_size' must be an integer > 0, got '8'"
