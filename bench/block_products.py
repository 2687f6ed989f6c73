"""Time one decoder block's matrix products and attention, arranged several ways, on the GPU.

Answers "what would a different arrangement of the same arithmetic earn" before it is built into the model:
separate q/k/v (gate/up) products against one product over their stacked weights, the LoRA sum added after
the base product (what the nodes do now) against the adapter folded into the base product as extra columns
of the input, and each SDPA backend on the block's attention. Shapes default to Llama-3.2-1B at batch 4 x 2048.

    PYTHONPATH=src python3 bench/block_products.py --out block_products.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from bench_nf4 import median_ms


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02


def products(tokens: int, hidden: int, inter: int, q_out: int, kv_out: int, rank: int, vocab: int,
             chunk: int) -> list[dict]:
    """Rows of {name, ms, tflops} for the block's products in each arrangement."""
    rows = []

    def row(name: str, fn, flop: float) -> None:
        ms = median_ms(fn, reps=30, warmup=5)
        rows.append({"name": name, "ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1)})

    x = rand(tokens, hidden)
    groups = {"qkv": [q_out, kv_out, kv_out], "gate_up": [inter, inter]}
    for group, outs in groups.items():
        ws = [rand(n, hidden) for n in outs]
        stacked = torch.cat(ws)
        n_all = sum(outs)
        flop = 2.0 * tokens * hidden * n_all
        row(f"{group} forward, one product each", lambda: [F.linear(x, w) for w in ws], flop)
        row(f"{group} forward, one stacked product", lambda: F.linear(x, stacked), flop)
        # LoRA: A x for all adapters at once, then each B added to its output (the nodes' way) ...
        a = rand(rank * len(outs), hidden)
        bs = [rand(n, rank) for n in outs]
        base = [F.linear(x, w) for w in ws]
        xa = x @ a.T

        def add_after():
            for out, b, i in zip(base, bs, range(len(outs))):
                out.addmm_(xa[:, i * rank:(i + 1) * rank], b.T, alpha=2.0)
        row(f"{group} adapter sums after the base products (addmm_)", add_after, 2.0 * tokens * rank * n_all)
        # ... against the adapter as extra input columns: [x | s A x] @ [W | B]^T, one product.
        x_ext = torch.cat([x, xa], dim=1)
        w_ext = torch.zeros(n_all, hidden + rank * len(outs), device="cuda", dtype=torch.bfloat16)
        w_ext[:, :hidden] = stacked
        start = 0
        for i, (n, b) in enumerate(zip(outs, bs)):
            w_ext[start:start + n, hidden + i * rank:hidden + (i + 1) * rank] = b
            start += n
        row(f"{group} forward with adapters folded in (K={hidden + rank * len(outs)})",
            lambda: F.linear(x_ext, w_ext), 2.0 * tokens * (hidden + rank * len(outs)) * n_all)
        # Backward, input gradient: each g_i W_i accumulated, against one product over the stacked gradients.
        gs = [rand(tokens, n) for n in outs]
        g_stacked = torch.cat(gs, dim=1)

        def dx_each():
            dx = gs[0] @ ws[0]
            for g, w in zip(gs[1:], ws[1:]):
                dx.addmm_(g, w)
            return dx
        row(f"{group} input gradient, one product each", dx_each, flop)
        row(f"{group} input gradient, one stacked product", lambda: g_stacked @ stacked, flop)
        # the adapters' backward reads g twice more: u = g B and dB = g^T (A x)
        row(f"{group} adapter backward reads of g (g B, g^T Ax)",
            lambda: [(g @ b, g.T @ xa[:, :rank]) for g, b in zip(gs, bs)], 4.0 * tokens * rank * n_all)
    # the rest of the block and the head
    w_o, w_down = rand(hidden, q_out), rand(hidden, inter)
    h = rand(tokens, inter)
    attn = rand(tokens, q_out)
    row("o forward", lambda: F.linear(attn, w_o), 2.0 * tokens * q_out * hidden)
    row("down forward", lambda: F.linear(h, w_down), 2.0 * tokens * inter * hidden)
    g_h = rand(tokens, hidden)
    row("down input gradient", lambda: g_h @ w_down, 2.0 * tokens * inter * hidden)
    row("o input gradient", lambda: g_h @ w_o, 2.0 * tokens * q_out * hidden)
    head = rand(vocab, hidden)
    xc = rand(chunk, hidden)
    row(f"head forward, {chunk} tokens", lambda: F.linear(xc, head), 2.0 * chunk * hidden * vocab)
    gl = rand(chunk, vocab)
    row(f"head input gradient, {chunk} tokens", lambda: gl @ head, 2.0 * chunk * hidden * vocab)
    return rows


def attention(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int) -> list[dict]:
    """Causal SDPA forward + backward per backend, with the k/v heads shared (enable_gqa) or repeated."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    flop_fwd = 4.0 * batch * heads * seq * seq * head_dim / 2  # causal: half the score matrix
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        for gqa in (True, False):
            q = rand(batch, heads, seq, head_dim).requires_grad_()
            k = rand(batch, kv_heads, seq, head_dim).requires_grad_()
            v = rand(batch, kv_heads, seq, head_dim).requires_grad_()
            g = rand(batch, heads, seq, head_dim)

            def fwd():
                if gqa:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                rep = heads // kv_heads
                return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                      is_causal=True)
            name = f"attention {backend.name} {'enable_gqa' if gqa else 'k/v repeated'}"
            try:
                with sdpa_kernel(backend):
                    ms_f = median_ms(fwd, reps=30, warmup=5)
                    ms_fb = median_ms(lambda: torch.autograd.backward(fwd(), g), reps=30, warmup=5)
            except RuntimeError as err:
                rows.append({"name": name, "error": str(err).splitlines()[0][:200]})
                continue
            rows.append({"name": name, "forward_ms": round(ms_f, 4), "forward_backward_ms": round(ms_fb, 4),
                         "forward_tflops": round(flop_fwd / ms_f / 1e9, 1),
                         "forward_backward_tflops": round(3.5 * flop_fwd / ms_fb / 1e9, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--loss-chunk", type=int, default=1024)
    parser.add_argument("--blas", choices=["default", "cublas", "cublaslt"], default="default",
                        help="torch.backends.cuda.preferred_blas_library for the products")
    parser.add_argument("--tunable", action="store_true",
                        help="PyTorch TunableOp: time the library's algorithms for each shape and keep the fastest")
    parser.add_argument("--no-attention", action="store_true", help="time the products only")
    parser.add_argument("--out", default="block_products.json")
    args = parser.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    if args.tunable:
        torch.cuda.tunable.enable(True)
        torch.cuda.tunable.tuning_enable(True)
    tokens = args.batch * args.seq
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "args": vars(args),
        "products": products(tokens, args.hidden, args.intermediate, args.heads * args.head_dim,
                             args.kv_heads * args.head_dim, args.rank, args.vocab, args.loss_chunk),
        "attention": [] if args.no_attention else attention(args.batch, args.seq, args.heads, args.kv_heads,
                                                             args.head_dim),
    }
    for r in result["products"] + result["attention"]:
        print(json.dumps(r))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
