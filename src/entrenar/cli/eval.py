"""``entrenar eval``: loss and perplexity of a model (and adapter) over a data file, or on preference data the
preference metrics TRL logs (held-out accuracy, margins, rewards)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from entrenar.cli.options import add_model_args, load_model, positive_int
from entrenar.config.rules import PREFERENCE_LOSSES

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.evaluation.rules import EvalRules
    from entrenar.loading.runs import ModelSource
    from entrenar.models.transformer import Transformer


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
    add_eval_args(parser)
    preference = parser.add_argument_group(
        "preference data", "pairs ({prompt, chosen, rejected}) or KTO's examples, scored as a preference run's "
        "evaluation (docs/PREFERENCE.md); a preference run's folder brings its task settings")
    preference.add_argument("--loss", choices=PREFERENCE_LOSSES, default=None,
                            help="score the file as preference data with this loss")
    preference.add_argument("--beta", type=float, default=None, help="the loss's beta (default: the run's, else 0.1)")
    preference.add_argument("--reference", metavar="MODEL", default=None,
                            help="the reference model of a full fine-tune (an adapter's reference is its base)")
    parser.add_argument("--compare", metavar="OTHER", default=None,
                        help="a second model (folder, .gguf, run) to compare with MODEL on the data: each one's loss, "
                             "KL divergence, top-1 agreement, chat template, special tokens, stop ids, continuations")
    parser.add_argument("--max-kl", type=float, default=0.1, metavar="NATS",
                        help="with --compare: KL divergence per token beyond which OTHER is flagged (default 0.1)")
    parser.add_argument("--strict", action="store_true", help="with --compare: exit 1 when OTHER is flagged")
    parser.set_defaults(run=run)


def add_eval_args(parser: argparse.ArgumentParser, when: str = "") -> None:
    """--seq-len, --batch-size, --train-on, --eos/--no-eos: how a data file is scored (``entrenar eval``'s rules,
    :mod:`entrenar.evaluation.rules`; ``quantize --data`` takes the same). ``when`` prefixes each help."""
    parser.add_argument("--seq-len", type=positive_int, default=None, metavar="T",
                        help=when + "tokens per sequence (default: the run's data.seq_len, else 512)")
    parser.add_argument("--batch-size", type=positive_int, default=4, metavar="B",
                        help=when + "sequences per batch (default 4)")
    parser.add_argument("--train-on", choices=("all", "completion"), default=None,
                        help=when + "which tokens count: all, or only completions/assistant turns "
                             "(default: the run's data.train_on, else all)")
    eos = parser.add_mutually_exclusive_group()
    eos.add_argument("--no-eos", dest="add_eos", action="store_const", const=False, default=None,
                     help=when + "do not end each text example with EOS (as a recipe with data.add_eos: false trains; "
                          "default: the run's data.add_eos, else EOS is added)")
    eos.add_argument("--eos", dest="add_eos", action="store_const", const=True,
                     help=when + "end each text example with EOS even if the run's recipe did not")


def run(args: argparse.Namespace) -> int:
    from entrenar.evaluation.loss import evaluate_file
    from entrenar.evaluation.rules import eval_rules
    from entrenar.loading.runs import resolve_model_and_adapter

    source = resolve_model_and_adapter(args.model, args.adapter)
    if args.loss is not None or (source.recipe is not None and source.recipe.task.type == "preference"):
        return _preference(args, source)
    rules = eval_rules(source.recipe, args.seq_len, args.train_on, args.add_eos)
    model, tokenizer = load_model(args, quantize=source.quantize_base)  # a QLoRA run is measured on its NF4 base
    if args.compare is not None:
        return _compare(args, model, tokenizer, rules)
    result = evaluate_file(model, tokenizer, args.data, batch_size=args.batch_size, **rules.kwargs())
    examples = "" if result.examples is None else f", {result.examples:,} examples"
    if rules.from_recipe:
        print(f"using the run's recipe ({source.run_dir}/recipe.yaml): {rules.describe()}")
    print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.3f}  ({result.tokens:,} tokens{examples})")
    return 0


def _compare(args: argparse.Namespace, model: Transformer, tokenizer: Tokenizer, rules: EvalRules) -> int:
    """``--compare OTHER``: the comparison ``entrenar export`` verifies with, MODEL as the reference."""
    from entrenar.evaluation.compare import compare_models, format_comparison, held_out_batches
    from entrenar.loading import load, require_tokenizer

    other, other_tokenizer = load(args.compare, dtype=args.dtype, device=args.device)
    batches, _ = held_out_batches(tokenizer, args.data, rules, args.batch_size)
    comparison = compare_models(model, tokenizer, other, require_tokenizer(other_tokenizer, args.compare), batches,
                                max_kl=args.max_kl)
    for line in format_comparison(comparison, "model", "other"):
        print(line)
    return 1 if args.strict and comparison.problems() else 0


def _preference(args: argparse.Namespace, source: ModelSource) -> int:
    """The preference metrics of the model (and adapter) on ``--data``."""
    from entrenar.config.sections import TaskSection
    from entrenar.loading import load
    from entrenar.tasks.preference import evaluate_preference_file

    run_task = source.recipe.task if source.recipe is not None and source.recipe.task.type == "preference" else None
    task = run_task or TaskSection(type="preference")
    if args.loss is not None and args.loss != task.loss:  # another loss: its own defaults, not the run's settings
        task = TaskSection(type="preference", loss=args.loss)
    if args.beta is not None:
        task = dataclasses.replace(task, beta=args.beta)
    lora = source.adapter is not None or source.checkpoint is not None
    seq_len = args.seq_len or (source.recipe.data.seq_len if source.recipe is not None else 512)
    model, tokenizer = load_model(args, quantize=source.quantize_base)
    reference = load(args.reference, dtype=args.dtype, device=args.device)[0] if args.reference else None
    result = evaluate_preference_file(model, tokenizer, args.data, task, seq_len=seq_len, batch_size=args.batch_size,
                                      lora=lora, reference=reference)
    if run_task is not None:
        print(f"using the run's task settings ({source.run_dir}/recipe.yaml): loss {task.loss}, beta {task.beta:g}")
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in result.metrics.items())
    print(f"loss {result.loss:.4f}  {metrics}  ({result.examples:,} {'examples' if task.loss == 'kto' else 'pairs'})")
    return 0
