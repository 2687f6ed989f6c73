"""Output folders: replacing an earlier output keeps what the command did not write; stale staging is cleaned."""

from __future__ import annotations


def test_a_killed_writes_staging_folder_is_cleaned_by_the_next_write(tmp_path):
    """A staging folder named for a process that is gone is removed; one of a live process is kept."""
    import os

    from entrenar.io.outputs import replace_files

    dead = tmp_path / ".out.999999999-abc123.tmp"  # no such pid
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"half")
    live = tmp_path / f".out.{os.getpid()}-xyz.tmp"
    live.mkdir()
    with replace_files(tmp_path / "out") as target:
        target.mkdir()
        (target / "config.json").write_text("{}")
    assert not dead.exists() and live.exists()
    assert (tmp_path / "out" / "config.json").read_text() == "{}"
