"""One MoE layer, forward + backward on the GPU: entrenar's block against transformers' own, same weights.

transformers 5 offers several expert implementations (eager loop, grouped_mm, batched_mm); every one this
transformers has is timed and the fastest is the baseline. entrenar runs its experts as one grouped product
(`torch._grouped_mm`, `moe.experts: auto` on CUDA) and, for reference, as its per-expert loop. Shapes are the
MoE layers of Qwen3-30B-A3B (128 experts, top-8, expert width 768) and OLMoE-1B-7B (64 experts, top-8, width
1024), hidden 2048, on 4 x 2048 tokens in bf16. Outputs of every row are checked against transformers' eager
row before timing.

    PYTHONPATH=src python bench/bench_moe.py --out moe.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

SHAPES = {
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "num_experts": 128, "top_k": 8, "width": 768, "norm_topk": True},
    "olmoe-1b-7b": {"model_type": "olmoe", "num_experts": 64, "top_k": 8, "width": 1024, "norm_topk": False},
}
HIDDEN = 2048


def hf_block(shape: dict, implementation: str):
    import transformers

    kwargs = {"hidden_size": HIDDEN, "num_experts": shape["num_experts"], "num_experts_per_tok": shape["top_k"],
              "norm_topk_prob": shape["norm_topk"], "num_hidden_layers": 1, "num_attention_heads": 16,
              "num_key_value_heads": 4, "experts_implementation": implementation}
    if shape["model_type"] == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        kwargs["moe_intermediate_size"] = shape["width"]
    else:
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block
        kwargs["intermediate_size"] = shape["width"]
    config = transformers.AutoConfig.for_model(shape["model_type"], **kwargs)
    return Block(config)


def entrenar_block(shape: dict, experts: str):
    from entrenar.models.config import ModelConfig
    from entrenar.models.moe import MoeBlock
    from entrenar.models.transformer import MLP

    width = {"moe_intermediate_size": shape["width"]} if shape["model_type"] == "qwen3_moe" else \
        {"intermediate_size": shape["width"]}
    config = ModelConfig(model_type=shape["model_type"], hidden_size=HIDDEN, num_layers=1, num_heads=16,
                         num_kv_heads=4, vocab_size=256, intermediate_size=width.get("intermediate_size", 4096),
                         num_experts=shape["num_experts"], num_experts_per_tok=shape["top_k"],
                         norm_topk_prob=shape["norm_topk"], qk_norm=True,
                         **{k: v for k, v in width.items() if k != "intermediate_size"})
    block = MoeBlock(config, MLP)
    block.experts.implementation = experts  # what set_experts_implementation sets on a whole model
    return block


def copy_weights(src, dst) -> None:
    with torch.no_grad():
        dst.gate.weight.copy_(src.gate.weight)
        dst.experts.gate_up_proj.copy_(src.experts.gate_up_proj)
        dst.experts.down_proj.copy_(src.experts.down_proj)


def time_block(block, x: torch.Tensor, grad: torch.Tensor, steps: int, warmup: int) -> tuple[float, float]:
    """Median ms of forward + backward, and peak GiB allocated during it."""
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        xi = x.detach().requires_grad_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        block(xi).backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
        block.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4 * 2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    torch.manual_seed(0)
    results = []
    for name, shape in SHAPES.items():
        x = torch.randn(1, args.tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        grad = torch.randn_like(x)
        reference = hf_block(shape, "eager").cuda().to(torch.bfloat16)
        with torch.no_grad():
            for param in reference.parameters():
                param.normal_(0.0, 0.02)
            expected = reference(x).float()
        rows = [(f"transformers {impl}", lambda impl=impl: hf_block(shape, impl))
                for impl in ("eager", "grouped_mm", "batched_mm")]
        rows += [(f"entrenar {impl}", lambda impl=impl: entrenar_block(shape, impl)) for impl in ("grouped", "loop")]
        for row, build in rows:
            try:
                block = build().cuda().to(torch.bfloat16)
                copy_weights(reference, block)
                with torch.no_grad():
                    error = (block(x).float() - expected).abs().max().item()
                ms, peak = time_block(block, x, grad, args.steps, args.warmup)
            except Exception as e:  # noqa: BLE001 (an implementation this transformers lacks is reported, not fatal)
                results.append({"shape": name, "row": row, "status": f"failed: {type(e).__name__}: {e}"[:300]})
                print(f"{name:<15}{row:<26}failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            results.append({"shape": name, "row": row, "status": "ok", "ms": ms, "peak_gib": peak,
                            "max_abs_diff_vs_eager": error})
            print(f"{name:<15}{row:<26}{ms:8.2f} ms  {peak:6.2f} GiB  |diff| {error:.3g}", flush=True)
            del block
            torch.cuda.empty_cache()
    for name in SHAPES:
        ok = [r for r in results if r["shape"] == name and r["status"] == "ok"]
        hf = min((r for r in ok if r["row"].startswith("transformers")), key=lambda r: r["ms"], default=None)
        ours = next((r for r in ok if r["row"] == "entrenar grouped"), None)
        if hf and ours:
            print(f"{name}: entrenar grouped {hf['ms'] / ours['ms']:.2f}x the fastest transformers row "
                  f"({hf['row']}), memory {ours['peak_gib'] / hf['peak_gib']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "tokens": args.tokens, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
