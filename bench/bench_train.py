"""Training-step throughput: transformers + PEFT against entrenar (plain, compiled, with kernels), side by side.

One command times every row of each case in the same process, on the same
shapes, the same random weights (drawn per parameter name, so the Hugging
Face and entrenar models start identical) and the same batches:

    PYTHONPATH=src python bench/bench_train.py --cases lora-1b,full-1b --out bench.json

Rows (``--rows``):
  hf               transformers + PEFT, eager, sdpa; its own loss (full logits, fp32 upcast)
  plain-eager      entrenar's model and PyTorch chunked cross-entropy, eager
  plain-compiled   the same, each decoder block under torch.compile
  kernels-eager    entrenar with apply_kernels and the fused linear cross-entropy, eager
  kernels-compiled the same, each decoder block under torch.compile
  kernels-bf16-*   kernels with the LoRA adapter products in bf16 (apply_kernels(lora_compute_dtype=bf16))
  kernels-bf16-pernode-*  the same with one LoRA node per projection, the down projection's input saved and
                   the norms apart (the kernels before q/k/v and gate/up shared a node: shows what sharing earns)
  kernels-bf16-splitnorm-*  the same with each norm apart from the LoRA node it feeds (its output saved for
                   backward; the kernels before the norm moved into the node: shows what that saves)
  kernels-bf16-cudagraph  kernels-bf16-eager with forward and backward replayed from a CUDA graph after 3 eager
                   steps (entrenar.train.cuda_graph, what training.cuda_graphs runs; the optimizer step stays eager)
  *-graph          instead of per block, model.hidden_states under torch.compile(fullgraph=True): the whole
                   layer loop in one graph (the fused loss stays outside it)

Every row: bf16 weights, fused AdamW on the trainable parameters (LoRA:
r=16, alpha=32, all linear layers but the output head, fp32 adapters as
PEFT makes them), random token batches of ``batch x seq`` with labels = inputs.
Reported per row: tokens/s (median over the timed steps after warm-up, from
CUDA events around whole steps: forward, backward, optimizer), MFU, peak
allocated and reserved GPU memory since the model was built, and the loss of
every step (so curves can be compared between rows).

FLOPs per token, counted as model FLOPs (recomputation under activation
checkpointing is not counted):
  full FT: 6 * N_matmul + 6 * L * T * d_attn
  LoRA:    4 * N_matmul + 6 * N_lora + 6 * L * T * d_attn   (frozen weights: no weight-gradient product)
with N_matmul the weights used in matrix products (every projection and the
output head; embeddings excluded), N_lora the adapter parameters, L layers,
T the sequence length and d_attn = heads * head_dim. The attention term
counts causal attention (half of the T x T score and value products) in
forward and twice that in backward. MFU divides by 989.4 TFLOP/s, the
H100/H200 SXM dense bf16 datasheet rate.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import types
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.kernels.fused_linear_ce import FUSED_LOSS_CHUNK
from entrenar.models.config import ModelConfig
from entrenar.models.loss import chunked_cross_entropy
from entrenar.models.transformer import Transformer
from entrenar.train.cuda_graph import GraphedMicroStep

LOSS_CHUNK = FUSED_LOSS_CHUNK  # tokens per chunk of the kernels rows' fused loss (--loss-chunk)

PEAK_BF16_FLOPS = 989.4e12
LORA_R, LORA_ALPHA = 16, 32

SHAPES: dict[str, dict] = {
    "llama-1b": {  # Llama-3.2-1B
        "hidden_size": 2048, "num_layers": 16, "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 8192,
        "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0, "model_type": "llama",
    },
    "llama-8b": {  # Llama-3.1-8B
        "hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 14336,
        "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0, "model_type": "llama",
    },
    "llama-70b": {  # Llama-3.1-70B (bench/multi_gpu.py's QLoRA case: an NF4 base sharded by FSDP2)
        "hidden_size": 8192, "num_layers": 80, "num_heads": 64, "num_kv_heads": 8, "intermediate_size": 28672,
        "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0, "model_type": "llama",
    },
    "qwen3-1.7b": {  # Qwen3-1.7B: q/k norms, head_dim 128
        "hidden_size": 2048, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8, "head_dim": 128,
        "intermediate_size": 6144, "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1000000.0,
        "model_type": "qwen3", "qk_norm": True,
    },
    "smollm2-135m": {  # SmolLM2-135M (the CPU benchmark's shape)
        "hidden_size": 576, "num_layers": 30, "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536,
        "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0, "model_type": "llama",
    },
}


@dataclass
class Case:
    shape: str
    method: str  # "lora" or "full"
    batch: int
    seq: int
    checkpointing: bool | int = False  # all layers, none, or this many layers spread evenly
    steps: int = 15
    warmup: int = 3
    lr: float = 1e-4
    offload: bool | int = False  # what layers (all but the last, or the first N) save waits in CPU memory
    # (training.offload_activations; entrenar rows only)
    documents: bool = False  # rows packed with random-length documents (document-masked attention)
    padding_free: bool = False  # documents cases: each batch as one row of its real tokens (varlen attention)


CASES: dict[str, Case] = {
    # 50 steps so the loss curves of the rows can be compared (issue 5 asks for 50).
    "lora-1b": Case("llama-1b", "lora", 4, 2048, steps=50, warmup=5, lr=1e-3),
    "full-1b": Case("llama-1b", "full", 4, 2048, steps=15, warmup=3, lr=1e-5),
    "lora-8b": Case("llama-8b", "lora", 2, 2048, checkpointing=True, steps=12, warmup=3, lr=1e-3),
    "lora-qwen3": Case("qwen3-1.7b", "lora", 4, 2048, steps=15, warmup=3, lr=1e-3),
    # selective activation checkpointing: 6 of the 16 layers recompute in backward (entrenar rows only)
    "lora-1b-sac": Case("llama-1b", "lora", 4, 2048, checkpointing=6, steps=15, warmup=3, lr=1e-3),
    # long context: one 16k-token sequence, every layer checkpointed
    "lora-1b-16k": Case("llama-1b", "lora", 1, 16384, checkpointing=True, steps=8, warmup=3, lr=1e-3),
    # the 8B case with what layers save offloaded to CPU memory (entrenar rows only): every layer checkpointed
    # (the input of each), and 20 of 32 (the others' activations in CPU memory instead of recomputed)
    "lora-8b-offload": Case("llama-8b", "lora", 2, 2048, checkpointing=True, steps=12, warmup=3, lr=1e-3,
                            offload=True),
    "lora-8b-offload-ckpt20": Case("llama-8b", "lora", 2, 2048, checkpointing=20, steps=12, warmup=3, lr=1e-3,
                                   offload=True),
    # fewer layers recomputed, at more memory: the first 20 layers offloaded, the rest's activations on the GPU
    "lora-8b-off20-ckpt16": Case("llama-8b", "lora", 2, 2048, checkpointing=16, steps=12, warmup=3, lr=1e-3,
                                 offload=20),
    "lora-8b-off20-ckpt12": Case("llama-8b", "lora", 2, 2048, checkpointing=12, steps=12, warmup=3, lr=1e-3,
                                 offload=20),
    # packed documents of 64-1024 tokens (about 13% of each row left as padding): padded rows with a document
    # mask against the same batches padding-free (entrenar rows only; tok/s counts real tokens)
    "lora-1b-docs": Case("llama-1b", "lora", 4, 2048, steps=15, warmup=5, lr=1e-3, documents=True),
    "lora-1b-docs-padfree": Case("llama-1b", "lora", 4, 2048, steps=15, warmup=5, lr=1e-3, documents=True,
                                 padding_free=True),
}
ROWS = ("hf", "plain-eager", "plain-compiled", "plain-graph", "kernels-eager", "kernels-compiled", "kernels-graph",
        "kernels-bf16-eager", "kernels-bf16-compiled", "kernels-bf16-graph", "kernels-bf16-pernode-eager",
        "kernels-bf16-pernode-compiled", "kernels-bf16-splitnorm-eager", "kernels-bf16-cudagraph")
# The plain row each kernel row is compared with: the same mode (a CUDA graph is compared with the compiled row).
PLAIN_OF_MODE = {"eager": "plain-eager", "compiled": "plain-compiled", "graph": "plain-graph",
                 "cudagraph": "plain-compiled"}


def model_config(shape: str, seq: int) -> ModelConfig:
    return ModelConfig(**SHAPES[shape], max_position_embeddings=max(seq, 2048))


# ---------------------------------------------------------------- weights and data


def canonical_name(name: str) -> str:
    """A parameter's name with PEFT's wrapping removed, so both stacks name each weight alike."""
    return name.removeprefix("base_model.model.").replace(".default.", ".")


@torch.no_grad()
def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """Random weights drawn per parameter name: the same model gets the same weights in either stack.

    Norms 1, LoRA A Kaiming-uniform, LoRA B 0 (the adapter starts as a no-op), all else normal(0, std).
    """
    for name, p in model.named_parameters():
        key = canonical_name(name)
        g = torch.Generator(device=p.device).manual_seed(zlib.crc32(key.encode()))
        if key.endswith("norm.weight"):
            p.fill_(1.0)
        elif ".lora_B." in key:
            p.zero_()
        elif ".lora_A." in key:
            bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
            p.uniform_(-bound, bound, generator=g)
        elif key.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=g)


def make_batches(n: int, batch: int, seq: int, vocab: int, device: str, seed: int = 1234) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(n)]


def make_document_batches(n: int, batch: int, seq: int, vocab: int, device: str, padding_free: bool,
                          seed: int = 1234) -> list[dict]:
    """Rows packed by entrenar's BatchStream with random documents of 64-1024 tokens (labels = inputs)."""
    from entrenar.data import BatchStream, Example
    from entrenar.data import padding_free as flatten

    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n * batch * seq // 300):
        length = int(torch.randint(min(64, seq), min(1024, seq) + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        examples.append(Example(input_ids=ids, labels=ids))
    stream = BatchStream(examples, batch, seq, shuffle=False)
    batches = [next(stream) for _ in range(n)]
    if padding_free:
        batches = [flatten(b) for b in batches]
    return [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in batches]


def real_tokens(batch: torch.Tensor | dict) -> int:
    """Tokens that are not padding (what tok/s counts)."""
    if isinstance(batch, torch.Tensor) or "cu_seqlens" in batch:
        return (batch if isinstance(batch, torch.Tensor) else batch["input_ids"]).numel()
    return int((batch["document_ids"] >= 0).sum())


# ---------------------------------------------------------------- the two stacks


def build_hf(cfg: ModelConfig, method: str, checkpointing: bool, device: str, dtype: torch.dtype) -> nn.Module:
    import transformers

    hf_config = dict(cfg.to_hf())
    model_type = hf_config.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **hf_config)
    hf_config.use_cache = False
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if method == "lora":
        import peft

        model = peft.get_peft_model(
            model,
            peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear",
                            task_type="CAUSAL_LM"),
        )
    init_weights(model)
    return model.train()


def build_entrenar(cfg: ModelConfig, method: str, checkpointing: bool | int, device: str, dtype: torch.dtype,
                   kernels: bool, mode: str, lora_compute_dtype: torch.dtype | None = None,
                   offload: bool | int = False, per_node: bool = False, split_norm: bool = False) -> Transformer:
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in bf16 directly: no fp32 copy of an 8B model on the way
    try:
        with torch.device(device):
            model = Transformer(cfg)
    finally:
        torch.set_default_dtype(default)
    if method == "lora":
        apply_lora(model, LoraConfig(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0))
    model.set_activation_checkpointing(checkpointing, offload=offload)
    if kernels:
        from entrenar.kernels import apply_kernels

        apply_kernels(model, lora_compute_dtype=lora_compute_dtype)
        if per_node:
            one_node_per_projection(model)
        if split_norm or per_node:
            norms_apart(model)
    init_weights(model)
    if mode == "compiled":
        for block in model.model.layers:
            block.compile()
    elif mode == "graph":
        model.hidden_states = torch.compile(model.hidden_states, fullgraph=True)
    return model.train()


def one_node_per_projection(model: Transformer) -> None:
    """Undo what apply_kernels shares between projections: each LoRA layer its own node, silu(gate)*up saved."""
    from entrenar.kernels import FusedMLP, FusedRopeAttention, swiglu
    from entrenar.models.transformer import MLP, Attention

    def combine(self, gate, up):
        return self.down_proj(swiglu(gate, up))

    for module in model.modules():
        if isinstance(module, FusedRopeAttention):
            module.project = types.MethodType(Attention.project, module)
        elif isinstance(module, FusedMLP):
            module.project = types.MethodType(MLP.project, module)
            module.combine = types.MethodType(combine, module)


def norms_apart(model: Transformer) -> None:
    """Undo the norms inside the LoRA nodes: each block's norm runs alone and its output is saved."""
    from entrenar.kernels import FusedBlock
    from entrenar.models.transformer import Block

    for module in model.modules():
        if type(module) is FusedBlock:
            module.__class__ = Block


def hf_step_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def entrenar_step_loss(loss_fn: Callable) -> Callable[[Transformer, torch.Tensor | dict], torch.Tensor]:
    def step(model: Transformer, batch: torch.Tensor | dict) -> torch.Tensor:
        if isinstance(batch, torch.Tensor):
            hidden, labels = model.hidden_states(batch), batch
        else:  # packed documents: padded with a document mask, or padding-free
            hidden = model.hidden_states(batch["input_ids"], batch["position_ids"], batch.get("document_ids"),
                                         cu_seqlens=batch.get("cu_seqlens"), max_seqlen=batch.get("max_seqlen"))
            labels = batch["labels"]
        loss_sum, n_tokens = loss_fn(hidden, model.lm_head.weight, labels)
        return loss_sum / n_tokens

    return step


# ---------------------------------------------------------------- counting


def flops_per_token(cfg: ModelConfig, method: str, seq: int) -> tuple[float, dict]:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    layer_in_out = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]  # q k v o gate up down
    n_matmul = cfg.num_layers * sum(a * b for a, b in layer_in_out) + cfg.vocab_size * h
    n_lora = cfg.num_layers * sum(LORA_R * (a + b) for a, b in layer_in_out)
    attention = 6 * cfg.num_layers * seq * q  # causal: 2*T*d_attn per token forward for QK^T and PV, x3 for training
    if method == "full":
        total = 6 * n_matmul + attention
        formula = "6*N_matmul + 6*L*T*d_attn"
    else:
        total = 4 * n_matmul + 6 * n_lora + attention
        formula = "4*N_matmul + 6*N_lora + 6*L*T*d_attn"
    return float(total), {"formula": formula, "N_matmul": n_matmul, "N_lora": n_lora if method == "lora" else 0,
                          "attention_per_token": attention}


# ---------------------------------------------------------------- one row


@dataclass
class RowResult:
    case: str
    row: str
    status: str = "ok"
    error: str | None = None
    tokens_per_s: float | None = None
    step_ms_median: float | None = None
    step_ms_all: list[float] = field(default_factory=list)
    mfu: float | None = None
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    losses: list[float] = field(default_factory=list)
    first_step_s: float | None = None
    trainable_params: int | None = None


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    torch._dynamo.reset()


def run_row(case_name: str, case: Case, row: str, device: str, dtype: torch.dtype,
            profile_to: str | None = None) -> RowResult:
    result = RowResult(case_name, row)
    cfg = model_config(case.shape, case.seq)
    _free()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    if row == "hf":
        if case.checkpointing not in (True, False) or case.offload or case.documents:
            raise ValueError("this case is for entrenar rows (transformers checkpoints all layers or none, "
                             "does not offload, and masks documents only with flash-attn installed)")
        model = build_hf(cfg, case.method, case.checkpointing, device, dtype)
        step_loss = hf_step_loss
    else:
        kernels, mode = row.startswith("kernels"), row.rsplit("-", 1)[1]
        compute = dtype if "-bf16-" in row else None
        model = build_entrenar(cfg, case.method, case.checkpointing, device, dtype, kernels, mode, compute,
                               offload=case.offload, per_node="-pernode-" in row,
                               split_norm="-splitnorm-" in row)
        if kernels:
            from entrenar.kernels import fused_linear_cross_entropy

            def loss_fn(hidden, weight, labels):
                return fused_linear_cross_entropy(hidden, weight, labels, LOSS_CHUNK)
        else:
            loss_fn = chunked_cross_entropy
        step_loss = entrenar_step_loss(loss_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    result.trainable_params = sum(p.numel() for p in params)
    graphed = row.endswith("-cudagraph")
    if graphed and (case.documents or profile_to):
        raise ValueError("a CUDA-graph row takes fixed-shape batches and is not profiled")
    opt = torch.optim.AdamW(params, lr=case.lr, weight_decay=0.0, fused=device == "cuda")
    graphed_step = None
    if graphed:
        def forward_backward(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = step_loss(model, inputs["ids"])  # noqa: F821 - bound when called (pyflakes sees `del model`)
            loss.backward()
            return loss.detach()

        graphed_step = GraphedMicroStep(forward_backward, params)
    if case.documents:
        batches = make_document_batches(4, case.batch, case.seq, cfg.vocab_size, device, case.padding_free)
    else:
        batches = make_batches(4, case.batch, case.seq, cfg.vocab_size, device)
    tokens_per_step = statistics.mean(real_tokens(b) for b in batches)

    times = []
    for step in range(case.steps):
        ids = batches[step % len(batches)]
        wall = time.perf_counter()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        if graphed_step is not None:
            loss = graphed_step({"ids": ids})
            opt.step()
            opt.zero_grad(set_to_none=False)  # the graph adds into these gradients
        else:
            loss = step_loss(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device == "cuda":
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - wall) * 1e3)
        result.losses.append(loss.item())
        if step == 0:
            result.first_step_s = time.perf_counter() - wall
    timed = times[case.warmup:]
    result.step_ms_all = [round(t, 3) for t in times]
    result.step_ms_median = statistics.median(timed)
    result.tokens_per_s = tokens_per_step / (result.step_ms_median / 1e3)
    per_token, _ = flops_per_token(cfg, case.method, case.seq)
    result.mfu = per_token * result.tokens_per_s / PEAK_BF16_FLOPS
    if device == "cuda":
        result.peak_allocated_gib = torch.cuda.max_memory_allocated() / 2**30
        result.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    if profile_to:
        try:
            profile_steps(model, opt, step_loss, batches, profile_to)
        except Exception as err:  # noqa: BLE001 - the timing stands; say why the profile is missing
            result.error = f"profile failed: {type(err).__name__}: {err}"
    del model, opt, params, batches, loss, graphed_step
    _free()
    return result


def profile_steps(model, opt, step_loss, batches, path: str, steps: int = 3) -> None:
    """GPU time per kernel over a few more steps, as torch.profiler's table (after the timed steps)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for ids in batches[:steps]:
            step_loss(model, ids).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90)
    Path(path).write_text(f"{steps} steps\n{table}\n")


# ---------------------------------------------------------------- report


def compare(results: list[RowResult]) -> list[dict]:
    """Per row: ratios to the transformers + PEFT row and largest loss difference to plain-eager of its case."""
    out = []
    for r in results:
        same = {x.row: x for x in results if x.case == r.case and x.status == "ok"}
        d = {"case": r.case, "row": r.row, "status": r.status}
        hf, plain = same.get("hf"), same.get("plain-eager")
        if r.status == "ok" and hf is not None:
            d["speed_vs_hf"] = r.tokens_per_s / hf.tokens_per_s
            if r.peak_allocated_gib and hf.peak_allocated_gib:
                d["memory_vs_hf"] = r.peak_allocated_gib / hf.peak_allocated_gib
        if r.status == "ok" and r.row.startswith("kernels-"):
            ref_name = PLAIN_OF_MODE[r.row.rsplit("-", 1)[1]]
            if ref_name in same:
                d[f"speed_vs_{ref_name}"] = r.tokens_per_s / same[ref_name].tokens_per_s
        if r.status == "ok" and plain is not None and r is not plain:
            n = min(len(r.losses), len(plain.losses))
            d["max_abs_loss_diff_vs_plain_eager"] = max(abs(a - b) for a, b in zip(r.losses[:n], plain.losses[:n]))
        out.append(d)
    return out


def print_table(results: list[RowResult], comparisons: list[dict]) -> None:
    head = (f"{'case':<12}{'row':<22}{'tok/s':>9}{'ms':>8}{'MFU':>7}{'GiB':>7}{'xHF':>6}{'memxHF':>7}{'xplain':>7}"
            f"{'dloss':>8}")
    print(head)
    for r, c in zip(results, comparisons):
        if r.status != "ok":
            print(f"{r.case:<12}{r.row:<22}  {r.status}: {(r.error or '')[:80]}")
            continue
        plain_ratio = next((v for k, v in c.items() if k.startswith("speed_vs_plain-")), None)
        cells = [
            f"{r.tokens_per_s:9.0f}", f"{r.step_ms_median:8.1f}", f"{100 * r.mfu:6.1f}%",
            f"{r.peak_allocated_gib or float('nan'):7.1f}", f"{c.get('speed_vs_hf', float('nan')):6.2f}",
            f"{c.get('memory_vs_hf', float('nan')):7.2f}", f"{plain_ratio or float('nan'):7.2f}",
            f"{c.get('max_abs_loss_diff_vs_plain_eager', float('nan')):8.4f}",
        ]
        print(f"{r.case:<12}{r.row:<22}" + "".join(cells))


def environment() -> dict:
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv}
    for name in ("transformers", "peft", "triton"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="lora-1b,full-1b,lora-8b,lora-qwen3", help=f"of {', '.join(CASES)}")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--skip", default="", help="case:row pairs to leave out, comma separated")
    parser.add_argument("--plan", default="", help="case:row pairs to run, in order (instead of --cases x --rows)")
    parser.add_argument("--profile", default="", help="case:row pairs to profile after timing (tables beside --out)")
    parser.add_argument("--out", default="bench_train.json")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new row after this many seconds (rows left are recorded as skipped)")
    parser.add_argument("--loss-chunk", type=int, default=FUSED_LOSS_CHUNK,
                        help="tokens per chunk of the kernels rows' fused loss")
    args = parser.parse_args(argv)
    global LOSS_CHUNK
    LOSS_CHUNK = args.loss_chunk
    if not torch.cuda.is_available():
        sys.exit("bench_train.py needs a CUDA GPU (bench/bench_cpu.py is the CPU benchmark)")
    torch.backends.cuda.matmul.allow_tf32 = False  # the same fp32 adapter products in every row

    skip = set(filter(None, args.skip.split(",")))
    if args.plan:
        plan = [tuple(item.split(":", 1)) for item in args.plan.split(",")]
    else:
        plan = [(c, r) for c in args.cases.split(",") for r in args.rows.split(",") if f"{c}:{r}" not in skip]
    profiled = set(filter(None, args.profile.split(",")))
    for c, r in plan:
        if c not in CASES or r not in ROWS:
            sys.exit(f"unknown case or row {c}:{r}")
    began = time.perf_counter()
    results: list[RowResult] = []
    for case_name, row in plan:
        case = CASES[case_name]
        if time.perf_counter() - began > args.budget_s:
            results.append(RowResult(case_name, row, status="skipped", error="time budget"))
            continue
        t0 = time.perf_counter()
        try:
            profile_to = None
            if f"{case_name}:{row}" in profiled:
                profile_to = str(Path(args.out).with_name(f"profile_{case_name}_{row}.txt"))
            results.append(run_row(case_name, case, row, "cuda", torch.bfloat16, profile_to))
        except Exception as err:  # noqa: BLE001 - a failed row is reported, and the others still run
            results.append(RowResult(case_name, row, status="failed", error=f"{type(err).__name__}: {err}"[:2000]))
        _free()
        r = results[-1]
        print(f"[{time.perf_counter() - began:6.1f}s] {case_name} {row}: {r.status} "
              f"{'' if r.tokens_per_s is None else f'{r.tokens_per_s:.0f} tok/s'} "
              f"({time.perf_counter() - t0:.1f}s) {r.error or ''}", flush=True)
        write(args.out, results)
    write(args.out, results)
    print_table(results, compare(results))


def write(path: str, results: list[RowResult]) -> None:
    cases = {}
    for name in {r.case for r in results}:
        case = CASES[name]
        per_token, detail = flops_per_token(model_config(case.shape, case.seq), case.method, case.seq)
        cases[name] = {**case.__dict__, "flops_per_token": per_token, **detail}
    doc = {"environment": environment(), "peak_flops": PEAK_BF16_FLOPS, "loss_chunk": LOSS_CHUNK, "cases": cases,
           "rows": [r.__dict__ for r in results], "comparisons": compare(results)}
    Path(path).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
