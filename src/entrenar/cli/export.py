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
    parser.add_argument("--verify", choices=("none", "quick", "full"), default="quick",
                        help="read back what was written and compare it with the model as trained on held-out data "
                             "(quick: a few hundred tokens, default; full: the whole file); writes export_report.json")
    parser.add_argument("--data", metavar="FILE", default=None,
                        help="held-out data for --verify (default: the run's data.validation, else built-in texts)")
    parser.add_argument("--max-kl", type=float, default=0.1, metavar="NATS",
                        help="KL divergence per token beyond which the export is flagged (default 0.1)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the verification flags the export")
    parser.add_argument("--merge-base", choices=("full", "trained"), default="full",
                        help="a QLoRA run's merge: into the full-precision base (default) or the dequantized NF4 "
                             "base the adapter was trained on")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from entrenar.export.verify import export_verified

    written, report = export_verified(args.model, args.adapter, args.output, args.verify, args.data,
                                      max_kl=args.max_kl, merge_base=args.merge_base, merge=args.merge,
                                      gguf=args.gguf, dtype=args.dtype, overwrite=args.overwrite)
    for path in written:
        print(f"wrote {path}")
    if report is None:
        return 0
    for line in report.lines():
        print(line)
    if report.problems:
        print(f"!!! the export differs from the trained model ({len(report.problems)} problems; see the report)")
        return 1 if args.strict else 0
    return 0
