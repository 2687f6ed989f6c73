"""``entrenar export``: write a model (with its adapter, if any) as an adapter, a Hugging Face folder or a GGUF file."""

from __future__ import annotations

import argparse

from entrenar.cli.options import ADAPTER_HELP, DTYPE_CHOICES, MODEL_HELP

# entrenar.export.gguf_write.GGUF_TYPES (not imported: keeps --help fast)
GGUF_TYPES = ("f32", "f16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_1", "q4_0")


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "export", parents=parents, help="merge or convert a model (and adapter) to a folder or GGUF",
        description="Export a model: with --adapter, the adapter re-saved, or merged into the weights (--merge); "
                    "without one (a full fine-tune, any model), the model itself. --gguf writes a GGUF file for "
                    "llama.cpp (merging first). An existing non-empty output needs --overwrite, which replaces "
                    "only the files export writes.",
    )
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--adapter", metavar="DIR", help=ADAPTER_HELP)
    parser.add_argument("--output", required=True, metavar="OUT",
                        help="folder to write, or a .gguf file (with --gguf) to write only that")
    parser.add_argument("--merge", action="store_true", help="merge the adapter into the base weights")
    parser.add_argument("--gguf", choices=GGUF_TYPES, default=None,
                        help="also write a GGUF file of this type (implies --merge)")
    parser.add_argument("--dtype", default=None, choices=[d for d in DTYPE_CHOICES if d != "auto"],
                        help="dtype of the written weights (default: the input's stored dtype)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier output in OUT (files export does not write are kept)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from entrenar.export import export

    for path in export(args.model, args.adapter, args.output, merge=args.merge, gguf=args.gguf, dtype=args.dtype,
                       overwrite=args.overwrite):
        print(f"wrote {path}")
    return 0
