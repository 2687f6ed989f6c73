"""``entrenar quantize``: post-training quantization of a model into a folder ``entrenar.load`` reads back."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from entrenar.cli.eval import add_eval_args
from entrenar.cli.options import DTYPE_CHOICES, device, positive_int

if TYPE_CHECKING:
    from entrenar.export.quantize import QuantizeResult


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "quantize", parents=parents, help="quantize a model's linear layers (nf4, int8, int4)",
        description="Quantize every linear layer but the output head and write a model folder that "
                    "entrenar loads back. Prints each layer's error and, with --data, the perplexity change.",
    )
    parser.add_argument("model", metavar="MODEL",
                        help="Hugging Face model folder, .gguf file, a full fine-tune's run folder, or a Hub id "
                             "(org/name[@revision])")
    parser.add_argument("--method", required=True, metavar="METHOD",
                        help="nf4 (QLoRA's 4-bit NormalFloat), int8 or int4 (also int2 to int7)")
    parser.add_argument("--output", required=True, metavar="DIR", help="folder to write (never the input)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier output in DIR (files quantize does not write are kept)")
    parser.add_argument("--group-size", type=positive_int, default=None, metavar="G",
                        help="weights per scale: the NF4 block size (default 64) or the integer group size "
                             "(default: one scale per output channel); e.g. 32, 64, 128. It must divide every "
                             "layer's input width; a size that does not is refused before any work, with sizes "
                             "that fit")
    parser.add_argument("--asymmetric", action="store_true",
                        help="integer methods: a zero point per group (default: symmetric around 0)")
    parser.add_argument("--calibration", choices=("minmax", "percentile"), default="minmax",
                        help="integer methods: scale from each group's range, or from a percentile of it")
    parser.add_argument("--percentile", type=float, default=None, metavar="P",
                        help="with --calibration percentile: the percentile in (0, 100] (default 99.9)")
    parser.add_argument("--data", metavar="FILE",
                        help="measure perplexity on this data file before and after, as entrenar eval does (a "
                             "run folder's recipe gives seq_len, train_on, add_eos and field names)")
    add_eval_args(parser, when="with --data: ")
    parser.add_argument("--device", type=device, default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="dtype to load and compute in (auto: bf16 on CUDA, else fp32)")
    parser.add_argument("--verify", choices=("none", "quick", "full"), default="quick",
                        help="read the written folder back and compare it with MODEL on held-out data (--data, "
                             "else built-in texts): quick (default) a few hundred tokens, full all; "
                             "writes export_report.json in it")
    parser.add_argument("--max-kl", type=float, default=0.1, metavar="NATS",
                        help="KL divergence per token beyond which the quantized model is flagged (default 0.1)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when the verification flags the folder")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from entrenar.export.quantize import quantize_pretrained

    result = quantize_pretrained(
        args.model, args.output, args.method, group_size=args.group_size, symmetric=not args.asymmetric,
        calibration=args.calibration, percentile=args.percentile, data=args.data, dtype=args.dtype,
        device=args.device, seq_len=args.seq_len, batch_size=args.batch_size, train_on=args.train_on,
        add_eos=args.add_eos, overwrite=args.overwrite,
    )
    print(report(result))
    if args.verify == "none":
        return 0
    from entrenar.export.verify import verify_export

    checked = verify_export(args.model, None, [result.output], args.verify, args.data, max_kl=args.max_kl)
    for line in checked.lines():
        print(line)
    return 1 if args.strict and checked.problems else 0


def report(result: QuantizeResult) -> str:
    """The per-layer error table, the perplexity change and what was written."""
    width = max(len("layer"), *(len(e.name) for e in result.layers))
    lines = [f"{'layer':<{width}}  {'rel. Frobenius':>14}  {'max abs':>10}"]
    lines += [f"{e.name:<{width}}  {e.rel_frobenius:>14.3e}  {e.max_abs:>10.3e}" for e in result.layers]
    worst = max(result.layers, key=lambda e: e.rel_frobenius)
    mean = sum(e.rel_frobenius for e in result.layers) / len(result.layers)
    lines.append(f"{len(result.layers)} layers: mean relative error {mean:.3e}, worst {worst.rel_frobenius:.3e} "
                 f"({worst.name})")
    if result.before is not None and result.after is not None:
        if result.rules is not None and result.rules.from_recipe:
            lines.append(f"using the run's recipe ({result.run_dir}/recipe.yaml): {result.rules.describe()}")
        b, a = result.before, result.after
        change = a.perplexity - b.perplexity
        lines.append(f"perplexity {b.perplexity:.3f} -> {a.perplexity:.3f} ({change:+.3f}, "
                     f"{change / b.perplexity:+.2%}); loss {b.loss:.4f} -> {a.loss:.4f} ({b.tokens:,} tokens)")
    c = result.config
    layout = (f"group size {c['blocksize']}" if c["method"] == "nf4" else
              f"{c['granularity']}" + (f" {c['group_size']}" if c["group_size"] else "")
              + (", symmetric" if c["symmetric"] else ", asymmetric"))
    lines.append(f"wrote {result.output} ({result.method}, {layout}; quantized weights "
                 f"{_size(result.bytes_before)} -> {_size(result.bytes_after)})")
    if result.disk_before:
        lines.append(f"on disk {_size(result.disk_before)} -> {_size(result.disk_after)} "
                     f"({result.disk_after / result.disk_before:.0%} of the input; unquantized weights "
                     f"in {result.dtype})")
    return "\n".join(lines)


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"
