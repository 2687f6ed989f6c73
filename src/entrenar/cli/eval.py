"""``entrenar eval``: loss and perplexity of a model (and adapter) over a data file."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from entrenar.cli.options import add_model_args, load_model, positive_int

if TYPE_CHECKING:
    from entrenar.config import Recipe

DEFAULTS = {"seq_len": 512, "train_on": "all", "add_eos": True}  # without a run's recipe


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "eval", parents=parents, help="loss and perplexity over a data file",
        description="Loss and perplexity of a model, with an optional adapter, over a data file. Given a "
                    "training run (as MODEL or --adapter), its recipe's data.seq_len, data.train_on and "
                    "data.add_eos are used unless a flag says otherwise (and its data.format and field names), so the "
                    "loss is the one training measures.",
    )
    add_model_args(parser)
    parser.add_argument("--data", required=True, metavar="FILE", help="JSONL/JSON/CSV/Parquet/text file or folder")
    parser.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                        help="tokens per sequence (default: the run's data.seq_len, else 512)")
    parser.add_argument("--batch-size", type=positive_int, default=4, metavar="B",
                        help="sequences per batch (default 4)")
    parser.add_argument("--train-on", choices=("all", "completion"), default=None,
                        help="which tokens count: all, or only completions/assistant turns "
                             "(default: the run's data.train_on, else all)")
    eos = parser.add_mutually_exclusive_group()
    eos.add_argument("--no-eos", dest="add_eos", action="store_const", const=False, default=None,
                     help="do not end each text example with EOS (as a recipe with data.add_eos: false trains; "
                          "default: the run's data.add_eos, else EOS is added)")
    eos.add_argument("--eos", dest="add_eos", action="store_const", const=True,
                     help="end each text example with EOS even if the run's recipe did not")
    parser.set_defaults(run=run)


def settings(args: argparse.Namespace, recipe: Recipe | None) -> dict[str, Any]:
    """seq_len, train_on and add_eos: the flags given, else the run's recipe, else DEFAULTS."""
    chosen = {}
    for key, default in DEFAULTS.items():
        value = getattr(args, key)
        if value is None:
            value = getattr(recipe.data, key) if recipe is not None else default
        chosen[key] = value
    return chosen


def run(args: argparse.Namespace) -> int:
    from entrenar.evaluation.loss import evaluate_file
    from entrenar.loading.runs import resolve_model_and_adapter

    source = resolve_model_and_adapter(args.model, args.adapter)
    chosen = settings(args, source.recipe)
    model, tokenizer = load_model(args, quantize=source.quantize_base)  # a QLoRA run is measured on its NF4 base
    extra: dict[str, Any] = {}  # evaluate_file's keyword arguments
    if source.recipe is not None:  # read the file as training read it: its format and field names
        d = source.recipe.data
        extra = {"fmt": d.format, "columns": {"text": d.text_field, "prompt": d.prompt_field,
                                              "completion": d.completion_field, "messages": d.messages_field}}
    result = evaluate_file(model, tokenizer, args.data, chosen["seq_len"], args.batch_size, chosen["train_on"],
                           add_eos=chosen["add_eos"], **extra)
    examples = "" if result.examples is None else f", {result.examples:,} examples"
    if source.recipe is not None:
        print(f"using the run's recipe ({source.run_dir}/recipe.yaml): seq_len {chosen['seq_len']}, "
              f"train_on {chosen['train_on']}, add_eos {str(chosen['add_eos']).lower()}")
    print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  ({result.tokens:,} tokens{examples})")
    return 0
