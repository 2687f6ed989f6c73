"""Bad recipes and overrides are one ConfigError naming the file, line and key, never a crash (and fuzzed so)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from entrenar.config import MAX_SEQ_LEN, Recipe, load_recipe
from entrenar.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = sorted((ROOT / "recipes").glob("*.yaml")) + [ROOT / "src" / "entrenar" / "recipes" / "quickstart.yaml"]


def error_of(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_recipe(path, list(overrides))
    return str(info.value)


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(("text", "message"), [
    ("model:\n  path: " + "[" * 5000 + "]" * 5000 + "\n", "line 2, column 39: malformed YAML: nested more than 32"),
    ("model: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "line 1, column 129: malformed YAML: nested more than 32"),
    ("model:\n  path: m\ndata:\n  train: a\x00b\n", "line 4, column 11: malformed YAML: character U+0000 is not"),
    ("model:\n  path: a\x7fb\n", "line 2, column 10: malformed YAML: character U+007F is not allowed"),
    ("training:\n  max_steps: " + "9" * 5000 + "\n", "line 2, column 14: malformed YAML: an integer of 5,000 digits"),
    ("training:\n  max_steps: 2026-13-45\n", "line 2, column 14: malformed YAML: cannot read '2026-13-45' as "
                                              "timestamp: month must be in 1..12"),
    ("training:\n  max_steps: !!float abc\n", "line 2, column 14: malformed YAML: cannot read 'abc' as float"),
], ids=["deep-list", "deep-map", "nul", "del", "long-int", "bad-date", "bad-float"])
def test_yaml_that_breaks_pyyaml_or_python_is_a_config_error_with_its_line(tmp_path, text, message):
    path = write(tmp_path, text)
    assert error_of(path).startswith(f"{path} {message}")


def test_overrides_that_break_yaml_name_the_override(tmp_path):
    assert error_of(None, ["model.path=" + "[" * 100]) == (
        "--set model.path=" + "[" * 66
        + "...: the value is not valid YAML (column 33): nested more than 32 levels deep")
    assert error_of(None, ["data.train=a\x00"]) == (
        "--set data.train=a\\x00: the value is not valid YAML (column 2): character U+0000 is not allowed "
        "(YAML forbids control characters)")
    assert "an integer of 5,000 digits is too long" in error_of(None, ["training.max_steps=" + "9" * 5000])


def test_a_regex_too_nested_for_python_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"'optimizer\.lr_scale' must be .* is not a valid regex: maximum recursion"):
        Recipe.from_dict({"model": {"path": "m"}, "data": {"train": "t"},
                          "optimizer": {"lr_scale": {"(" * 3000 + ")" * 3000: 2}}})


def test_data_without_a_model_path_is_an_error_not_the_quickstart(tmp_path):
    path = write(tmp_path, "data:\n  train: mine.jsonl\ntraining:\n  max_steps: 5\n")
    assert error_of(path) == (
        f"{path} line 2: 'model.path' is required (a model folder or .gguf file) when 'data.train' is set; only a "
        "recipe with neither model.path nor data runs the bundled quickstart")
    assert "when 'data.train' is set" in error_of(None, ["data.train=mine.jsonl"])
    assert "when 'data.validation' is set" in error_of(None, ["data.validation=v.jsonl"])
    assert load_recipe(None).model.path is None  # the quickstart itself


def test_seq_len_has_a_ceiling_before_any_model_is_read(tmp_path):
    assert error_of(None, ["data.seq_len=2147483648"]) == (
        f"--set data.seq_len=2147483648: 'data.seq_len' must be an integer in [2, {MAX_SEQ_LEN}], got 2147483648")
    assert load_recipe(None, [f"data.seq_len={MAX_SEQ_LEN}"]).data.seq_len == MAX_SEQ_LEN


# -- fuzzing -----------------------------------------------------------------------------------------------------

INSERTS = ["\x00", "\x7f", "\x1b", "\t", "\ufeff", "\ud800", ":", "-", " ", "\n", "#", "&a ", "*a", "!!python/tuple ",
           "!!float ", "!!binary ", "[", "]", "{", "}", "'", '"', "? ", "|", ">", "<<: ", "9" * 5000,
           "[" * 200, "{a: " * 100, "2026-13-45", "~", "null", "1e400", ".nan", "0x1F", "@", "`", "%YAML 1.1\n---\n"]


def mutate(text: str, rng: random.Random) -> str:
    for _ in range(rng.randint(1, 5)):
        i = rng.randrange(len(text) + 1)
        op = rng.random()
        if op < 0.3:
            text = text[:i] + text[i + rng.randint(1, 8):]
        elif op < 0.5:
            j = rng.randint(i, min(len(text), i + 40))
            text = text[:j] + text[i:j] + text[j:]
        else:
            text = text[:i] + rng.choice(INSERTS) + text[i:]
    return text


def test_fuzzed_recipes_load_or_raise_config_error(tmp_path):
    rng = random.Random(15)
    originals = [p.read_text(encoding="utf-8") for p in BUNDLED]
    outcomes = {"recipe": 0, "error": 0}
    for n in range(400):
        text = mutate(rng.choice(originals), rng)
        path = tmp_path / f"r{n}.yaml"
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        try:
            assert isinstance(load_recipe(path), Recipe)
            outcomes["recipe"] += 1
        except ConfigError as e:
            assert re.match(re.escape(str(path)) + r"[ :]", str(e)), str(e)  # names the file
            assert "\n" not in str(e), str(e)  # one line on the console
            outcomes["error"] += 1
    assert outcomes["recipe"] > 40 and outcomes["error"] > 100  # the fuzzing reaches both outcomes


KEYS = ["model.path", "data.train", "data.seq_len", "lora", "lora.r", "optimizer.lr_scale", "training.max_steps",
        "optimizer.betas", "qat", "output.name", "training.activation_checkpointing", "data", "nope", "data.nope"]
VALUES = ["1", "-1", "x", "[1, 2]", "{a: 1}", "null", "true", "9" * 5000, "[" * 100, "\x00", "\x7f", "a: b: c",
          "{'(': 2}", "&a [*a]", "!!binary x", "2026-13-45", "1e-4", "", "'", "!!python/object:os.system x"]


def test_fuzzed_overrides_apply_or_raise_config_error():
    rng = random.Random(15)
    outcomes = {"recipe": 0, "error": 0}
    for _ in range(300):
        item = f"{rng.choice(KEYS)}={rng.choice(VALUES)}"
        if rng.random() < 0.5:
            item = mutate(item, rng)
        try:
            assert isinstance(load_recipe(ROOT / "recipes" / "lora-llama.yaml", [item]), Recipe)
            outcomes["recipe"] += 1
        except ConfigError as e:
            assert "\n" not in str(e), str(e)
            outcomes["error"] += 1
    assert outcomes["recipe"] >= 10 and outcomes["error"] > 100
