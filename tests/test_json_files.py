"""The one JSON reader (entrenar.io.json_files): every way a file can be broken is an error naming it."""

from __future__ import annotations

import pytest

from entrenar.errors import CheckpointError, ModelError
from entrenar.io.json_files import read_json, read_json_object


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{\n  "a": 1,\n  oops\n}', r"x\.json line 3: invalid JSON: Expecting property name"),
        (b"\xff\xfe{}", r"x\.json: not UTF-8 text \(byte 0\): not a JSON file"),
        (b"[" * 100_000 + b"]" * 100_000, r"x\.json: JSON nested too deeply to be a model file"),
        (b'{"n": ' + b"9" * 5000 + b"}", r"x\.json: invalid JSON: Exceeds the limit"),
    ],
)
def test_a_broken_file_is_named(tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    with pytest.raises(ModelError, match=message):
        read_json(path)


def test_the_caller_picks_the_error_kind_and_what_the_file_is(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested too deeply to be a checkpoint file"):
        read_json(path, CheckpointError, "a checkpoint file")


def test_an_object_is_required_where_asked(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    assert read_json(path) == [1, 2]
    with pytest.raises(ModelError, match=r"x\.json: expected a JSON object, got list"):
        read_json_object(path)
    path.write_text('{"a": 1}')
    assert read_json_object(path) == {"a": 1}
