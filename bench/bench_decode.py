"""Decode speed of entrenar's batched sampler, eager against the decode step replayed from a CUDA graph.

What GRPO's rollout runs (`entrenar.generation.batched.generate_batch`): a random model of the Llama-3.2-1B shape in
bf16 with LoRA r=16 alpha 32 on every linear layer (unmerged, B not zero) and the fused kernels (`kernels: auto` on
a GPU with Triton), 8 prompts of 128 random tokens, 256 new tokens each sampled at temperature 1 with a CPU
generator as GRPO's (no stop token: every row runs 256 steps), and greedily (temperature 0: no copy of the
probabilities to the host, the decode alone). One process: a short call eager and one graphed (Triton compiles,
cuBLAS warms up), then --repeats rounds of the four rows; tokens/s = 8 x 256 / the call's time (prefill, and for
the graphed rows the warm-up steps and the capture each call makes, included), the median and the range over the
rounds. The greedy tokens of the two decodes are compared too (bf16: a near tie may go either way, so the share that
agrees is printed, not asserted).

    PYTHONPATH=src python3 bench/bench_decode.py --out bench/results/decode.json     # a GPU: well under 60 s
    PYTHONPATH=src python bench/bench_decode.py --tiny                               # CPU smoke test (both eager)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_train import SHAPES  # noqa: E402 (the Llama-3.2-1B shape)

from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters  # noqa: E402
from entrenar.generation.batched import SamplingConfig, generate_batch  # noqa: E402
from entrenar.kernels import apply_kernels  # noqa: E402
from entrenar.models.config import ModelConfig  # noqa: E402
from entrenar.models.transformer import Transformer  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
        "vocab_size": 512}


def build(tiny: bool, kernels: bool) -> Transformer:
    cuda = torch.cuda.is_available()
    fields = {**SHAPES["llama-1b"], **(TINY if tiny else {})}
    config = ModelConfig(**fields, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = Transformer(config)
    model = model.to(torch.bfloat16 if cuda else torch.float32)
    model.reset_parameters()
    apply_lora(model, LoraConfig(r=16, alpha=32.0, target_modules=TARGETS))
    with torch.no_grad():
        for p in lora_parameters(model):
            p.normal_(0, 0.01)
    if kernels:
        apply_kernels(model)
    return model


def timed(model: Transformer, prompts: list[list[int]], cfg: SamplingConfig) -> tuple[float, str, torch.Tensor]:
    """Seconds of one call, how its decode step ran, and its tokens."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate_batch(model, prompts, cfg, generator=torch.Generator().manual_seed(0))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out.decode, out.completion_ids


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8, help="sequences decoded together")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new", type=int, default=256, help="new tokens a sequence")
    p.add_argument("--repeats", type=int, default=2, help="timed calls of each row")
    p.add_argument("--no-kernels", action="store_true", help="the PyTorch paths instead of the fused kernels")
    p.add_argument("--tiny", action="store_true", help="toy sizes (a CPU smoke test, not a measurement)")
    p.add_argument("--out", default="", help="JSON results file")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompt, args.new, args.repeats = 8, 8, 1
    model = build(args.tiny, not args.no_kernels)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, vocab, (args.rows, args.prompt), generator=gen).tolist()
    graphed = "auto" if args.tiny else True
    rows = {f"{mode} {kind}": (graphs, temperature) for kind, temperature in (("sampled", 1.0), ("greedy", 0.0))
            for mode, graphs in (("eager", False), ("graphed", graphed))}
    for graphs in (False, graphed):  # short first calls: Triton compiles, cuBLAS warms up
        timed(model, prompts, SamplingConfig(max_new_tokens=min(8, args.new), cuda_graphs=graphs))
    results: dict[str, dict] = {name: {"calls_s": []} for name in rows}
    completions: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for name, (graphs, temperature) in rows.items():
            cfg = SamplingConfig(max_new_tokens=args.new, temperature=temperature, cuda_graphs=graphs)
            seconds, results[name]["decode"], completions[name] = timed(model, prompts, cfg)
            results[name]["calls_s"].append(round(seconds, 4))
    tokens = args.rows * args.new
    for r in results.values():
        rates = [tokens / s for s in r["calls_s"]]
        r.update(tokens_per_s=round(statistics.median(rates), 1), min_tokens_per_s=round(min(rates), 1),
                 max_tokens_per_s=round(max(rates), 1))
    agree = float((completions["eager greedy"] == completions["graphed greedy"]).float().mean())
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"decode: {device}, Llama-3.2-1B shape{' (tiny)' if args.tiny else ''}, LoRA r16 unmerged, "
          f"kernels {'off' if args.no_kernels else 'on'}, {args.rows} x {args.new} new tokens after "
          f"{args.prompt}-token prompts, torch {torch.__version__}")
    print(f"{'row':<16} {'tokens/s':>10} {'range':>19}  decode")
    for name, r in results.items():
        print(f"{name:<16} {r['tokens_per_s']:>10,.0f} {r['min_tokens_per_s']:>9,.0f}-{r['max_tokens_per_s']:<9,.0f}"
              f"  {r['decode']}")
    speedup = {kind: round(results[f"graphed {kind}"]["tokens_per_s"] / results[f"eager {kind}"]["tokens_per_s"], 3)
               for kind in ("sampled", "greedy")}
    print(f"graphed / eager: sampled {speedup['sampled']:.2f}x, greedy {speedup['greedy']:.2f}x; "
          f"greedy tokens agreeing: {agree:.1%}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": args.rows,
                                              "prompt": args.prompt, "new": args.new, "kernels": not args.no_kernels,
                                              "results": results, "speedup": speedup,
                                              "greedy_agreement": agree}, indent=1) + "\n")


if __name__ == "__main__":
    main()
