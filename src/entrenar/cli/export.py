"""``entrenar export``: write a model with its adapter as a Hugging Face folder and/or a GGUF file."""

from __future__ import annotations

import argparse


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "export", parents=parents, help="merge or convert a model and adapter",
        description="Export a model with its LoRA adapter: merged into the weights, and/or as a GGUF file.",
    )
    parser.add_argument("model", metavar="MODEL", help="base model: Hugging Face folder or .gguf file")
    parser.add_argument("--adapter", required=True, metavar="DIR", help="LoRA adapter folder (PEFT format)")
    parser.add_argument("--output", required=True, metavar="OUT", help="where to write")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the base weights")
    parser.add_argument("--gguf", choices=("f16", "q8_0"), default=None, help="also write a GGUF file of this type")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from entrenar.export import export

    for path in export(args.model, args.adapter, args.output, merge=args.merge, gguf=args.gguf):
        print(f"wrote {path}")
    return 0
