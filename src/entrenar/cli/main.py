"""The ``entrenar`` command: parse arguments, call one library function, print its result.

Each command lives in its own module with ``add_parser(subparsers, parents)``,
which sets ``run(args) -> int`` as the parser's default; heavy imports (torch and
the model code) happen inside ``run`` so ``entrenar --help`` stays instant.

Exit codes: 0 success (also when the reader of stdout went away: ``inspect ... | head``),
2 a user error (``EntrenarError``, an OSError about the user's paths or disk such as a
read-only or full file system, or bad arguments), 130 interrupted, 1 a bug in entrenar
(an exception that is not a user error).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import re
import sys
import warnings
from collections.abc import Sequence
from importlib import import_module
from typing import TextIO

from entrenar import __version__
from entrenar.distributed.launch import rank_prefix, report_worker_error
from entrenar.errors import EntrenarError

COMMANDS = ("train", "inspect", "generate", "eval", "chat", "export", "quantize", "merge", "classify",
            "recipes", "diagnose", "ablate")  # modules of entrenar.cli


class Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a name from a fixed set (a command, a --choice): ``entrenar trian``.
    Subcommand parsers are made of the same class."""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if action.choices is not None and value not in action.choices and isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in action.choices], n=1)
            if close:
                choices = ", ".join(map(repr, action.choices))
                raise argparse.ArgumentError(action, f"invalid choice: {value!r}; did you mean {close[0]!r}? "
                                                     f"(choose from {choices})")
        super()._check_value(action, value)


def build_parser() -> argparse.ArgumentParser:
    # --debug is accepted before or after the command; SUPPRESS keeps a subcommand's
    # unset default from overwriting a --debug given before it.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback of any error")
    parser = Parser(
        prog="entrenar", parents=[debug],
        description="Fine-tune transformer language models: LoRA/QLoRA, quantization, merging.",
    )
    parser.add_argument("--version", action="version", version=f"entrenar {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        import_module(f"entrenar.cli.{name}").add_parser(commands, parents=[debug])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the process exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # --help, --version and usage errors: argparse's own code
        return stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    debug = getattr(args, "debug", False)
    shown = warnings.showwarning
    if not debug:
        warnings.showwarning = _show_note
    try:
        return args.run(args)
    except BrokenPipeError:  # `entrenar inspect ... | head`: the reader left; stop quietly, as `cat` does
        _silence_stdout()
        return 0
    except EntrenarError as error:
        if debug:
            raise
        if not report_worker_error(error, user_error=True):  # a worker of `train --nproc-per-node`: its launcher prints
            print(f"error: {rank_prefix()}{error.cli or error}", file=sys.stderr)
        return 2
    except OSError as error:
        if debug:
            raise
        if not is_user_os_error(error):
            return _internal(error)
        where = error.filename if error.filename is not None else ""
        if not report_worker_error(error, user_error=True):
            print(f"error: {rank_prefix()}{where}{': ' if where else ''}{error.strerror or error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as bug:
        if debug:
            raise
        wrapped = os_error_in(bug)
        if wrapped is not None:  # safetensors reports a full or read-only disk as its own error type
            if not report_worker_error(wrapped, user_error=True):
                print(f"error: {rank_prefix()}{wrapped.filename}: {wrapped.strerror}", file=sys.stderr)
            return 2
        if type(bug).__name__ == "OutOfMemoryError":  # torch's, without importing torch for every command
            message = out_of_memory_message(bug)
            if not report_worker_error(RuntimeError(message), user_error=True):
                print(f"error: {rank_prefix()}{message}", file=sys.stderr)
            return 2
        return _internal(bug)
    finally:
        warnings.showwarning = shown


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_default_showwarning = warnings.showwarning


def _show_note(message: Warning | str, category: type[Warning], filename: str, lineno: int,
               file: TextIO | None = None, line: str | None = None) -> None:
    """entrenar's own warnings are notes to the user: one line, no source location (--debug shows Python's form)."""
    if not os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep):
        _default_showwarning(message, category, filename, lineno, file, line)
        return
    print(f"note: {rank_prefix()}{message}", file=file or sys.stderr)


def out_of_memory_message(error: Exception) -> str:
    """A device ran out of memory: the machine's limit, not a bug; say what to change (and keep torch's numbers)."""
    first = str(error).split(". See documentation")[0].split("If reserved but unallocated")[0].strip()
    return (f"the device ran out of memory ({first}); lower training.batch_size or data.seq_len, turn on "
            "training.activation_checkpointing, or check what else uses the device "
            "(`entrenar inspect MODEL` estimates what a run needs)")


# OSErrors the user's machine or input causes (a read-only or full disk, a missing or forbidden path, a path
# that is a folder where a file was wanted), as opposed to a bug in entrenar: these name a path to fix.
USER_ERRNOS = frozenset({
    errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOENT, errno.EEXIST,
    errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.ENAMETOOLONG, errno.ELOOP, errno.EFBIG, errno.EMFILE,
    errno.ENFILE, errno.EIO, errno.EXDEV, errno.EBUSY, errno.ETXTBSY,
})


def is_user_os_error(error: OSError) -> bool:
    """An OSError about a path the user chose or the file system they write to (see USER_ERRNOS)."""
    return error.errno in USER_ERRNOS and (error.filename is not None or error.errno in (errno.ENOSPC, errno.EDQUOT))


_RUST_IO = re.compile(r'\(os error (\d+)\)(?: at path "([^"]+)")?')


def os_error_in(error: Exception) -> OSError | None:
    """The user-caused OSError a library reports as text (safetensors: '... (os error 28) at path "..."')."""
    match = _RUST_IO.search(str(error))
    if match is None:
        return None
    code = int(match.group(1))
    folder = os.path.dirname(match.group(2)) if match.group(2) else None
    if code not in USER_ERRNOS or (folder is None and code not in (errno.ENOSPC, errno.EDQUOT)):
        return None
    return OSError(code, os.strerror(code), folder or "the output folder")


def _internal(bug: BaseException) -> int:
    report_worker_error(bug, user_error=False)  # a worker of `train --nproc-per-node`: for its launcher too
    print(f"internal error: {rank_prefix()}{type(bug).__name__}: {bug}", file=sys.stderr)
    print("this is a bug in entrenar; run again with --debug for the traceback and report it", file=sys.stderr)
    return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so Python's flush at exit does not raise a second BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (a test's capture): nothing to flush
        pass


if __name__ == "__main__":
    sys.exit(main())
