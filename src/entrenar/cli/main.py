"""The ``entrenar`` command: parse arguments, call one library function, print its result.

Each command lives in its own module with ``add_parser(subparsers, parents)``,
which sets ``run(args) -> int`` as the parser's default; heavy imports (torch and
the model code) happen inside ``run`` so ``entrenar --help`` stays instant.

Exit codes: 0 success, 2 a user error (``EntrenarError``, or bad arguments),
130 interrupted, 1 a bug in entrenar (an exception that is not a user error).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

from entrenar import __version__
from entrenar.distributed.launch import rank_prefix, report_worker_error
from entrenar.errors import EntrenarError

COMMANDS = ("train", "inspect", "generate", "eval", "chat", "export", "quantize")  # modules of entrenar.cli


def build_parser() -> argparse.ArgumentParser:
    # --debug is accepted before or after the command; SUPPRESS keeps a subcommand's
    # unset default from overwriting a --debug given before it.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show the full traceback of any error")
    parser = argparse.ArgumentParser(
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
    try:
        return args.run(args)
    except EntrenarError as error:
        if debug:
            raise
        if not report_worker_error(error, user_error=True):  # a worker of `train --nproc-per-node`: its launcher prints
            print(f"error: {rank_prefix()}{error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as bug:
        if debug:
            raise
        report_worker_error(bug, user_error=False)
        print(f"internal error: {rank_prefix()}{type(bug).__name__}: {bug}", file=sys.stderr)
        print("this is a bug in entrenar; run again with --debug for the traceback and report it", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
