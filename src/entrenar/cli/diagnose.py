"""``entrenar diagnose``: where low precision diverges from fp32, on the first batch of a recipe."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "diagnose", parents=parents, help="compare one training step in fp32 and in bf16/fp16",
        description="Build the model and first training batch of RECIPE as `train` would, run one forward and "
                    "backward in fp32 and in --precision from the same weights, and report per parameter the "
                    "gradient norms, ratio, relative difference and cosine; the largest logit difference; MoE "
                    "routing changes; non-finite values; and a verdict (ok / suspect / broken). Exit code 0 "
                    "whatever the verdict.",
        epilog="Thresholds and how to read the report: docs/EXPERIMENTS.md.",
    )
    parser.add_argument("recipe", metavar="RECIPE", help="YAML recipe")
    parser.add_argument("--precision", choices=("bf16", "fp16"), default="bf16",
                        help="the low precision to compare with fp32 (default bf16)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a recipe key, e.g. --set data.seq_len=512 (repeatable)")
    parser.add_argument("--top", type=_positive, default=20, metavar="N",
                        help="parameters the table shows, worst first (default 20)")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    parser.set_defaults(run=run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    from entrenar.config import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # before importing torch: a bad recipe fails at once
    from entrenar.experiments.diagnose import diagnose, format_report

    report = diagnose(recipe, args.precision, say=lambda text: print(text, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report, top=args.top))
    return 0
