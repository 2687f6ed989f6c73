"""``entrenar classify eval|predict``: a trained classifier's report on a labeled file, or its predictions."""

from __future__ import annotations

import argparse

from entrenar.cli.options import add_model_args, load_model, positive_int


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "classify", parents=parents, help="evaluate a classifier (report) or predict labels",
        description="A sequence classifier (a *ForSequenceClassification folder, or a base with a SEQ_CLS adapter): "
                    "its report on a labeled file, or predictions with calibrated probabilities.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    evaluate = actions.add_parser("eval", parents=parents, help="report: accuracy, F1, calibration, CIs")
    predict = actions.add_parser("predict", parents=parents, help="one JSON line per text: label(s), probabilities")
    for sub in (evaluate, predict):
        add_model_args(sub)
        sub.add_argument("--data", required=True, metavar="FILE", help="JSONL/JSON/CSV/Parquet/text file or folder")
        sub.add_argument("--text-field", default="text", metavar="NAME", help="field holding the text (default text)")
        sub.add_argument("--seq-len", type=positive_int, default=512, metavar="T", help="tokens kept per text (512)")
        sub.add_argument("--batch-size", type=positive_int, default=8, metavar="B", help="texts per batch (default 8)")
    evaluate.add_argument("--label-field", default="label", metavar="NAME", help="field holding the label (label)")
    evaluate.add_argument("--output", metavar="DIR", help="folder for report.json, report.md and the PNGs")
    evaluate.add_argument("--seed", type=int, default=0, metavar="S", help="bootstrap seed (default 0)")
    predict.add_argument("--output", required=True, metavar="FILE", help="predictions, JSON lines")
    evaluate.set_defaults(run=run_eval)
    predict.set_defaults(run=run_predict)


def _load_classifier(args: argparse.Namespace):
    """The classifier and tokenizer MODEL (and --adapter) name; a language model is refused by name."""
    from entrenar.errors import ModelError
    from entrenar.models.classifier import SequenceClassifier

    model, tokenizer = load_model(args)
    if not isinstance(model, SequenceClassifier):
        where = args.model + (f" with adapter {args.adapter}" if args.adapter else "")
        raise ModelError(f"{where}: not a classification model (a language model: no 'score' head); train one with "
                         "task.type: classification, or load a *ForSequenceClassification folder")
    return model, tokenizer


def run_eval(args: argparse.Namespace) -> int:
    from entrenar.tasks.classification import evaluate_file

    model, tokenizer = _load_classifier(args)
    report = evaluate_file(model, tokenizer, args.data, args.output, args.text_field, args.label_field, args.seq_len,
                           args.batch_size, seed=args.seed)
    print(f"{report['examples']:,} examples ({report['problem_type']})")
    for name, v in report["headline"].items():
        print(f"{name:<12}{v['value']:.4f}  95% CI [{v['ci'][0]:.4f}, {v['ci'][1]:.4f}]")
    if "uncalibrated" in report:
        t = report["calibration"].get("temperature", 1.0)
        print(f"{'ECE':<12}{report['uncalibrated']['ece']:.4f} at T=1, {report['metrics']['ece']:.4f} at T={t:.3g} "
              f"({report['ece_bins']} bins)")
    for note in report.get("notes", []):
        print(f"note        {note}")
    if args.output:
        print(f"report      {args.output}/report.md")
    return 0


def run_predict(args: argparse.Namespace) -> int:
    from entrenar.tasks.classification import predict_file

    model, tokenizer = _load_classifier(args)
    n = predict_file(model, tokenizer, args.data, args.output, args.text_field, args.seq_len, args.batch_size)
    print(f"{n:,} predictions -> {args.output}")
    return 0
