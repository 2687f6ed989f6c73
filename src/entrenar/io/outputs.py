"""Output folders of ``export``, ``quantize`` and ``merge``: checked before any heavy work, never emptied of a user's
files.

    refuse_overlap(out, {"base model": base})  # an output never replaces, deletes or sits inside an input
    check_output(out, overwrite=False)        # refuses a non-empty folder; fails now if `out` cannot be written
    with replace_files(out) as target:        # fill `target` (a fresh folder named like `out`)
        save_something(target)
    # each file written is moved into `out` over the file of that name; files of an earlier output of ours
    # that this one did not write (an old shard) are removed; every other file in `out` is kept

A fresh output folder is renamed into place whole (as :func:`entrenar.io.atomic.staged_folder` does). Into an
existing folder each file is replaced atomically, weights first and ``config.json`` last, so a reader never
sees a new config beside missing weights; a crash midway leaves a mix of old and new files of ours, never a
half-written file, and never a user's file gone.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from entrenar.errors import ConfigError, OutputExistsError
from entrenar.io import atomic

# Files a model, adapter or quantized folder written by entrenar may hold: what an earlier output of ours left.
OUR_FILES = re.compile(
    r"config\.json|generation_config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors"
    r"|model\.safetensors\.index\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json"
    r"|chat_template\.jinja|adapter_config\.json|adapter_model\.safetensors|model-[A-Za-z0-9_]+\.gguf"
)
_LAST = ("model.safetensors.index.json", "adapter_config.json", "config.json")  # moved in after the weights


def check_output(output: str | os.PathLike, overwrite: bool = False, is_file: bool = False) -> None:
    """Refuse to replace an earlier output without ``overwrite``, and fail now if ``output`` cannot be written.

    A non-empty existing folder (or an existing file, for ``is_file``) needs
    ``overwrite``; even then :func:`replace_files` keeps the files it does
    not write. The write test creates and removes one temporary file in the
    nearest existing folder, so a read-only or missing mount is found before
    minutes of merging or quantizing, not after.
    """
    output = Path(output)
    if output.exists() or output.is_symlink():
        if is_file:
            if not output.is_file():
                raise ConfigError(f"{output}: exists and is not a file")
            if not overwrite:
                raise OutputExistsError(f"{output}: the file exists; pass {{fix}} to replace it, or choose a new path")
        else:
            if not output.is_dir():
                raise ConfigError(f"{output}: exists and is not a folder")
            if any(output.iterdir()) and not overwrite:
                raise OutputExistsError(
                    f"{output}: the folder exists and is not empty; pass {{fix}} to replace the files this "
                    "command writes (other files in it are kept), or choose a new folder"
                )
    folder = output if output.is_dir() and not is_file else output.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{folder}: is not a folder, so {output} cannot be written")
    check_writable(folder)


def check_writable(folder: Path) -> None:
    """Raise OSError naming ``folder`` (read-only, no permission, full) unless a file can be created in it."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".entrenar-write-test.", suffix=atomic.TEMP_SUFFIX, dir=folder)
    except OSError as e:
        raise OSError(e.errno, f"cannot write in this folder ({e.strerror})", str(folder)) from None
    os.close(fd)
    os.unlink(probe)


@contextmanager
def replace_files(output: str | os.PathLike) -> Iterator[Path]:
    """Yield a path (not yet created) to write a folder at; on success its files go into ``output``.

    See the module docstring. Files under ``output`` that :data:`OUR_FILES`
    names and this write did not produce are removed (stale shards, an old
    index); anything else is kept. If the block raises, ``output`` is untouched.
    """
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale_temps(output)  # what a killed export or quantize of this output left beside it
    staging = Path(tempfile.mkdtemp(prefix=atomic.temp_prefix(output), suffix=atomic.TEMP_SUFFIX,
                                    dir=output.parent))
    target = staging / output.name
    try:
        yield target
        if not target.is_dir():
            raise FileNotFoundError(errno.ENOENT, "the writer produced no folder", str(target))
        if not output.exists():
            with atomic.staged_folder(output) as fresh:  # fsyncs the tree, renames it in whole
                fresh.rmdir()
                os.replace(target, fresh)
            return
        names = sorted(p.name for p in target.iterdir())
        atomic.apply_umask(target)
        _fsync_files(target)
        for name in sorted(names, key=lambda n: (n in _LAST, _LAST.index(n) if n in _LAST else 0, n)):
            source, dest = target / name, output / name
            if source.is_dir() and dest.is_dir() and not dest.is_symlink():
                atomic.remove_folder(dest)
            os.replace(source, dest)
        atomic.fsync_dir(output)
        for old in output.iterdir():
            if old.name not in names and OUR_FILES.fullmatch(old.name) and old.is_file():
                old.unlink()
        atomic.fsync_dir(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fsync_files(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def refuse_overlap(output: Path, inputs: dict[str, Path]) -> None:
    """Refuse an output that would overwrite, delete or sit inside an input (``inputs``: what -> path)."""
    out = output.resolve()
    for what, path in inputs.items():
        src = path.resolve()
        if out == src:
            raise ConfigError(f"{output}: the output is the {what}; choose another path (an output never replaces "
                              "an input)")
        if out in src.parents:
            raise ConfigError(f"{output}: the output contains the {what} ({path}); replacing it would delete it")
        if src.is_dir() and src in out.parents:
            raise ConfigError(f"{output}: the output is inside the {what} ({path}); choose a path outside it")


__all__ = ["OUR_FILES", "check_output", "check_writable", "refuse_overlap", "replace_files"]
