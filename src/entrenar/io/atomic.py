"""Atomic writes: a reader, or a run restarted after a crash, sees the old content or the new, never part of either.

A file is written to a temporary sibling, fsynced and renamed over its target
(``os.replace`` is atomic within one file system). A folder is built in a
temporary sibling and renamed into place once every file in it is on disk.
After a rename the parent folder is fsynced, so the rename itself survives a
power cut. Temporaries are named ``.<target name>.<pid>-<random>.tmp``; they
are removed when a write fails, and only a hard kill leaves one behind: the next
write of the same target removes it once the process that made it is gone.

New files and folders get the modes the process umask gives (``0o666`` and
``0o777`` less the umask), as ``open`` and ``mkdir`` would, not the ``0o600``
of ``mkstemp``.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

TEMP_SUFFIX = ".tmp"
# What follows ".<target name>." in a temporary's name: "<pid>-<random>", or "<random>" from earlier versions.
_TEMP_TAIL = re.compile(r"^(?:(\d+)-)?[A-Za-z0-9_]+" + re.escape(TEMP_SUFFIX) + "$")


def umask() -> int:
    """The process umask, read without changing it where the system tells it (Linux); else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_prefix(path: Path) -> str:
    """The name prefix of this process's temporaries for ``path``: later writes know them as live."""
    return f".{path.name}.{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # ours: a write in progress in this process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def is_stale_temp(entry: Path, target_name: str) -> bool:
    """True when ``entry`` is a temporary that a killed write of ``target_name`` left behind."""
    prefix = f".{target_name}."
    if not entry.name.startswith(prefix):
        return False
    match = _TEMP_TAIL.match(entry.name[len(prefix):])
    return match is not None and (match.group(1) is None or not _pid_alive(int(match.group(1))))


def remove_stale_temps(target: str | os.PathLike) -> None:
    """Remove the temporaries of earlier, killed writes of ``target`` (files or folders beside it)."""
    target = Path(target)
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return
    for entry in entries:
        if is_stale_temp(entry, target.name):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def remove_folder(folder: str | os.PathLike) -> None:
    """Delete ``folder`` so that a kill at any moment leaves it whole or gone, never half-deleted.

    It is first renamed to a temporary sibling (out of its name's namespace; removed by the next write
    beside it if this process dies), the rename is made durable, and only then are its files deleted.
    """
    folder = Path(folder)
    doomed = folder.parent / f"{temp_prefix(folder)}removed{TEMP_SUFFIX}"
    os.replace(folder, doomed)
    fsync_dir(folder.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make renames and new entries in ``folder`` durable (a no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_file(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Have ``write(tmp)`` fill a temporary sibling of ``path``, fsync it, and return it, not yet renamed.

    For writers that must put several files in place in a chosen order; most
    callers want :func:`write_file`. The temporary is removed if ``write`` fails.
    """
    path = Path(path)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0o600 would survive the rename
    finally:
        os.close(fd)
    try:
        write(Path(tmp))
        _fsync_file(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_file(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Replace ``path`` whole by what ``write(tmp)`` writes to a temporary sibling; return ``path``.

    For writers that want a path of their own (``safetensors.save_file``, a GGUF writer).
    """
    path = Path(path)
    tmp = temp_file(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace the file ``path`` by ``data`` atomically; return ``path``."""
    return write_file(path, lambda tmp: tmp.write_bytes(data))


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Replace the file ``path`` by ``text`` atomically; return ``path``."""
    return write_bytes(path, text.encode(encoding))


def _fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync_file(os.path.join(root, name))
        fsync_dir(root)


def apply_umask(folder: str | os.PathLike[str]) -> None:
    """Give a staged tree the modes the umask gives new files and folders.

    Writers that stage through temporary files of their own (safetensors' ``save_file`` leaves ``0o600``)
    would otherwise carry those modes into the user's folder.
    """
    mask = umask()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


@contextmanager
def staged_folder(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty folder to fill; when the block succeeds, it replaces ``target``.

    The new folder is built beside ``target`` and fsynced whole before it is
    renamed into place, so an existing ``target`` is moved aside only once its
    replacement is complete; if the block raises, ``target`` is left as it was
    and the temporary folder is removed. Between moving the old folder aside
    and renaming the new one in (two renames) ``target`` briefly does not
    exist; a crash exactly there leaves no folder, never a partial one.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(target)
    staging = Path(tempfile.mkdtemp(prefix=temp_prefix(target), suffix=TEMP_SUFFIX, dir=target.parent))
    new, old = staging / "new", staging / "old"
    try:
        new.mkdir()
        yield new
        apply_umask(new)
        _fsync_tree(new)
        if target.exists() or target.is_symlink():
            os.replace(target, old)
        try:
            os.replace(new, target)
        except BaseException:
            if old.exists() or old.is_symlink():
                os.replace(old, target)
            raise
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = ["apply_umask", "fsync_dir", "is_stale_temp", "remove_folder", "remove_stale_temps", "staged_folder",
           "temp_file", "temp_prefix", "umask", "write_bytes", "write_file", "write_text"]
