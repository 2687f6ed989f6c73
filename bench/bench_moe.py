"""One MoE layer, forward + backward on the GPU: entrenar's block against transformers' own, same weights.

transformers 5 offers several expert implementations (eager loop, grouped_mm, batched_mm); every one this
transformers has is timed and the fastest is the baseline. entrenar runs its experts as one grouped product
(`torch._grouped_mm`, `moe.experts: auto` on CUDA), with and without the fused routing steps that
`training.kernels` applies (kernels/moe_routing.py), and, for reference, as its per-expert loop. A last row
times the six grouped products alone: the floor of any block built on `torch._grouped_mm`. Shapes are the
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


def entrenar_block(shape: dict, experts: str, kernels: bool = False):
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
    if kernels:  # what `training.kernels: auto` applies on a GPU: the fused routing steps (kernels/moe_routing.py)
        from entrenar.kernels import apply_kernels
        apply_kernels(block, ("moe_routing",))
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


class GemmsOnly(torch.nn.Module):
    """The layer's six grouped products and nothing else (gate_up and down forward, their dx and dW in backward),
    on the tokens as the reference router sorts them: the floor any implementation built on
    ``torch._grouped_mm`` stands on."""

    def __init__(self, reference, x: torch.Tensor, top_k: int) -> None:
        super().__init__()
        from entrenar.models.moe import expert_offsets
        with torch.no_grad():
            logits = reference.gate(x.view(-1, HIDDEN))
            logits = logits[0] if isinstance(logits, tuple) else logits
            experts = logits.float().topk(top_k, dim=-1)[1].reshape(-1)
        sorted_experts = experts.sort(stable=True)[0]
        self.offsets = expert_offsets(sorted_experts, reference.experts.gate_up_proj.shape[0])
        self.width = reference.experts.down_proj.shape[-1]
        self.gate_up = torch.nn.Parameter(reference.experts.gate_up_proj.detach().clone())
        self.down = torch.nn.Parameter(reference.experts.down_proj.detach().clone())
        self.rows = torch.nn.Parameter(torch.randn(experts.numel(), HIDDEN, device=x.device, dtype=x.dtype))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch._grouped_mm(self.rows, self.gate_up.transpose(1, 2), offs=self.offsets)[:, :self.width]
        y = torch._grouped_mm(h.contiguous(), self.down.transpose(1, 2), offs=self.offsets)
        return y.view(x.shape[0], -1, self.top_k, HIDDEN)[:, :, 0] + 0 * x


def kernel_profile(block, x: torch.Tensor, grad: torch.Tensor, steps: int = 5) -> list[dict]:
    """CUDA kernel time per step by kernel name, largest first: where a row's milliseconds go."""
    from torch.profiler import ProfilerActivity, profile

    def step() -> None:
        block(x.detach().requires_grad_()).backward(grad)
        block.zero_grad(set_to_none=True)  # as time_block: no gradient accumulation kernels

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            entry = totals.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.device_time / 1000 / steps
            entry[1] += 1 / steps
    return sorted(({"kernel": k, "ms": v[0], "calls": v[1]} for k, v in totals.items()), key=lambda r: -r["ms"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4 * 2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="")
    p.add_argument("--profile", action="store_true", help="also record each grouped row's CUDA kernels")
    p.add_argument("--rows", default="", help="comma-separated row names to run (default: all)")
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
        rows.append(("entrenar grouped+kernels", lambda: entrenar_block(shape, "grouped", kernels=True)))
        rows.append(("grouped GEMMs alone", lambda: GemmsOnly(reference, x, shape["top_k"])))
        wanted = set(filter(None, args.rows.split(",")))
        for row, build in rows:
            if wanted and row not in wanted:
                continue
            try:
                block = build().cuda().to(torch.bfloat16)
                if row == "grouped GEMMs alone":
                    error = float("nan")
                else:
                    copy_weights(reference, block)
                    with torch.no_grad():
                        error = (block(x).float() - expected).abs().max().item()
                ms, peak = time_block(block, x, grad, args.steps, args.warmup)
                kernels = kernel_profile(block, x, grad) if args.profile and "eager" not in row and "loop" not in row \
                    else None
            except Exception as e:  # noqa: BLE001 (an implementation this transformers lacks is reported, not fatal)
                results.append({"shape": name, "row": row, "status": f"failed: {type(e).__name__}: {e}"[:300]})
                print(f"{name:<15}{row:<26}failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            results.append({"shape": name, "row": row, "status": "ok", "ms": ms, "peak_gib": peak,
                            "max_abs_diff_vs_eager": error, **({"kernels": kernels[:25]} if kernels else {})})
            busy = f"  GPU kernels {sum(k['ms'] for k in kernels):.2f} ms" if kernels else ""
            print(f"{name:<15}{row:<26}{ms:8.2f} ms  {peak:6.2f} GiB  |diff| {error:.3g}{busy}", flush=True)
            for k in (kernels or [])[:12]:
                print(f"    {k['ms']:7.3f} ms {k['calls']:5.1f}x  {k['kernel']}", flush=True)
            del block
            torch.cuda.empty_cache()
    for name, shape in SHAPES.items():
        ok = [r for r in results if r["shape"] == name and r["status"] == "ok"]
        hf = min((r for r in ok if r["row"].startswith("transformers")), key=lambda r: r["ms"], default=None)
        floor = next((r for r in ok if r["row"] == "grouped GEMMs alone"), None)
        if hf and floor:
            print(f"{name}: the grouped products alone take {floor['ms']:.2f} ms = {floor['ms'] / hf['ms']:.0%} of "
                  f"{hf['row']}; 3x would be {hf['ms'] / 3:.2f} ms")
            gemm = sum(k["ms"] for k in floor.get("kernels", []) if "cutlass" in k["kernel"] or "gemm" in k["kernel"])
            if gemm:
                print(f"{name}: of which {gemm:.2f} ms in the grouped GEMM kernels themselves")
            flop = 3 * 2 * args.tokens * shape["top_k"] * HIDDEN * 3 * shape["width"]  # fwd + dx + dW
            print(f"{name}: {flop / 1e12:.2f} TFLOP of products; alone {flop / floor['ms'] / 1e9:.0f} TFLOP/s, "
                  f"3x needs the whole layer at {flop / (hf['ms'] / 3) / 1e9:.0f} TFLOP/s")
        ours = min((r for r in ok if r["row"].startswith("entrenar grouped")), key=lambda r: r["ms"], default=None)
        if hf and ours:
            print(f"{name}: {ours['row']} {hf['ms'] / ours['ms']:.2f}x the fastest transformers row "
                  f"({hf['row']}), memory {ours['peak_gib'] / hf['peak_gib']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "tokens": args.tokens, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
