"""Speed that users get: `entrenar train` on a recipe against the baseline they would run, on the same tokens.

Each case builds one random Hugging Face folder of a real model's shape (with SmolLM2's tokenizer, vocabulary
49,152) and one JSONL of real English text, then runs, each in its own process:

  entrenar           `python -m entrenar.cli.main train RECIPE` with the case's default recipe (what a user writes
                     from recipes/: bf16, `kernels: auto`, packing on); tokens/s and memory from its metrics.jsonl
  entrenar-fast      the same with the case's documented fast settings (docs/PERFORMANCE.md, docs/QUANTIZATION.md)
  hf                 transformers + PEFT under bf16 autocast, as HF Trainer's `bf16=True` runs it: fp32 adapters,
                     fused AdamW, clipping at 1.0; QLoRA with bitsandbytes NF4 + double quantization and
                     prepare_model_for_kbit_training (gradient checkpointing in effect: the model is put in
                     `.train()` mode); the 8B cases with gradient checkpointing
  hf-liger           the same with Liger kernels (`_apply_liger_kernel_to_instance`, before PEFT wraps the model)
  <row>-wrapped      a transformers row on transformers' own packing instead (run_clm's `group_texts`): the same
                     documents in the same order, concatenated and cut every `seq` tokens, so its rows have no
                     padding (documents split across rows and attending to each other); every token is real

`lora-moe` is a random Qwen3-MoE model (MOE_SHAPES): LoRA on attention and on every expert, both stacks with the
Switch load-balancing loss at weight 0.001 (recipes/moe-qwen3-lora.yaml's `moe.aux_loss`, transformers'
`router_aux_loss_coef`). transformers runs its experts through `experts_implementation="grouped_mm"` (its
fastest built in; `batched_mm` needs hundreds of GiB at these shapes, see docs/MOE.md) and PEFT adapts them
with `target_parameters` (ParamWrapper: each step it folds every expert's low-rank update into a copy of the
stacked weight, where entrenar runs `x A_e^T B_e^T` on each expert's tokens). Its losses are the language-model
loss (transformers' `loss - coef * aux_loss`), as entrenar's metrics report them.

The CPU case (`cpu-smollm2`, SmolLM2-135M's shape, batch 2 x 512) runs fp32 on the CPU instead: `entrenar` with
`training.precision: fp32`, `entrenar-fast` with `bf16` (autocast on the CPU), `hf` in fp32 (HF Trainer on a CPU
without `bf16=True`) and `hf-bf16` under CPU bf16 autocast (Trainer with `bf16=True` on a CPU). Its peak memory is
each process's peak resident memory (`ru_maxrss`), and `--repeat N` runs its rows round-robin N times (the
machine's speed drifts; the table gives the median over repeats and their spread).

The transformers rows are fed the very batches entrenar's data pipeline makes from the same file, seed and
settings (packed rows of whole documents), without a document mask, as transformers' run_clm `group_texts`
feeds packed rows. tokens/s counts real (non-padding) tokens: the median over steps after the first
`--skip` (warm-up, compilation, graph capture). Peak memory is torch.cuda.max_memory_allocated over the
whole process (model load included), in GiB. MFU uses bench_train.py's FLOP count and 989.4 TFLOP/s.

    PYTHONPATH=src python bench/bench_e2e.py --cases lora-1b --text .e2e/text.jsonl \
        --tokenizer .e2e --work /tmp/e2e --out e2e.json
    PYTHONPATH=src python bench/bench_e2e.py --cases cpu-smollm2 --repeat 3 --out e2e-cpu.json

`--tiny` runs any case at a toy size (hidden 64, 2 layers, 8 experts for MoE, 2 x 128 tokens, 4 steps), on the
CPU when there is no GPU: a smoke test that every row starts, trains and reports, not a measurement.

On the GPU machine: peft ships there; bitsandbytes and liger-kernel travel as wheels (bench/README of
docs/PERFORMANCE.md gives the call). Rows whose package is missing are reported as skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

GiB = 2**30
PEAK_BF16_FLOPS = 989.4e12
LORA = {"r": 16, "alpha": 32}
LR = 1e-4
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # recipes/moe-qwen3-lora.yaml's
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

# Qwen3-30B-A3B's block at half its width and a third of its depth, about 1.8B parameters of which 0.39B are
# active per token: 64 experts (OLMoE's count; 128 at this size would leave 512 tokens per expert per step)
# of width 512 (Qwen3's 768/2048 and OLMoE's 1024/2048 ratios give 384-512), top-8 renormalised, 16 query
# heads of 128 (query width twice the hidden size, as in Qwen3-30B-A3B) and 4 KV heads, q/k norms, untied.
MOE_SHAPES: dict[str, dict] = {
    "qwen3-moe-1.8b-a0.4b": {
        "hidden_size": 1024, "num_layers": 16, "num_heads": 16, "num_kv_heads": 4, "head_dim": 128,
        "intermediate_size": 3072, "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "norm_topk_prob": True, "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000.0,
        "model_type": "qwen3_moe", "qk_norm": True,
    },
}
# --tiny: every shape at a toy size (MoE keys only where the shape has experts).
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "intermediate_size": 128}
TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
TINY_CASE = {"batch": 2, "seq": 128, "steps": 4}

CASES: dict[str, dict] = {
    "lora-1b": {"shape": "llama-1b", "method": "lora", "batch": 4, "seq": 2048, "ckpt": False, "steps": 30,
                "fast": {"adapter_math": "bf16", "cuda_graphs": True}},
    "lora-qwen3": {"shape": "qwen3-1.7b", "method": "lora", "batch": 4, "seq": 2048, "ckpt": False, "steps": 30,
                   "fast": {"adapter_math": "bf16", "cuda_graphs": True}},
    "full-1b": {"shape": "llama-1b", "method": "full", "batch": 4, "seq": 2048, "ckpt": False, "steps": 20,
                "fast": {"cuda_graphs": True}},
    "lora-8b": {"shape": "llama-8b", "method": "lora", "batch": 2, "seq": 2048, "ckpt": True, "steps": 16,
                "fast": {"adapter_math": "bf16", "cuda_graphs": True, "offload_activations": True,
                         "activation_checkpointing": 20}},
    "qlora-8b": {"shape": "llama-8b", "method": "qlora", "batch": 2, "seq": 2048, "ckpt": True, "steps": 16,
                 "fast": {"cuda_graphs": True, "offload_embeddings": True, "offload_activations": True,
                          "activation_checkpointing": 20}},
    # CUDA graphs on by default here too (grouped experts keep their token counts on the device): fast is bf16 adapters.
    "lora-moe": {"shape": "qwen3-moe-1.8b-a0.4b", "method": "lora", "batch": 4, "seq": 2048, "ckpt": False,
                 "steps": 30, "fast": {"adapter_math": "bf16"}, "target_modules": ATTENTION,
                 "target_parameters": EXPERT_TARGETS, "moe": {"aux_loss": 0.001}},
    "cpu-smollm2": {"shape": "smollm2-135m", "method": "lora", "batch": 2, "seq": 512, "ckpt": False, "steps": 12,
                    "device": "cpu", "precision": "fp32", "fast": {"precision": "bf16"},
                    "rows": ("entrenar", "entrenar-fast", "hf", "hf-bf16")},
}
ROWS = ("entrenar", "entrenar-fast", "hf", "hf-liger", "hf-bf16", "hf-wrapped", "hf-liger-wrapped",
        "hf-bf16-wrapped")
CPU_CASES = tuple(name for name, case in CASES.items() if case.get("device") == "cpu")


def shape_config(shape: str, vocab: int, seq: int, tiny: bool = False):
    """entrenar's ModelConfig for a bench_train (or MoE) shape, with the tokenizer's vocabulary."""
    from bench_train import SHAPES

    from entrenar.models.config import ModelConfig

    fields = {**{**SHAPES, **MOE_SHAPES}[shape], "vocab_size": vocab}
    if tiny:
        fields.update(TINY, **(TINY_MOE if fields.get("num_experts") else {}))
    return ModelConfig(**fields, max_position_embeddings=max(seq, 4096))


def case_flops(cfg, method: str, seq: int) -> float:
    """Training FLOPs per token: bench_train's count, or for an MoE model the same count over what a token uses
    (attention, the router, k experts; LoRA on attention and on those k experts)."""
    from bench_train import LORA_R, flops_per_token

    if not cfg.num_experts:
        return flops_per_token(cfg, "full" if method == "full" else "lora", seq)[0]
    h, i, k = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts_per_tok
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = [(h, q), (h, kv), (h, kv), (q, h)]
    n_matmul, n_lora = cfg.vocab_size * h, 0
    for layer in range(cfg.num_layers):
        n_matmul += sum(a * b for a, b in attention)
        n_lora += sum(LORA_R * (a + b) for a, b in attention)
        if cfg.is_moe_layer(layer):
            n_matmul += cfg.num_experts * h + k * 3 * h * i
            n_lora += k * LORA_R * ((h + 2 * i) + (i + h))  # gate_up [2I, H] and down [H, I] per expert
        else:
            n_matmul += 3 * h * cfg.intermediate_size
    attend = 6 * cfg.num_layers * seq * q
    return float(6 * n_matmul + attend if method == "full" else 4 * n_matmul + 6 * n_lora + attend)


def case_for(name: str, steps: int, tiny: bool, cases: dict[str, dict] | None = None) -> dict:
    """The case's settings (from ``cases``, default this script's), with --steps and --tiny applied."""
    case = dict((cases or CASES)[name])
    if tiny:
        case.update(TINY_CASE, ckpt=False)
    case["steps"] = steps or case["steps"]
    return case


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- inputs


def make_model_folder(shape: str, vocab: int, seq: int, tokenizer_dir: Path, folder: Path,
                      tiny: bool = False) -> Path:
    """A random bf16 Hugging Face folder of `shape` (transformers' own initialisation) with the tokenizer."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    hf = dict(shape_config(shape, vocab, seq, tiny).to_hf())
    model_type = hf.pop("model_type")
    config = transformers.AutoConfig.for_model(model_type, **hf)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device()):
            model = transformers.AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(default)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="5GB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp / name)
    del model
    tmp.rename(folder)
    return folder


def recipe_for(case: dict, folder: Path, text: Path, run_dir: Path, fast: bool) -> dict:
    """The recipe a user would write for the case (fast: plus the documented fast settings)."""
    training = {"max_steps": case["steps"], "batch_size": case["batch"], "grad_accum": 1, "max_grad_norm": 1.0,
                "precision": case.get("precision", "bf16"), "activation_checkpointing": case["ckpt"], "kernels": "auto",
                "seed": 0, "eval_every": 0, "save_every": 0, "log_every": 1}
    if fast:
        training.update(case["fast"])
        if device() == "cpu" and training.get("adapter_math") == "bf16":
            training["kernels"] = True  # the fused layers' PyTorch fallbacks (--tiny on a machine without CUDA)
    lora = None
    if case["method"] in ("lora", "qlora"):
        lora = {**LORA, "dropout": 0.0, "target_modules": case.get("target_modules", "all-linear"),
                "quantize_base": "nf4" if case["method"] == "qlora" else None}
        if case.get("target_parameters"):
            lora["target_parameters"] = case["target_parameters"]
    extra = {"moe": case["moe"]} if case.get("moe") else {}
    return {
        "model": {"path": str(folder), "device": case.get("device", device())},
        "data": {"train": str(text), "validation_split": 0.0, "seq_len": case["seq"], "packing": True,
                 "train_on": "all", "add_eos": True, "shuffle": True},
        "lora": lora,
        "optimizer": {"name": "adamw", "lr": LR},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "training": training,
        "output": {"dir": str(run_dir)},
        **extra,
    }


def packed_batches(tokenizer_dir: Path, text: Path, case: dict, n: int) -> list[dict]:
    """The first `n` batches entrenar's loop trains on for this case (same reader, tokenizer, packing, seed)."""
    from entrenar.data import BatchStream, read_records, split_validation, tokenize_records
    from entrenar.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(tokenizer_dir)
    records, _ = read_records(str(text), format="auto", on_error="raise")
    examples, _ = tokenize_records(records, tokenizer, case["seq"], train_on="all", add_eos=True,
                                   columns={"text": "text", "prompt": "prompt", "completion": "completion",
                                            "messages": "messages"}, on_error="raise")
    examples, _ = split_validation(examples, 0.0, seed=0)
    stream = BatchStream(examples, case["batch"], case["seq"], packing=True, shuffle=True, seed=0,
                         pad_id=tokenizer.pad_id or 0)
    return [next(stream) for _ in range(n)]


def wrapped_batches(batches: list[dict], more: list[dict]) -> list[dict]:
    """``len(batches)`` batches as run_clm's `group_texts` makes them from the same documents in the same order:
    the real tokens of ``batches`` then ``more`` end to end, cut into rows of the same length, labels = inputs.
    Every position is real (no padding, no document ids: transformers attends across documents)."""
    import torch

    rows, width = batches[0]["input_ids"].shape
    stream = torch.cat([b["input_ids"][b["document_ids"] >= 0] for b in [*batches, *more]])
    need = len(batches) * rows * width
    if stream.numel() < need:
        raise ValueError(f"{stream.numel()} real tokens in the batches given; wrapping needs {need}")
    ids = stream[:need].view(len(batches), rows, width)
    return [{"input_ids": x, "labels": x.clone(), "document_ids": torch.zeros_like(x)} for x in ids]


# ---------------------------------------------------------------- rows


def summarise(step_s: list[float], tokens: list[int], losses: list[float], skip: int, flops_per_token: float,
              peak_bytes: float | None, wall_s: float) -> dict:
    timed = list(range(min(skip, len(step_s) - 1), len(step_s)))
    rates = [tokens[i] / step_s[i] for i in timed if step_s[i] > 0]
    tps = statistics.median(rates) if rates else None
    return {"tokens_per_s": tps, "step_ms_median": statistics.median(step_s[i] for i in timed) * 1e3,
            "mfu": tps * flops_per_token / PEAK_BF16_FLOPS if tps else None,
            "peak_gib": peak_bytes / GiB if peak_bytes else None, "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "losses": losses, "steps": len(step_s), "wall_s": wall_s,
            "tokens_per_step": statistics.median(tokens) if tokens else None}


def run_entrenar(case_name: str, case: dict, folder: Path, text: Path, work: Path, fast: bool, skip: int,
                 flops: float, overrides: tuple[str, ...] = ()) -> dict:
    run_dir = work / f"run-{case_name}-{'fast' if fast else 'default'}"
    shutil.rmtree(run_dir, ignore_errors=True)
    recipe_path = work / f"{case_name}-{'fast' if fast else 'default'}.yaml"
    recipe = recipe_for(case, folder, text, run_dir, fast)
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    started = time.perf_counter()
    sets = [a for o in overrides for a in ("--set", o)]
    returncode, output, max_rss = run_process(
        [sys.executable, "-m", "entrenar.cli.main", "train", str(recipe_path), "--no-progress", *sets],
        work / f"{case_name}-{'fast' if fast else 'default'}.log", {**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - started
    if returncode != 0:
        return {"status": "failed", "error": output[-2000:], "recipe": recipe}
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in lines if "loss" in r and r.get("tokens")]
    step_s = [r["tokens"] / r["tokens_per_s"] for r in steps]
    on_cpu = case.get("device") == "cpu"
    peak = max_rss if on_cpu else max((r.get("peak_mem_gb") or 0) for r in steps) * 1e9
    out = summarise(step_s, [r["tokens"] for r in steps], [r["loss"] for r in steps], skip, flops, peak, wall)
    return {"status": "ok", **out, "recipe": recipe}


def run_process(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, str, int]:
    """(exit code, output, peak resident bytes) of a command run to its end; the peak is the child's own."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, log.read_text(), usage.ru_maxrss * 1024  # kilobytes on Linux


def run_hf(case: dict, folder: Path, tokenizer_dir: Path, text: Path, row: str, skip: int, flops: float) -> dict:
    """transformers + PEFT (+ bitsandbytes, + Liger) under bf16 autocast, in this process; on the CPU case in
    fp32 (``hf``) or under CPU bf16 autocast (``hf-bf16``)."""
    import torch
    import transformers

    try:
        import peft
    except ImportError as e:
        return {"status": "skipped", "error": f"peft: {e}"}
    wrapped = row.endswith("-wrapped")
    row = row.removesuffix("-wrapped")
    liger = row == "hf-liger"
    if liger:
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance
        except ImportError as e:
            return {"status": "skipped", "error": f"liger-kernel: {e}"}
    batches = packed_batches(tokenizer_dir, text, case, case["steps"])
    if wrapped:  # the same documents, group_texts' way: half as many batches again to draw from
        more = packed_batches(tokenizer_dir, text, case, case["steps"] * 3 // 2 + 2)[case["steps"]:]
        batches = wrapped_batches(batches, more)
    started = time.perf_counter()
    dev = case.get("device", device())
    autocast = dev == "cuda" or row == "hf-bf16"
    kwargs = {"attn_implementation": "sdpa"}
    aux_coef = (case.get("moe") or {}).get("aux_loss", 0.0)
    if case.get("target_parameters"):  # MoE: the grouped experts and the router loss entrenar's recipe has
        kwargs.update(experts_implementation="grouped_mm", output_router_logits=aux_coef > 0,
                      router_aux_loss_coef=aux_coef)
    if case["method"] == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            return {"status": "skipped", "error": f"bitsandbytes: {e}"}
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": 0}
    # HF Trainer with bf16=True: LoRA bases in bf16 as loaded; a full fine-tune keeps fp32 master weights.
    # On the CPU case, fp32 weights (with bf16=True, Trainer autocasts around them).
    dtype = torch.float32 if case["method"] == "full" or case.get("device") == "cpu" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    if case["method"] != "qlora":
        model = model.to(dev)
    model.config.use_cache = False
    if liger:
        _apply_liger_kernel_to_instance(model=model)
    if case["method"] == "qlora":
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    elif case["ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if case["method"] in ("lora", "qlora"):
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
            target_modules=case.get("target_modules", "all-linear"),
            target_parameters=case.get("target_parameters"), task_type="CAUSAL_LM"))
    model.train()  # from_pretrained returns eval mode, where gradient checkpointing is not in effect
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, fused=True)
    step_s, tokens, losses = [], [], []
    for batch in batches:
        ids, labels = batch["input_ids"].to(dev), batch["labels"].to(dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            output = model(input_ids=ids, labels=labels)
        loss = output.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if getattr(output, "aux_loss", None) is not None:  # entrenar's `loss` is the language-model loss alone
            loss = loss.detach() - aux_coef * output.aux_loss.detach()
        losses.append(float(loss))  # the host sync the step ends with
        step_s.append(time.perf_counter() - t0)
        tokens.append(int((batch["document_ids"] >= 0).sum()))
    wall = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None  # CPU: the parent reads ru_maxrss
    out = summarise(step_s, tokens, losses, skip, flops, peak, wall)
    gc_checkpointing = getattr(getattr(model, "base_model", model), "is_gradient_checkpointing", None)
    return {"status": "ok", **out, "gradient_checkpointing": gc_checkpointing,
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "trainable_params": sum(p.numel() for p in trainable)}


def run_row_process(row: str, case_name: str, folder: Path, args: argparse.Namespace) -> dict:
    """A transformers row in a fresh process, so neither stack's memory counts against the other."""
    out = Path(args.work) / f"{case_name}-{row}.json"
    cmd = [sys.executable, __file__, "--hf-row", row, "--cases", case_name, "--folder", str(folder),
           "--text", args.text, "--tokenizer", args.tokenizer, "--work", args.work, "--skip", str(args.skip),
           "--out", str(out)]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    if args.tiny:
        cmd += ["--tiny"]
    out.unlink(missing_ok=True)
    returncode, output, max_rss = run_process(cmd, out.with_suffix(".log"))
    if returncode != 0 or not out.is_file():
        return {"status": "failed", "error": output[-2000:]}
    result = json.loads(out.read_text())
    if result.get("status") == "ok" and result.get("peak_gib") is None:
        result["peak_gib"] = max_rss / GiB
    return result


# ---------------------------------------------------------------- report


def print_table(results: list[dict]) -> None:
    """One line per case and row; with several repeats, the median over them (and min-max of tokens/s). The
    ratios to a baseline row are medians of per-repeat ratios (rows of one repeat ran minutes apart); a column
    for each baseline row that ran (``vs hf-bf16-wrapped``: against that row on group_texts batches)."""
    bases = [b for b in ROWS[2:] if any(r["row"] == b and r["status"] == "ok" for r in results)]
    header = (f"{'case':<13}{'row':<17}{'tok/s':>9}{'min-max':>14}{'MFU':>6}{'peak GiB':>9}"
              + "".join(f"{'vs ' + b:>{len(b) + 5}}" for b in bases) + f"{'mem/liger':>10}{'loss first->last':>20}")
    print(header)
    keys = list(dict.fromkeys((r["case"], r["row"]) for r in results))
    for case, row in keys:
        runs = [r for r in results if (r["case"], r["row"]) == (case, row)]
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            print(f"{case:<13}{row:<17}{runs[-1]['status']}: {str(runs[-1].get('error', ''))[-160:]!r}")
            continue

        def ratio(key: str, base: str) -> str:
            pairs = [r[key] / b[key] for r in ok for b in results
                     if (b["case"], b["row"], b.get("repeat")) == (case, base, r.get("repeat"))
                     and b["status"] == "ok" and b.get(key)]
            return f"{statistics.median(pairs):.2f}" if pairs else "-"

        median = lambda key: statistics.median(r[key] or 0 for r in ok)  # noqa: E731
        tps = [r["tokens_per_s"] for r in ok]
        spread = f"{min(tps):.0f}-{max(tps):.0f}" if len(tps) > 1 else ""
        mfu = f"{median('mfu'):6.1%}" if ok[0]["mfu"] and case not in CPU_CASES else f"{'-':>6}"
        print(f"{case:<13}{row:<17}{median('tokens_per_s'):9.0f}{spread:>14}{mfu}{median('peak_gib'):9.2f}"
              + "".join(f"{ratio('tokens_per_s', b):>{len(b) + 5}}" for b in bases)
              + f"{ratio('peak_gib', 'hf-liger'):>10}{ok[0]['loss_first']:10.4f} ->{ok[0]['loss_last']:8.4f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="lora-1b", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--rows", default="", help=f"comma-separated, of {', '.join(ROWS)} (default: the case's)")
    p.add_argument("--repeat", type=int, default=1, help="run the case's rows round-robin this many times")
    p.add_argument("--text", default=".e2e/text.jsonl", help="JSONL of {'text': ...} records")
    p.add_argument("--tokenizer", default=".e2e", help="folder with tokenizer.json (SmolLM2's)")
    p.add_argument("--work", default="/tmp/e2e", help="where model folders and runs go")
    p.add_argument("--steps", type=int, default=0, help="override every case's step count")
    p.add_argument("--skip", type=int, default=5, help="steps left out of the median (warm-up, capture)")
    p.add_argument("--out", default="", help="JSON results file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for the entrenar rows (repeatable); the row name records it")
    p.add_argument("--tiny", action="store_true", help="toy sizes, CPU without a GPU: a smoke test, not a measurement")
    p.add_argument("--hf-row", default="", help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if device() == "cpu" and not args.tiny and not all(c in CPU_CASES for c in args.cases.split(",")):
        p.error("no CUDA device: the cases are GPU measurements (--tiny runs them at a toy size on the CPU)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir, text = Path(args.tokenizer), Path(args.text)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    vocab_size = 49152 if len(vocab) <= 49152 else len(vocab)

    if args.hf_row:  # one transformers row, called by run_row_process
        case = case_for(args.cases, args.steps, args.tiny)
        cfg = shape_config(case["shape"], vocab_size, case["seq"], args.tiny)
        flops = case_flops(cfg, case["method"], case["seq"])
        result = run_hf(case, Path(args.folder), tokenizer_dir, text, args.hf_row, args.skip, flops)
        Path(args.out).write_text(json.dumps(result))
        return

    import torch

    results = []
    for case_name in args.cases.split(","):
        case = case_for(case_name, args.steps, args.tiny)
        cfg = shape_config(case["shape"], vocab_size, case["seq"], args.tiny)
        flops = case_flops(cfg, case["method"], case["seq"])
        t0 = time.perf_counter()
        folder = make_model_folder(case["shape"], vocab_size, case["seq"], tokenizer_dir,
                                   work / (case["shape"] + ("-tiny" if args.tiny else "")), args.tiny)
        print(f"[{case_name}] model folder {folder} ready in {time.perf_counter() - t0:.0f}s", flush=True)
        torch.cuda.empty_cache()
        rows = args.rows.split(",") if args.rows else list(case.get("rows", ROWS[:4]))
        for repeat in range(args.repeat):
            for row in rows:
                t0 = time.perf_counter()
                if row.startswith("entrenar"):
                    r = run_entrenar(case_name, case, folder, text, work, row == "entrenar-fast", args.skip, flops,
                                     tuple(args.set))
                    row = " ".join([row, *args.set])
                else:
                    r = run_row_process(row, case_name, folder, args)
                results.append({"case": case_name, "row": row, "repeat": repeat, "load_avg": os.getloadavg(), **r})
                print(f"[{case_name}] {row}: {r['status']} {r.get('tokens_per_s') or ''} in "
                      f"{time.perf_counter() - t0:.0f}s", flush=True)
                write_results(args.out, results)  # after every row: a run cut short keeps what it measured
    print_table(results)


def write_results(out: str, results: list[dict]) -> None:
    import torch

    if out:
        env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "torch": torch.__version__, "python": platform.python_version(), "argv": sys.argv[1:],
               "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
        for name in ("transformers", "peft", "bitsandbytes", "liger_kernel", "triton"):
            try:
                env[name] = __import__(name).__version__
            except Exception:  # noqa: BLE001 (a missing package is recorded as missing)
                env[name] = None
        Path(out).write_text(json.dumps({"environment": env, "results": results}, indent=1))


if __name__ == "__main__":
    main()
