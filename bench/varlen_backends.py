"""Packed-row attention backends on the GPU: FlashAttention-2's variable-length kernel against the alternatives.

Answers "would another attention kernel earn time on entrenar's packed rows" before the model uses it. Document
lengths come from real text (``--text``, tokenized with ``--tokenizer``) packed into rows best-fit, as a batch
of the LoRA cases is; each backend runs forward and backward on the same ``q``, ``k``, ``v`` and output gradient
and is checked against the FlashAttention-2 result. Rows: ``fa2-varlen`` (what the model runs eagerly,
``torch.nn.attention.varlen``), ``fa2-varlen-graph`` (the CUDA-graph layout: segments padded to a fixed count
with empty ones, ``max_seqlen`` the row length), ``flex`` (FlexAttention under a document-causal block mask,
compiled), ``fa2-dense`` / ``cudnn-dense`` (whole causal rows without document boundaries: the work a
group_texts row does, not the same attention); ``--cudnn-ragged`` adds cuDNN's ragged path; ``fa4-varlen``
(FlashAttention-4's CuTe-DSL kernel, ``flash_attn.cute.flash_attn_varlen_func``, JIT-compiled on first call) runs
where the ``flash-attn-4`` package imports. ``--capture`` also times each step replayed from a CUDA graph, the
GPU's time alone (the eager rows can include the host's).

    PYTHONPATH=src:bench python3 bench/varlen_backends.py --capture --out varlen.json

FlashAttention-4's wheels (``flash-attn-4`` and ``nvidia-cutlass-dsl`` with its ``-libs-base`` and ``-libs-cu13``
parts, 102 MB; ``bench/fa4_wheels.sh`` fetches them) are more than one device call carries: they travel as three parts
in three calls to one warm machine (the script's comment says how) and are installed into the folder on
``PYTHONPATH`` before this script runs.
"""

from __future__ import annotations

import argparse
import json
import random

import torch
import torch.nn.functional as F
from bench_nf4 import median_ms

SHAPES = {"llama-1b": (32, 8, 64), "qwen3-1.7b": (16, 8, 128), "llama-8b": (32, 8, 128)}  # q heads, kv heads, dim


def document_lengths(text: str, tokenizer: str, limit: int = 4000) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer}/tokenizer.json")
    lengths = []
    with open(text) as f:
        for line in f:
            lengths.append(len(tok.encode(json.loads(line)["text"]).ids) + 1)  # + end of text
            if len(lengths) >= limit:
                break
    return lengths


def pack(lengths: list[int], rows: int, row_len: int, rng: random.Random) -> list[int]:
    """Segment lengths over ``rows`` rows read end to end: documents best-fit into rows, each row's rest a padding
    run."""
    fill = [[] for _ in range(rows)]
    pool = [min(n, row_len) for n in rng.sample(lengths, len(lengths))]
    for n in pool:
        room = [(row_len - sum(r) - n, i) for i, r in enumerate(fill) if row_len - sum(r) >= n]
        if room:
            fill[min(room)[1]].append(n)
        if all(row_len - sum(r) < 16 for r in fill):
            break
    segments = []
    for r in fill:
        segments += r
        if sum(r) < row_len:
            segments.append(row_len - sum(r))
    return segments


class CudnnRagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len):
        out = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False)
        o, lse, seed, offset = out[0], out[1], out[6], out[7]
        ctx.save_for_backward(q, k, v, o, lse, seed, offset, cu)
        if not getattr(CudnnRagged, "shown", False):
            CudnnRagged.shown = True
            print("cudnn ragged outputs:", [getattr(x, "shape", x) for x in out], flush=True)
        ctx.max_len = max_len
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse, seed, offset, cu = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            grad.contiguous(), q, k, v, o, lse, seed, offset, torch.empty(0, device=q.device, dtype=q.dtype),
            cu, cu, ctx.max_len, ctx.max_len, 0.0, True)
        return dq, dk, dv, None, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--text", default=".e2e/text.jsonl")
    p.add_argument("--tokenizer", default=".e2e")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--row-len", type=int, default=2048)
    p.add_argument("--capacity", type=int, default=0, help="graph layout's segment count (0: 1.25x the batch's)")
    p.add_argument("--cudnn-ragged", action="store_true",
                   help="also aten._cudnn_attention_forward with cum_seq (torch 2.11: rebuilds its plan every call, "
                        "50-80 ms, "
                        "and its backward's gradients are wrong)")
    p.add_argument("--capture", action="store_true", help="also time forward and backward replayed from a CUDA graph")
    p.add_argument("--out", default="")
    args = p.parse_args()
    from entrenar.models.padding_free import Documents, _varlen

    rng = random.Random(0)
    lengths = document_lengths(args.text, args.tokenizer)
    segments = pack(lengths, args.rows, args.row_len, rng)
    n = args.rows * args.row_len
    cu = torch.tensor([0] + list(torch.tensor(segments).cumsum(0)), dtype=torch.int32, device="cuda")
    capacity = args.capacity or int(len(segments) * 1.25)
    cu_graph = torch.cat([cu, cu.new_full((capacity - len(segments),), n)])
    max_len = max(segments)
    print(f"{len(segments)} segments over {args.rows} x {args.row_len}, longest {max_len}, "
          f"mean document {sum(lengths) / len(lengths):.0f} tokens; graph layout {capacity} segments", flush=True)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex_compiled = torch.compile(flex_attention, dynamic=False)
    doc = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments)).view(args.rows, args.row_len)
    doc = doc.to("cuda")

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(document_causal, args.rows, None, args.row_len, args.row_len, device="cuda")
    mask_ms = median_ms(lambda: create_block_mask(document_causal, args.rows, None, args.row_len, args.row_len,
                                                  device="cuda"), reps=10, warmup=2)
    print(f"block mask: {block_mask.sparsity():.1f}% sparse, built in {mask_ms:.2f} ms", flush=True)
    results = {"block_mask_sparsity": block_mask.sparsity(), "block_mask_ms": mask_ms, "segments": segments,
               "capacity": capacity, "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version(), "gpu": torch.cuda.get_device_name(), "rows": []}

    for shape, (hq, hk, d) in SHAPES.items():
        torch.manual_seed(0)
        q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, hk, d, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
        groups = hq // hk

        def fa2(q, k, v, cu=cu, m=max_len):
            return _varlen(q, k, v, Documents(cu, m), None)

        def cudnn(q, k, v, cu=cu, m=max_len):
            return CudnnRagged.apply(q, k, v, cu, m)

        def cudnn_autograd(q, k, v, cu=cu, m=max_len):
            return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, m, m, True, 0.0, True, False)[0]

        def cudnn_repeat(q, k, v, cu=cu, m=max_len):
            return CudnnRagged.apply(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), cu, m)

        def dense(backend):
            def run(q, k, v):
                b = args.rows
                qq, kk, vv = (x.view(b, args.row_len, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
                with torch.nn.attention.sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
                return o.transpose(1, 2).reshape(n, hq, d)
            return run

        def flex(block_mask):
            def run(q, k, v):
                b = args.rows
                qq, kk, vv = (x.view(b, args.row_len, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
                o = flex_compiled(qq, kk, vv, block_mask=block_mask, enable_gqa=True)
                return o.transpose(1, 2).reshape(n, hq, d)
            return run

        def fa4(q, k, v, cu=cu, m=max_len):
            from flash_attn.cute import flash_attn_varlen_func

            out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                         max_seqlen_k=m, causal=True)
            return out[0] if isinstance(out, tuple) else out

        backends = {
            "fa2-varlen": fa2,
            "fa4-varlen": fa4,
            "fa2-varlen-graph": lambda q, k, v: fa2(q, k, v, cu_graph, args.row_len),
            "flex": flex(block_mask),
            "fa2-dense": dense(torch.nn.attention.SDPBackend.FLASH_ATTENTION),
            "cudnn-dense": dense(torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
        }
        if args.cudnn_ragged:
            backends.update({"cudnn-ragged": cudnn, "cudnn-ragged-autograd": cudnn_autograd,
                             "cudnn-ragged-repeat": cudnn_repeat})
        reference = None
        for name, fn in backends.items():
            row = {"shape": shape, "backend": name}
            try:
                qs, ks, vs = (x.detach().clone().requires_grad_() for x in (q, k, v))
                out = fn(qs, ks, vs)
                out.backward(g)
                torch.cuda.synchronize()
                grads = (out.detach(), qs.grad, ks.grad, vs.grad)
                if reference is None:
                    reference = grads
                elif "dense" not in name:
                    row["max_abs_diff"] = [float((a.float() - b.float()).abs().max()) for a, b in zip(grads, reference)]
                    row["ref_max_abs"] = [float(b.float().abs().max()) for b in reference]

                def fwd():
                    with torch.no_grad():
                        fn(q, k, v)

                def fwd_bwd():
                    qs.grad = ks.grad = vs.grad = None
                    fn(qs, ks, vs).backward(g)

                row["forward_ms"] = round(median_ms(fwd, reps=20, warmup=3), 4)
                row["forward_backward_ms"] = round(median_ms(fwd_bwd, reps=20, warmup=3), 4)
                if args.capture:
                    # as the loop's graphs run (entrenar.train.cuda_graph): gradients kept and zeroed in place,
                    # eager warm-up calls on the same stream; replay time is the GPU's alone, without the host's
                    # launch time that the eager rows can include
                    def step():
                        for t in (qs, ks, vs):
                            t.grad.zero_()
                        fn(qs, ks, vs).backward(g)

                    for _ in range(3):
                        step()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    graph.replay()
                    torch.cuda.synchronize()
                    row["graph_replay_max_abs_diff"] = float((qs.grad.float() - grads[1].float()).abs().max())
                    row["graph_ms"] = round(median_ms(graph.replay, reps=20, warmup=3), 4)
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is a result
                import traceback
                where = traceback.extract_tb(e.__traceback__)[-1]
                row["error"] = f"{type(e).__name__}: {str(e)[:300]} (at {where.name}:{where.lineno})"
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
