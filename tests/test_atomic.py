"""entrenar.io.atomic: files and folders are replaced whole or not at all, and no temporary is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from entrenar.io import atomic


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden temporaries included) with its content."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_write_text_replaces_the_content_whole(tmp_path):
    path = tmp_path / "pointer"
    atomic.write_text(path, "a much longer first version\n")
    assert atomic.write_text(path, "short\n") == path
    assert path.read_text() == "short\n"  # not "short\n" over the tail of the old text
    assert os.listdir(tmp_path) == ["pointer"]


def test_write_bytes_round_trips(tmp_path):
    data = bytes(range(256)) * 3
    atomic.write_bytes(tmp_path / "blob", data)
    assert (tmp_path / "blob").read_bytes() == data


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("old\n")

    def half_then_crash(tmp: Path) -> None:
        tmp.write_text("new but cut")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic.write_file(path, half_then_crash)
    assert listing(tmp_path) == {"metrics.jsonl": b"old\n"}


def test_temp_file_is_written_beside_the_target_and_not_renamed(tmp_path):
    tmp = atomic.temp_file(tmp_path / "adapter_config.json", lambda p: p.write_text("{}"))
    assert tmp.parent == tmp_path and tmp.name.startswith(".adapter_config.json.") and tmp.name.endswith(".tmp")
    assert tmp.read_text() == "{}" and not (tmp_path / "adapter_config.json").exists()


def test_staged_folder_replaces_the_old_folder_whole(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stale.safetensors").write_bytes(b"old weights")
    with atomic.staged_folder(target) as new:
        assert new.is_dir() and not any(new.iterdir()) and new.parent.parent == tmp_path
        assert (target / "stale.safetensors").exists()  # the old folder stays in place while the new one is built
        (new / "config.json").write_text("{}")
        (new / "sub").mkdir()
        (new / "sub" / "w.bin").write_bytes(b"w")
    assert listing(tmp_path) == {"model/config.json": b"{}", "model/sub/w.bin": b"w"}
    assert os.listdir(tmp_path) == ["model"]


def test_failure_inside_staged_folder_keeps_the_old_folder_and_leaves_no_temp(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text('{"old": true}')
    before = listing(tmp_path)
    with pytest.raises(RuntimeError, match="tensor is NaN"), atomic.staged_folder(target) as new:
        (new / "config.json").write_text('{"new": true}')
        raise RuntimeError("tensor is NaN")
    assert listing(tmp_path) == before
    assert os.listdir(tmp_path) == ["model"]


def test_staged_folder_creates_a_missing_target_and_its_parents(tmp_path):
    target = tmp_path / "runs" / "a" / "out"
    with pytest.raises(KeyboardInterrupt), atomic.staged_folder(target):
        raise KeyboardInterrupt
    assert not target.exists() and os.listdir(target.parent) == []
    with atomic.staged_folder(target) as new:
        (new / "x").write_text("1")
    assert listing(target) == {"x": b"1"}


def test_every_new_file_is_on_disk_before_the_swap(tmp_path, monkeypatch):
    """The rename must not reach the disk before the data it points at (a power cut would leave empty files)."""
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name the fsynced files")
    target = tmp_path / "ckpt"
    target.mkdir()
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append("fsync " + os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(f"replace {Path(src).name} -> {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with atomic.staged_folder(target) as new:
        (new / "model.safetensors").write_bytes(b"w")
        (new / "trainer.json").write_text("{}")
    swap = events.index("replace new -> ckpt")
    assert {"fsync model.safetensors", "fsync trainer.json", "fsync new"} <= set(events[:swap])
    assert events[swap - 1] == "replace ckpt -> old" and events[swap + 1] == f"fsync {tmp_path.name}"


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_files_and_folders_get_the_modes_the_umask_gives(tmp_path, mask):
    old = os.umask(mask)
    try:
        assert atomic.umask() == mask
        atomic.write_text(tmp_path / "recipe.yaml", "x: 1\n")
        with atomic.staged_folder(tmp_path / "model") as folder:
            (folder / "weights").write_bytes(b"w")
        with open(tmp_path / "reference", "w") as f:  # what plain open() and mkdir() give
            f.write("x")
        (tmp_path / "reference-dir").mkdir()
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert mode(tmp_path / "recipe.yaml") == mode(tmp_path / "reference") == 0o666 & ~mask
    assert mode(tmp_path / "model") == mode(tmp_path / "reference-dir") == 0o777 & ~mask
    assert mode(tmp_path / "model" / "weights") == 0o666 & ~mask


def test_a_write_removes_only_the_stale_temporaries_of_its_own_target(tmp_path):
    import subprocess
    import sys

    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True).stdout)
    stale = [f".metrics.jsonl.{dead_pid}-a1b2c3.tmp", ".metrics.jsonl.q9w8e7r6.tmp"]  # pid-tagged, older style
    kept = [f".metrics.jsonl.{os.getppid()}-livewr.tmp",  # a live process's write in progress
            f".other.jsonl.{dead_pid}-a1b2c3.tmp",  # another target's: its own next write cleans it
            ".metrics.jsonl.backup.tmp.txt", "metrics.jsonl.tmp"]  # not entrenar's names
    for name in stale + kept:
        (tmp_path / name).write_text("partial")
    (tmp_path / f".model.{dead_pid}-zz.tmp" / "new").mkdir(parents=True)  # a killed staged_folder
    atomic.write_text(tmp_path / "metrics.jsonl", "{}\n")
    with atomic.staged_folder(tmp_path / "model") as folder:
        (folder / "config.json").write_text("{}")
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["metrics.jsonl", "model"])


def test_a_staged_folder_gets_umask_modes_whatever_its_writers_left(tmp_path):
    """safetensors' save_file leaves 0o600; the folder entrenar renames into place follows the umask."""
    import os
    import stat

    import torch
    from safetensors.torch import save_file

    from entrenar.io import atomic

    old = os.umask(0o022)
    try:
        with atomic.staged_folder(tmp_path / "model") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "x.json").write_text("{}")
            os.chmod(tmp / "sub" / "x.json", 0o600)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "model").rglob("*")}
    assert modes == {"model.safetensors": 0o644, "sub": 0o755, "x.json": 0o644}
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o755
