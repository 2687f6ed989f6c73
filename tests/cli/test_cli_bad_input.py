"""Bad recipes and data through `entrenar train`: one `error:` line and exit code 2, never an internal error."""

from __future__ import annotations

import json

import pytest

from entrenar.cli.main import main


def run(capsys, *argv) -> tuple[int, list[str]]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(("text", "expected"), [
    ("model:\n  path: " + "[" * 3000 + "\n", "line 2, column 39: malformed YAML: nested more than 32 levels deep"),
    ("model:\n  path: m\x00\n", "line 2, column 10: malformed YAML: character U+0000 is not allowed"),
    ("data:\n  train: mine.jsonl\n", "line 2: 'model.path' is required"),
    ("model:\n  path: m\ndata:\n  train: t\n  seq_len: 2147483648\n",
     "line 5: 'data.seq_len' must be an integer in [2, 4194304], got 2147483648"),
], ids=["deep", "nul", "no-model", "seq-len"])
def test_bad_recipes_exit_2_with_one_line(tmp_path, capsys, text, expected):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    code, err = run(capsys, "train", str(recipe), "--dry-run")
    assert code == 2 and err == [f"error: {recipe} {expected}" + err[0].split(expected, 1)[1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]  # nothing written


def test_bad_data_in_raise_mode_exits_2_naming_file_and_line(workspace, capsys):
    data = workspace / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n{"text": ' + "[" * 5000 + "]" * 5000 + "}\n")
    recipe = workspace / "r.yaml"
    recipe.write_text(json.dumps({"model": {"path": str(workspace / "model"), "device": "cpu"},
                                  "data": {"train": str(data)}}))
    code, err = run(capsys, "train", str(recipe), "--dry-run", "--no-progress")
    assert (code, err) == (2, [f"error: {data} line 2: invalid JSON: nested too deeply to read"])
