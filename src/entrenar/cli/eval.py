"""``entrenar eval``: loss and perplexity of a model (and adapter) over a data file."""

from __future__ import annotations

import argparse

from entrenar.cli.options import add_model_args, load_model, positive_int


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "eval", parents=parents, help="loss and perplexity over a data file",
        description="Loss and perplexity of a model, with an optional adapter, over a data file.",
    )
    add_model_args(parser)
    parser.add_argument("--data", required=True, metavar="FILE", help="JSONL/JSON/CSV/Parquet/text file or folder")
    parser.add_argument("--seq-len", type=positive_int, default=512, metavar="T",
                        help="tokens per sequence (default 512)")
    parser.add_argument("--batch-size", type=positive_int, default=4, metavar="B",
                        help="sequences per batch (default 4)")
    parser.add_argument("--train-on", choices=("all", "completion"), default="all",
                        help="which tokens count: all, or only completions/assistant turns (default all)")
    parser.add_argument("--no-eos", dest="add_eos", action="store_false",
                        help="do not end each text example with EOS (as a recipe with data.add_eos: false trains)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from entrenar.evaluate import evaluate_file

    model, tokenizer = load_model(args)
    result = evaluate_file(model, tokenizer, args.data, args.seq_len, args.batch_size, args.train_on,
                           add_eos=args.add_eos)
    examples = "" if result.examples is None else f", {result.examples:,} examples"
    print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  ({result.tokens:,} tokens{examples})")
    return 0
