"""``entrenar merge``: merge models as a mergekit YAML config says, streamed tensor by tensor."""

from __future__ import annotations

import argparse
import sys


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "merge", parents=parents, help="merge models (mergekit YAML: linear, slerp, ties, dare, ...)",
        description="Merge models or LoRA fine-tunes as a mergekit YAML config says; writes a Hugging Face folder. "
                    "When every model is a PEFT LoRA adapter folder, the output is one adapter.",
    )
    parser.add_argument("config", metavar="CONFIG", nargs="?", help="merge config (mergekit's YAML format)")
    parser.add_argument("--output", required=True, metavar="DIR", help="folder to write the merged model to")
    parser.add_argument("--dry-run", action="store_true",
                        help="check every input's shapes, dtypes, vocabulary and architecture and print the plan; "
                             "read no weights, write nothing")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier output in DIR (files the merge does not write are kept)")
    parser.add_argument("--gguf", default=None, metavar="TYPE", help="also write OUT/model-TYPE.gguf (f16, q8_0, ...)")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the random methods (DARE, DELLA); default: the config's, else 0")
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="largest safetensors shard (default 5GB)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    parser.set_defaults(run=run)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    from entrenar.errors import ConfigError

    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    try:
        value = int(float(number) * units[t[len(number):]])
    except (ValueError, KeyError):
        raise ConfigError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB") from None
    if value <= 0:
        raise ConfigError(f"--max-shard-size {text!r} must be positive")
    return value


def run(args: argparse.Namespace) -> int:
    from entrenar.errors import ConfigError
    from entrenar.merge import merge
    from entrenar.train.console import interactive

    if args.config is None:
        raise ConfigError("entrenar merge: give a CONFIG file (mergekit YAML)")

    live = interactive(sys.stderr)  # a terminal: one line redrawn; a log: a whole line every tenth of the way

    def progress(done: int, total: int, name: str) -> None:
        if live and (done == total or done % 8 == 0):
            print(f"\rmerged {done}/{total} tensors", end="\n" if done == total else "", file=sys.stderr, flush=True)
        elif not live and (done == total or done * 10 // total != (done - 1) * 10 // total):
            print(f"merged {done}/{total} tensors", file=sys.stderr, flush=True)

    plan = merge(args.config, args.output, dry_run=args.dry_run, gguf=args.gguf, seed=args.seed,
                 overwrite=args.overwrite,
                 max_shard_bytes=parse_size(args.max_shard_size),
                 progress=None if args.quiet or args.dry_run else progress)
    if isinstance(plan, list):  # adapters merged into one adapter
        print("\n".join(plan))
    elif args.dry_run:
        print(plan.summary())
    if args.dry_run:
        print(f"dry run: nothing written (would write {args.output})")
    else:
        print(f"wrote {args.output}")
    return 0
