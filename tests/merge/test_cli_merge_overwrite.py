"""`entrenar merge` into an existing output: refused without --overwrite; with it, files it does not write stay."""

from __future__ import annotations

import pytest

from entrenar.errors import ConfigError


def test_merge_refuses_a_non_empty_output_and_keeps_foreign_files_with_overwrite(hf_folder, tmp_path):
    from entrenar.merge import merge

    folder, _ = hf_folder("llama")
    config = {"merge_method": "linear", "models": [{"model": str(folder), "parameters": {"weight": 1.0}}],
              "dtype": "float32"}
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="pass overwrite=True to replace") as refused:  # Python's spelling
        merge(config, out)
    assert "--overwrite" not in str(refused.value)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    merge(config, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and (out / "config.json").is_file()
