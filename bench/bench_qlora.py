"""QLoRA training steps on the Llama-3.1-8B shape: entrenar against transformers + PEFT + bitsandbytes.

    PYTHONPATH=src python bench/bench_qlora.py --out bench_qlora.json

Every row: Llama-3.1-8B's shape (hidden 4096, 32 layers, 32 heads, 8 kv
heads, intermediate 14336, vocab 128256) with random weights, drawn per
parameter name so every row starts from the same bf16 weights (an NF4 base is
quantized from them, layer by layer, as ``entrenar.load(..., quantize="nf4")``
does while streaming: the 16-bit model is never held whole). LoRA r=16,
alpha=32, no dropout, on every linear layer but the output head (fp32
adapters), activation checkpointing on every block, fused AdamW on the
adapters, random token batches of 2 x 2048 with labels = inputs, one
plain causal sequence per row (no packing).

Rows (``--rows``):
  entrenar-qlora          NF4 base (Triton dequantization), the step ``entrenar train`` takes: bf16 autocast,
                          full logits, ``token_cross_entropy``
  entrenar-lora           the same on a bf16 base
  hf-qlora                transformers + PEFT + bitsandbytes: ``bnb.nn.Linear4bit`` (NF4, double quantization,
                          bf16 compute) on the same weights, HF's gradient checkpointing, HF's loss
  entrenar-qlora-fused    entrenar-qlora with each LoRA layer and its NF4 base as one node
                          (``entrenar.kernels.FusedLoraLinear`` on an NF4 base, adapter products in bf16)
  entrenar-qlora-fast     that, plus ``apply_kernels`` RMSNorm, RoPE and SwiGLU and the fused linear
                          cross-entropy (1024-token chunks), no autocast
  entrenar-lora-fast      the same on a bf16 base (its LoRA layers: ``FusedLoraLinear``, adapter products in bf16)
  entrenar-qlora-chunked  entrenar-qlora with ``chunked_cross_entropy`` (1024-token chunks): no full logits
  entrenar-lora-chunked   the same on a bf16 base
  entrenar-qlora-torchdq  entrenar-qlora with the PyTorch reference dequantization instead of the kernel
  loop-qlora              the step ``entrenar train`` takes on CUDA now (``training.kernels: auto``): every
                          kernel of ``apply_kernels`` (the LoRA layers as one node with their NF4 base) and the
                          fused linear cross-entropy in ``FUSED_LOSS_CHUNK`` (1024) token chunks, all under bf16
                          autocast
  loop-lora               the same on a bf16 base
  loop-*-compiled         those with the whole step (forward and loss) under ``torch.compile``
  loop-*-blocks           those with each decoder block under ``torch.compile`` (checkpointing stays eager)
  loop-*-cudagraph        those eager, forward and backward replayed from a CUDA graph after 3 eager steps
                          (``training.cuda_graphs: true``; the optimizer step stays eager)
  loop-qlora-*-c4096      those with the fused loss in 4096-token chunks (as the loop ran it before the fifth call set)
  loop-qlora-*-ckpt30     30 of the 32 blocks checkpointed (``training.activation_checkpointing: 30``; -ckpt29 etc.)
  loop-*-fullrerun        checkpointed blocks rerun their whole forward in backward, the down projection's
                          product included (what the fused blocks did before the sixth call set)
  loop-qlora-*emb*        the input-embedding table in pinned CPU memory (``training.offload_embeddings``)
  loop-qlora-*-off-ckptC  C of 32 blocks checkpointed and what every block but the last saves (a checkpointed
                          one: its input) in pinned CPU memory until backward (``training.offload_activations``)
  loop-qlora-*-offN-ckptC the same with only the first N blocks' saves offloaded
  loop-qlora-*-lagK       the copies of K blocks (not 2) may lag behind the compute in forward

Reported per row: tokens/s from the median step time after warm-up (CUDA
events around forward, backward and optimizer step), peak GPU memory
(``torch.cuda.max_memory_allocated`` over the training steps, less what was
allocated before the row began), the memory held after building (weights and
adapters), the loss of each step, and one profiled step's GPU time split into
dequantization, matrix products, attention and the rest.
``estimate_training_memory`` is printed beside the measured peak.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.kernels.fused_linear_ce import FUSED_LOSS_CHUNK
from entrenar.models.config import ModelConfig
from entrenar.models.hf import empty_model
from entrenar.models.loss import chunked_cross_entropy, token_cross_entropy
from entrenar.quant.nf4.format import NF4Linear
from entrenar.quant.nf4.sinks import nf4_sinks
from entrenar.train.cuda_graph import GraphedMicroStep
from entrenar.train.memory import GiB, estimate_training_memory

BATCH, SEQ, LORA_R, LORA_ALPHA, LR = 2, 2048, 16, 32, 1e-4
CHUNK = 1024  # tokens per logits chunk in the chunked / fused losses
DEVICE = "cuda"  # the builders and steps also run on "cpu" with a tiny CONFIG, to check this script without a GPU
CONFIG = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                     num_kv_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                     model_type="llama")


@dataclass(frozen=True)
class Row:
    base: str  # "nf4" or "bf16" (entrenar), "hf" (transformers + PEFT + bitsandbytes)
    loss: str = "logits"  # "logits" (full logits, token_cross_entropy), "chunked", "fused", "hf"
    kernels: tuple[str, ...] = ()  # of entrenar.kernels.apply_kernels: rms_norm, rope, swiglu, lora
    bf16_adapters: bool = False  # the fused LoRA layers' adapter products in bf16 (lora_compute_dtype)
    autocast: bool = True  # bf16 autocast, as entrenar train runs (the fp32 adapters' products then run in bf16)
    loss_in_autocast: bool = False  # the chunked / fused loss inside autocast too, as the loop calls it
    chunk: int = CHUNK
    compile: str = ""  # "step": the whole forward + loss under torch.compile; "blocks": each decoder block
    cuda_graph: bool = False  # forward and backward replayed from a CUDA graph (training.cuda_graphs)
    torch_dequant: bool = False
    checkpointed: bool | int = True  # activation checkpointing: every block, or this many spread over the depth
    full_rerun: bool = False  # checkpointed blocks rerun their down projection too (as before the sixth call set)
    offload_embeddings: bool = False  # the input-embedding table in pinned CPU memory (training.offload_embeddings)
    offload_activations: bool | int = False  # what blocks save in pinned CPU memory (training.offload_activations)
    offload_in_flight: int = 0  # blocks whose copies to the CPU may lag (0: ActivationOffload's default)
    lora_row: str | None = None  # the 16-bit LoRA row this QLoRA row is compared with
    steps: int = 10
    warmup: int = 3


FAST = ("rms_norm", "rope", "swiglu", "lora")
LOOP = dict(loss="fused", kernels=FAST, loss_in_autocast=True, chunk=FUSED_LOSS_CHUNK)  # entrenar.train.loop on CUDA
ROWS: dict[str, Row] = {
    "entrenar-qlora": Row("nf4", lora_row="entrenar-lora"),
    "entrenar-lora": Row("bf16"),
    "hf-qlora": Row("hf", loss="hf"),
    "entrenar-qlora-fused": Row("nf4", kernels=("lora",), bf16_adapters=True, lora_row="entrenar-lora"),
    # Without autocast, as bench_train.py runs the kernels; every dtype is explicit there.
    "entrenar-qlora-fast": Row("nf4", loss="fused", kernels=FAST, bf16_adapters=True, autocast=False,
                               lora_row="entrenar-lora-fast"),
    "entrenar-lora-fast": Row("bf16", loss="fused", kernels=FAST, bf16_adapters=True, autocast=False),
    "loop-qlora": Row("nf4", **LOOP, lora_row="loop-lora"),
    "loop-lora": Row("bf16", **LOOP),
    "loop-qlora-compiled": Row("nf4", **LOOP, compile="step", lora_row="loop-lora-compiled"),
    "loop-lora-compiled": Row("bf16", **LOOP, compile="step"),
    "loop-qlora-blocks": Row("nf4", **LOOP, compile="blocks", lora_row="loop-lora-blocks"),
    "loop-lora-blocks": Row("bf16", **LOOP, compile="blocks"),
    "loop-qlora-cudagraph": Row("nf4", **LOOP, cuda_graph=True, lora_row="loop-lora-cudagraph"),
    "loop-lora-cudagraph": Row("bf16", **LOOP, cuda_graph=True),
    "loop-qlora-c4096": Row("nf4", **{**LOOP, "chunk": 4096}, lora_row="loop-lora"),
    "loop-qlora-cudagraph-c4096": Row("nf4", **{**LOOP, "chunk": 4096}, cuda_graph=True,
                                      lora_row="loop-lora-cudagraph"),
    "loop-qlora-cudagraph-ckpt30": Row("nf4", **LOOP, cuda_graph=True, checkpointed=30,
                                       lora_row="loop-lora-cudagraph"),
    "loop-qlora-cudagraph-fullrerun": Row("nf4", **LOOP, cuda_graph=True, full_rerun=True,
                                          lora_row="loop-lora-cudagraph"),
    "loop-lora-cudagraph-fullrerun": Row("bf16", **LOOP, cuda_graph=True, full_rerun=True),
    "loop-qlora-emb": Row("nf4", **LOOP, offload_embeddings=True, lora_row="loop-lora"),
    **{f"loop-qlora-cudagraph-emb{suffix}": Row("nf4", **LOOP, cuda_graph=True, offload_embeddings=True,
                                                checkpointed=n, lora_row="loop-lora-cudagraph")
       for suffix, n in (("", True), ("-ckpt29", 29), ("-ckpt28", 28), ("-ckpt27", 27), ("-ckpt26", 26))},
    **{f"loop-qlora-cudagraph-emb-off-ckpt{n}": Row("nf4", **LOOP, cuda_graph=True, offload_embeddings=True,
                                                   offload_activations=True, checkpointed=n,
                                                   lora_row="loop-lora-cudagraph")
       for n in (29, 26, 24, 22, 20, 18, 16)},
    **{f"loop-qlora-cudagraph-emb-off{n}-ckpt{c}": Row("nf4", **LOOP, cuda_graph=True, offload_embeddings=True,
                                                       offload_activations=n, checkpointed=c,
                                                       lora_row="loop-lora-cudagraph")
       for n, c in ((28, 20), (26, 20), (26, 18), (28, 18), (24, 16), (26, 16), (24, 18))},
    **{f"loop-qlora-cudagraph-emb-off-ckpt{c}-lag{lag}": Row("nf4", **LOOP, cuda_graph=True, offload_embeddings=True,
                                                           offload_activations=True, checkpointed=c,
                                                           offload_in_flight=lag, lora_row="loop-lora-cudagraph")
       for c in (18, 20, 22) for lag in (3, 4)},
    "loop-qlora-emb-off-ckpt22": Row("nf4", **LOOP, offload_embeddings=True, offload_activations=True,
                                     checkpointed=22, lora_row="loop-lora"),
    "entrenar-qlora-chunked": Row("nf4", loss="chunked", lora_row="entrenar-lora-chunked"),
    "entrenar-lora-chunked": Row("bf16", loss="chunked"),
    "entrenar-qlora-torchdq": Row("nf4", torch_dequant=True, steps=5, warmup=2, lora_row="entrenar-lora"),
}


@dataclass
class Result:
    row: str
    status: str = "ok"
    error: str | None = None
    tokens_per_s: float | None = None
    step_ms_median: float | None = None
    step_ms_all: list[float] = field(default_factory=list)
    peak_gib: float | None = None  # max allocated during training, less the row's starting allocation
    resident_gib: float | None = None  # allocated after building (weights + adapters)
    build_peak_gib: float | None = None
    build_s: float | None = None
    losses: list[float] = field(default_factory=list)
    trainable_params: int | None = None
    profile: dict | None = None


# ---------------------------------------------------------------- weights


def _generator(name: str) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(zlib.crc32(name.encode()))


def random_weight(name: str, shape: tuple[int, ...], std: float = 0.02) -> torch.Tensor:
    """The bf16 weight named ``name``: the same tensor in every row and either stack."""
    return torch.empty(shape, dtype=torch.bfloat16, device=DEVICE).normal_(0.0, std, generator=_generator(name))


@torch.no_grad()
def init_parameters(model: nn.Module) -> None:
    """Norms 1, every other (16-bit) parameter from :func:`random_weight`."""
    for name, p in model.named_parameters():
        name = name.removeprefix("base_model.model.")
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.copy_(random_weight(name, tuple(p.shape)))


def build_entrenar(row: Row) -> nn.Module:
    model = empty_model(CONFIG, torch.bfloat16, DEVICE, nf4_sinks if row.base == "nf4" else None)
    init_parameters(model)
    for name, layer in model.named_modules():
        if isinstance(layer, NF4Linear):  # quantized one layer at a time, as weights stream in
            layer.load_full_weight(random_weight(f"{name}.weight", (layer.out_features, layer.in_features)))
    apply_lora(model, LoraConfig(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0))
    if row.offload_embeddings:
        from entrenar.kernels.host_embedding import offload_embeddings

        offload_embeddings(model)
    model.set_activation_checkpointing(row.checkpointed, offload=row.offload_activations)
    if row.offload_in_flight and model.activation_offload is not None:
        model.activation_offload.in_flight = row.offload_in_flight
    if row.kernels:
        from entrenar.kernels import apply_kernels

        apply_kernels(model, row.kernels, lora_compute_dtype=torch.bfloat16 if row.bf16_adapters else None)
    if row.compile == "blocks":
        for block in model.model.layers:
            block.compile()
    return model.train()


def build_hf() -> nn.Module:
    """transformers' Llama with every linear layer but the head as bitsandbytes NF4, then PEFT LoRA."""
    import bitsandbytes as bnb
    import peft
    import transformers

    hf_config = dict(CONFIG.to_hf())
    hf_config = transformers.AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
    hf_config.use_cache = False
    with torch.device(DEVICE):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    init_parameters(model)
    for name, linear in list(model.named_modules()):
        if not isinstance(linear, nn.Linear) or name == "lm_head":
            continue
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False, compute_dtype=torch.bfloat16,
                              compress_statistics=True, quant_type="nf4", device="meta")
        q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, blocksize=64, compress_statistics=True,
                                     quant_type="nf4", module=q).to(DEVICE)  # quantizes
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, q)
        del linear
    model.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=...) sets; PEFT reads it
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                       target_modules="all-linear", task_type="CAUSAL_LM"))
    return model.train()


# ---------------------------------------------------------------- one step


def step_fn(row: Row) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    if row.loss == "hf":
        return lambda model, ids: model(input_ids=ids, labels=ids).loss
    if row.loss == "logits":  # what entrenar.train.loop does for each micro-batch
        def step(model, ids):
            with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=row.autocast, cache_enabled=not row.cuda_graph):
                logits = model(ids)
            loss_sum, n = token_cross_entropy(logits, ids)
            return loss_sum / n
        return step
    if row.loss == "chunked":
        loss_fn = chunked_cross_entropy
    else:
        from entrenar.kernels import fused_linear_cross_entropy as loss_fn

    def loss_of(model, ids):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=row.autocast, cache_enabled=not row.cuda_graph):
            hidden = model.hidden_states(ids)
            if row.loss_in_autocast:
                return loss_fn(hidden, model.lm_head.weight, ids, row.chunk)
        return loss_fn(hidden, model.lm_head.weight, ids, row.chunk)

    loss_of = torch.compile(loss_of) if row.compile == "step" else loss_of

    def step(model, ids):
        loss_sum, n = loss_of(model, ids)
        return loss_sum / n
    return step


@contextlib.contextmanager
def reference_dequantization(on: bool) -> Iterator[None]:
    """While ``on``, CUDA NF4 weights are dequantized by the PyTorch specification instead of the kernel."""
    from entrenar.quant.nf4 import kernel as nf4_kernel

    kernel_check = nf4_kernel.can_dequantize
    if on:
        nf4_kernel.can_dequantize = lambda q: False
    try:
        yield
    finally:
        nf4_kernel.can_dequantize = kernel_check


@contextlib.contextmanager
def full_rerun(on: bool) -> Iterator[None]:
    """While ``on``, checkpointed fused blocks rerun everything in backward (no skipped down projection)."""
    from entrenar.kernels import norm_projections

    skip_check = norm_projections.recomputing
    if on:
        norm_projections.recomputing = lambda: False
    try:
        yield
    finally:
        norm_projections.recomputing = skip_check


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# First match wins: attention kernels' names also hold "sm90" and "gemm"-like words.
KERNEL_KINDS = (("dequantize", ("dequant",)), ("attention", ("flash", "fmha", "attention", "sdpa")),
                ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "cublas")))


def profile_step(forward_backward: Callable[[], object], opt: torch.optim.Optimizer, set_to_none: bool) -> dict:
    """GPU time of one eager training step, by kernel kind (names matched loosely), the 30 largest kernels
    (name, ms, launches) and the 15 most launched (name, launches, ms)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward_backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    launches: dict[str, int] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us and e.key and not e.key.startswith(("aten::", "ProfilerStep", "cuda")):
            kernels[e.key] = kernels.get(e.key, 0.0) + us
            launches[e.key] = launches.get(e.key, 0) + e.count
    by_kind = dict.fromkeys([k for k, _ in KERNEL_KINDS] + ["other"], 0.0)
    for name, us in kernels.items():
        low = name.lower()
        kind = next((k for k, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")
        by_kind[kind] += us / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:30]
    most_launched = sorted(launches.items(), key=lambda kv: -kv[1])[:15]
    return {"ms_by_kind": by_kind, "ms_total": sum(by_kind.values()), "launches": sum(launches.values()),
            "top_kernels_ms": [(name[:120], us / 1e3, launches[name]) for name, us in top],
            "most_launched": [(name[:120], n, kernels[name] / 1e3) for name, n in most_launched]}


def replay_timeline(replay: Callable[[], object]) -> dict:
    """Where one CUDA-graph replay's time goes: the span from its first kernel's start to its last one's end,
    the time some kernel (or memset) runs, and the idle gaps between them by size, with the largest gaps and
    what ran on either side; and the time copies ran (beside the kernels)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as saved:
            trace = json.load(saved)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    copies_ms = sum(e["dur"] for e in events if e.get("cat") == "gpu_memcpy") / 1e3
    # Kernels only: copies run beside them on their own engines (offloaded activations).
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in ("kernel", "gpu_memset"))
    if not ops:
        return {"error": "no device events in the trace"}
    busy, gaps, reach, before = 0.0, [], ops[0][0], ops[0][2]
    for begin, finish, name in ops:
        if begin > reach:
            gaps.append((begin - reach, before, name))
        busy += max(0.0, finish - max(begin, reach))
        if finish > reach:
            reach, before = finish, name
    buckets = {"<2us": (0, 2), "2-5us": (2, 5), "5-20us": (5, 20), "20-100us": (20, 100), ">=100us": (100, 1e12)}
    return {"replay_ms_events": start.elapsed_time(end), "span_ms": (reach - ops[0][0]) / 1e3,
            "busy_ms": busy / 1e3, "device_ops": len(ops), "copies_ms": copies_ms,
            "gaps": {k: [sum(1 for g in gaps if lo <= g[0] < hi),
                         round(sum(g[0] for g in gaps if lo <= g[0] < hi) / 1e3, 3)]
                     for k, (lo, hi) in buckets.items()},
            "largest_gaps_us": [(round(g[0], 1), g[1][:70], g[2][:70]) for g in sorted(gaps, reverse=True)[:12]]}


def run_row(name: str, row: Row, batches: list[torch.Tensor], profile: bool) -> Result:
    result = Result(name)
    _free()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    model = build_hf() if row.base == "hf" else build_entrenar(row)
    torch.cuda.synchronize()
    result.build_s = time.perf_counter() - t0
    result.build_peak_gib = (torch.cuda.max_memory_allocated() - before) / GiB
    params = [p for p in model.parameters() if p.requires_grad]
    result.trainable_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)
    step = step_fn(row)
    _free()
    result.resident_gib = (torch.cuda.memory_allocated() - before) / GiB
    torch.cuda.reset_peak_memory_stats()

    def forward_backward(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = step(model, inputs["ids"])  # noqa: F821 - bound when called (pyflakes sees the later `del model`)
        loss.backward()
        return loss.detach()

    run = GraphedMicroStep(forward_backward, params) if row.cuda_graph else forward_backward
    times = []
    for i in range(row.steps):
        ids = batches[i % len(batches)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = run({"ids": ids})
        opt.step()
        opt.zero_grad(set_to_none=not row.cuda_graph)  # a graph adds into its gradients: zeroed in place
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        result.losses.append(round(loss.item(), 5))
    result.peak_gib = (torch.cuda.max_memory_allocated() - before) / GiB
    result.step_ms_all = [round(t, 2) for t in times]
    result.step_ms_median = statistics.median(times[row.warmup:])
    result.tokens_per_s = BATCH * SEQ / (result.step_ms_median / 1e3)
    if profile:
        try:
            result.profile = profile_step(lambda: forward_backward({"ids": batches[0]}), opt,
                                          set_to_none=not row.cuda_graph)
        except Exception as err:  # the profiler is a nicety; the timings stand without it
            result.profile = {"error": f"{type(err).__name__}: {err}"[:300]}
        if row.cuda_graph:
            try:
                result.profile["graph_replay"] = replay_timeline(lambda: run({"ids": batches[0]}))  # noqa: F821
            except Exception as err:
                result.profile["graph_replay"] = {"error": f"{type(err).__name__}: {err}"[:300]}
    del model, opt, params, loss, run
    return result


# ---------------------------------------------------------------- report


def estimates() -> dict:
    return {m: estimate_training_memory(CONFIG, m, BATCH, SEQ, lora_r=LORA_R, activation_checkpointing=True).as_dict()
            for m in ("qlora", "lora")}


def print_report(results: list[Result], est: dict) -> None:
    ok = {r.row: r for r in results if r.status == "ok"}
    hf = ok.get("hf-qlora")
    print(f"\n{'row':<24}{'tok/s':>8}{'ms/step':>9}{'peak GiB':>9}{'held GiB':>9}{'x hf':>6}{'/ lora':>7}"
          f"{'loss 0':>8}{'loss N':>8}")
    for r in results:
        if r.status != "ok":
            print(f"{r.row:<24}  {r.status}: {(r.error or '')[:150]}")
            continue
        lora = ok.get(ROWS[r.row].lora_row or "")
        cells = [f"{r.tokens_per_s:8.0f}", f"{r.step_ms_median:9.1f}", f"{r.peak_gib:9.2f}", f"{r.resident_gib:9.2f}",
                 f"{r.tokens_per_s / hf.tokens_per_s:6.2f}" if hf else f"{'-':>6}",
                 f"{r.tokens_per_s / lora.tokens_per_s:7.2f}" if lora else f"{'-':>7}",
                 f"{r.losses[0]:8.4f}", f"{r.losses[-1]:8.4f}"]
        print(f"{r.row:<24}" + "".join(cells))
    print("\n('/ lora': tokens/s over the entrenar 16-bit LoRA row with the same loss and kernels)")
    for method, row in (("qlora", "entrenar-qlora"), ("lora", "entrenar-lora")):
        e = est[method]
        line = (f"estimate_training_memory(config, {method!r}, {BATCH}, {SEQ}, lora_r={LORA_R}, "
                f"activation_checkpointing=True): {e['total'] / GiB:.2f} GiB (weights {e['weights'] / GiB:.2f}, "
                f"grads {e['gradients'] / GiB:.2f}, optimizer {e['optimizer'] / GiB:.2f}, "
                f"activations {e['activations'] / GiB:.2f}, logits {e['logits'] / GiB:.2f})")
        print(line)
        if row in ok:
            r = ok[row]
            print(f"  {row}: measured peak {r.peak_gib:.2f} GiB, "
                  f"measured/predicted = {r.peak_gib * GiB / e['total']:.3f}; "
                  f"held after build {r.resident_gib:.2f} GiB vs weights term {e['weights'] / GiB:.2f}")
    for r in results:
        if r.profile and "ms_by_kind" in r.profile:
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in r.profile["ms_by_kind"].items())
            print(f"profile {r.row}: {r.profile['ms_total']:.1f} ms of kernels ({kinds})")
        replay = (r.profile or {}).get("graph_replay")
        if replay and "span_ms" in replay:
            print(f"  graph replay {r.row}: {replay['replay_ms_events']:.1f} ms (events), "
                  f"span {replay['span_ms']:.1f}, "
                  f"busy {replay['busy_ms']:.1f}, copies {replay['copies_ms']:.1f}, {replay['device_ops']} kernels, "
                  f"gaps [count, ms] {replay['gaps']}")


def environment() -> dict:
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "argv": sys.argv,
           "gpu": torch.cuda.get_device_name()}
    for name in ("transformers", "peft", "triton", "bitsandbytes"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # missing, or bitsandbytes without a binary for this CUDA
            env[name] = None
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    parser.add_argument("--out", default="bench_qlora.json")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="start no new row after this many seconds")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="steps per row, warm-up included (default: the row's)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_qlora.py needs a CUDA GPU")
    names = args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        sys.exit(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    g = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), generator=g).cuda() for _ in range(4)]
    est = estimates()
    began = time.perf_counter()
    results: list[Result] = []
    for name in names:
        if time.perf_counter() - began > args.budget_s:
            results.append(Result(name, status="skipped", error="time budget"))
            continue
        t0 = time.perf_counter()
        try:
            row = ROWS[name] if args.steps is None else replace(ROWS[name], steps=args.steps)
            with reference_dequantization(row.torch_dequant), full_rerun(row.full_rerun):
                results.append(run_row(name, row, batches, profile=not args.no_profile))
        except Exception as err:  # a failed row is reported and the others still run
            results.append(Result(name, status="failed", error=f"{type(err).__name__}: {err}"[:2000]))
        _free()
        r = results[-1]
        print(f"[{time.perf_counter() - began:6.1f}s] {name}: {r.status} "
              f"{'' if r.tokens_per_s is None else f'{r.tokens_per_s:.0f} tok/s, peak {r.peak_gib:.2f} GiB'} "
              f"({time.perf_counter() - t0:.1f}s) {r.error or ''}", flush=True)
        Path(args.out).write_text(json.dumps({"environment": environment(), "config": asdict(CONFIG),
                                              "batch": BATCH, "seq": SEQ, "lora_r": LORA_R, "estimates": est,
                                              "rows": [asdict(x) for x in results]}, indent=1))
    print_report(results, est)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
