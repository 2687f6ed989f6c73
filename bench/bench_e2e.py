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
  unsloth            Unsloth (bench/unsloth_setup.sh carries its wheels) with its default
                     `use_gradient_checkpointing="unsloth"` (every layer's input offloaded to CPU memory, the layer
                     recomputed): FastLanguageModel.from_pretrained on the same folder (local path; load_in_4bit for
                     QLoRA), get_peft_model r=16 on the same modules, then the transformers rows' loop on the same
                     batches; in its own process, Unsloth imported before transformers, offline (UNSLOTH_ENV)
  unsloth-no-ckpt    the same with `use_gradient_checkpointing=False`
  entrenar-no-ckpt   the fast settings with nothing recomputed or offloaded (NO_CKPT: every layer's activations
                     kept on the GPU, QLoRA's NF4 base resident), against Unsloth's `use_gradient_checkpointing=False`
  entrenar-matched   "entrenar (memory-matched)": the fast settings plus what holds about Unsloth's default memory
                     (MATCHED: every layer checkpointed with its input in pinned CPU memory; untied input
                     embeddings in CPU memory; QLoRA's NF4 base streamed from CPU memory)
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

`lora-gemma3-4b` and `qlora-gpt-oss-20b` are issue 35's families at their published shapes (HF_SHAPES: the
config.json keys, built by transformers' own config classes, real vocabularies): LoRA on every linear layer of a
Gemma-3-4B text model, batch 2 x 2048; QLoRA on gpt-oss-20b, batch 1 x 2048, every layer checkpointed, LoRA r=16
on attention and on every expert (transformers' eager attention, as its SDPA path drops the sinks; no
prepare_model_for_kbit_training, which would cast the bf16 experts to fp32). Its folder is laid out as
openai/gpt-oss-20b ships (bench/gpt_oss_folder.py: experts in MXFP4, 13 GiB, drawn on the GPU), and each row
loads it its own way, recorded in its result (`expert_weights`, `load_s`):

  entrenar           attention and experts NF4 (MXFP4 dequantized on the GPU one expert at a time and quantized
                     as it arrives; expert biases bf16), frozen
  hf, hf-liger       Mxfp4Config(dequantize=True), as OpenAI's transformers fine-tuning recipe loads it: attention
                     and experts in bf16 (transformers refuses a BitsAndBytesConfig over an MXFP4 checkpoint, and
                     bitsandbytes quantizes nn.Linear only: the experts are 3-D parameters, bf16 either way)
  unsloth            load_in_4bit is set aside for an MXFP4 checkpoint: attention in bf16, the experts kept packed
                     in MXFP4 and decoded per layer by its own kernels (as unsloth_zoo 2026.10.9's source reads:
                     temporary_patches/mxfp4.py; `expert_weights` says what it did)

So the experts, 19B of the 21B weights, are 4-bit in entrenar's rows (NF4) and Unsloth's (MXFP4), bf16 in
transformers'. `qlora-gpt-oss-20b-bf16` is the same case from a bf16 folder (39 GiB, its
rows take two calls, `--drop-folders` deletes each case's folder after its rows): transformers' rows then put
attention in bitsandbytes NF4, and Unsloth quantizes the 3-D experts to NF4 too (unsloth_zoo's moe_utils_bnb4bit).
The GPU cases run their own rows, else GPU_ROWS (a row whose package is missing, or that fails to start, is a
recorded row error, not a stopped call). `--dry` prints what every row would run, and stops.

The CPU case (`cpu-smollm2`, SmolLM2-135M's shape, batch 2 x 512) runs fp32 on the CPU instead: `entrenar` with
`training.precision: fp32`, `entrenar-fast` with `bf16` (autocast on the CPU), `hf` in fp32 (HF Trainer on a CPU
without `bf16=True`) and `hf-bf16` under CPU bf16 autocast (Trainer with `bf16=True` on a CPU). Its peak memory is
each process's peak resident memory (`ru_maxrss`), and `--repeat N` runs its rows round-robin N times (the
machine's speed drifts; the table gives the median over repeats and their spread).

The transformers rows are fed the very batches entrenar's data pipeline makes from the same file, seed and
settings (packed rows of whole documents), without a document mask, as transformers' run_clm `group_texts`
feeds packed rows (`hf-docmask`: the `hf` row with each document attending only to itself, as entrenar's rows
do, through a dense boolean mask: a reference for the losses, not for speed). `--start peft` starts entrenar's and
the transformers rows from one adapter PEFT draws (entrenar trains it on from its folder), so their losses
compare step by step. tokens/s counts real (non-padding) tokens: the median over steps after the first
`--skip` (warm-up, compilation, graph capture). Peak memory is torch.cuda.max_memory_allocated over the
whole process (model load included), in GiB. MFU uses bench_train.py's FLOP count and 989.4 TFLOP/s.

    PYTHONPATH=src python bench/bench_e2e.py --cases lora-1b --text .e2e/text.jsonl \
        --tokenizer .e2e --work /tmp/e2e --out e2e.json
    PYTHONPATH=src python bench/bench_e2e.py --cases cpu-smollm2 --repeat 3 --out e2e-cpu.json

`--tiny` runs any case at a toy size (hidden 64, 2 layers, 8 experts for MoE, 2 x 128 tokens, 4 steps), on the
CPU when there is no GPU: a smoke test that every row starts, trains and reports, not a measurement.

On the GPU machine: peft ships there; bitsandbytes and liger-kernel travel as wheels in .whl/extra, Unsloth's in
.whl/unsloth (`bash bench/unsloth_setup.sh download` here fetches them). Rows whose package is missing are
reported as skipped. The call (one case per call keeps each under the 10-minute limit; `--rows` picks rows;
qlora-gpt-oss-20b-bf16 loads 39 GiB per row: split its rows over two calls on a warm machine, `--drop-folders` on
the second):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/extra/*.whl \
      && bash bench/unsloth_setup.sh install \
      && PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false python3 bench/bench_e2e.py \
         --cases lora-gemma3-4b --drop-folders --text .e2e/text.jsonl --tokenizer .e2e --work /tmp/e2e \
         --out $OUT/e2e-gemma3.json 2>&1 | tee $OUT/e2e-gemma3.log | grep -v Warning

qlora-gpt-oss-20b's five rows in one call (carry .whl/extra, .whl/unsloth and .e2e; the folder is kept in /tmp/e2e,
so a second call on the warm machine runs `--rows unsloth-no-ckpt,entrenar-matched` without rewriting it):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/extra/*.whl \
      && bash bench/unsloth_setup.sh install \
      && PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false python3 bench/bench_e2e.py \
         --cases qlora-gpt-oss-20b --skip 3 --text .e2e/text.jsonl --tokenizer .e2e --work /tmp/e2e \
         --out $OUT/e2e-gpt-oss.json 2>&1 | tee $OUT/e2e-gpt-oss.log | grep -v Warning
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402 (the end-to-end benchmarks' shared helpers)
    UNSLOTH_ENV,
    GiB,
    bases_that_ran,
    device,
    failed_line,
    logged_steps,
    model_vocab,
    peak_bytes,
    ratio,
    ratio_cells,
    ratio_headers,
    run_recipe,
    summarise,
    write_results,
)
from common import run_row_process as run_row  # noqa: E402

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
# Issue 35's families, as transformers config.json keys (built with transformers' own config class, so the
# folder is what the published checkpoint's config.json gives). Their real vocabularies: the tokenizer's ids are
# a subset, and the output layer's width (262k, 201k) is much of these models' cost.
HF_SHAPES: dict[str, dict] = {
    # google/gemma-3-4b-pt's text_config: 34 layers, 5 sliding (window 1024) to 1 global, head_dim 256, GQA 8/4,
    # GELU-tanh gating, (1 + w) RMSNorm with pre and post norms, q/k norm, local/global RoPE bases (the global
    # one linear-scaled by 8), tied embeddings.
    "gemma3-4b": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
        "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208, "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
    },
    # openai/gpt-oss-20b's config.json (transformers' GptOssConfig defaults but 24 layers and 32 experts): hidden
    # 2880, 32 experts of width 2880, top-4, 64 query heads of 64 and 8 KV heads with biases and sinks, sliding
    # (128) and full layers alternating, YaRN x32 from 4096, untied. About 21B parameters: 13 GiB on disk with
    # the experts in MXFP4 as the release ships them (a case's "weights": "mxfp4", bench/gpt_oss_folder.py), 39
    # GiB all in bf16.
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
        "num_local_experts": 32, "num_experts_per_tok": 4, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "sliding_window": 128, "vocab_size": 201088, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "attention_bias": True, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    },
}
# --tiny for HF_SHAPES, in config.json's keys (a sliding window shorter than the tiny rows, a global layer)
TINY_HF = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "intermediate_size": 128, "query_pre_attn_scalar": 16, "sliding_window": 32,
           "sliding_window_pattern": 2}
TINY_HF_MOE = {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}
# --tiny: every shape at a toy size (MoE keys only where the shape has experts).
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
        "intermediate_size": 128}
TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
TINY_CASE = {"batch": 2, "seq": 128, "steps": 4}

# The rows a GPU case runs by default (--rows picks others): entrenar's, the transformers ones, Unsloth's two modes
# and entrenar at Unsloth's default memory. A row whose package is missing is reported as skipped.
GPU_ROWS = ("entrenar", "entrenar-fast", "hf", "hf-liger", "unsloth", "unsloth-no-ckpt", "entrenar-matched")
# entrenar-matched: the case's fast settings plus what holds memory near Unsloth's default (offloaded
# checkpointing): every layer checkpointed, each layer's saved input in pinned CPU memory, the input embeddings
# in CPU memory (untied models), QLoRA's NF4 base streamed from CPU memory. A case's "matched" key overrides.
MATCHED = {"activation_checkpointing": True, "offload_activations": True}
# entrenar-no-ckpt: the fast settings with nothing rebuilt in the backward and nothing in CPU memory.
NO_CKPT = {"activation_checkpointing": False, "offload_activations": False, "offload_embeddings": False,
           "offload_weights": False}

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
    # Issue 35's performance cases (LoRA on every linear layer; gpt-oss: attention's NF4 and per-expert LoRA on
    # its bf16 experts, as entrenar and PEFT both train them). gpt-oss's HF rows run transformers' eager attention:
    # its SDPA path drops the sinks (tests/models/test_family_gpt_oss.py).
    # matched: not tiled MLP, which held 8.48 GiB here at 0.38x Unsloth's speed eagerly (H200, 2026-11-27: its
    # tiles' Python dominates a 2 x 2048 step) and 8.48 at 0.99x under CUDA graphs (--set training.tiled_mlp=1024
    # --set training.cuda_graphs=true; docs/MODELS.md); the fused loss's smaller chunk for this vocabulary instead.
    "lora-gemma3-4b": {"shape": "gemma3-4b", "method": "lora", "batch": 2, "seq": 2048, "ckpt": False, "steps": 14,
                       "fast": {"adapter_math": "bf16", "cuda_graphs": True}, "rows": GPU_ROWS},
    # The folder as openai/gpt-oss-20b ships (experts in MXFP4, 13 GiB): entrenar dequantizes the experts on load
    # and puts attention in NF4; transformers refuses a BitsAndBytesConfig for an MXFP4 checkpoint, so its rows
    # load it as OpenAI's fine-tuning recipe does, Mxfp4Config(dequantize=True) (attention and experts in bf16);
    # Unsloth keeps the experts packed in MXFP4 (its own kernels) with attention in bf16. Its rows fit one call.
    "qlora-gpt-oss-20b": {"shape": "gpt-oss-20b", "method": "qlora", "batch": 1, "seq": 2048, "ckpt": True,
                          "steps": 8, "fast": {"adapter_math": "bf16"}, "target_modules": ATTENTION,
                          "target_parameters": EXPERT_TARGETS, "hf_attention": "eager", "weights": "mxfp4",
                          "rows": ("entrenar", "hf", "hf-liger", "unsloth", "entrenar-fast"),
                          # prepare_model_for_kbit_training would cast the 19B bf16 expert weights to fp32 (78 GB):
                          # gradient checkpointing alone, as OpenAI's gpt-oss fine-tuning recipe runs
                          "kbit_prepare": False},
    # The same from a bf16 folder (39 GiB: its rows take two calls): transformers' rows with bitsandbytes NF4
    # attention (its experts are 3-D parameters, which bitsandbytes leaves in bf16), Unsloth's with NF4 experts too.
    "qlora-gpt-oss-20b-bf16": {"shape": "gpt-oss-20b", "method": "qlora", "batch": 1, "seq": 2048, "ckpt": True,
                               "steps": 10, "fast": {"adapter_math": "bf16"}, "target_modules": ATTENTION,
                               "target_parameters": EXPERT_TARGETS, "hf_attention": "eager", "rows": GPU_ROWS,
                               "kbit_prepare": False},
    "cpu-smollm2": {"shape": "smollm2-135m", "method": "lora", "batch": 2, "seq": 512, "ckpt": False, "steps": 12,
                    "device": "cpu", "precision": "fp32", "fast": {"precision": "bf16"},
                    "rows": ("entrenar", "entrenar-fast", "hf", "hf-bf16")},
}
ROWS = ("entrenar", "entrenar-fast", "hf", "hf-liger", "hf-bf16", "hf-wrapped", "hf-liger-wrapped",
        "hf-bf16-wrapped", "unsloth", "unsloth-no-ckpt", "entrenar-matched", "entrenar-no-ckpt", "hf-docmask")
# Unsloth's rows: FastLanguageModel's use_gradient_checkpointing ("unsloth", its default: every layer's input
# offloaded to CPU memory and the layer recomputed; or False)
UNSLOTH_ROWS = {"unsloth": "unsloth", "unsloth-no-ckpt": False}
ROW_LABELS = {"entrenar-matched": "entrenar (memory-matched)", "entrenar-no-ckpt": "entrenar (no checkpointing)"}
CPU_CASES = tuple(name for name, case in CASES.items() if case.get("device") == "cpu")


def shape_config(shape: str, vocab: int, seq: int, tiny: bool = False):
    """entrenar's ModelConfig for a bench_train (or MoE) shape, with the tokenizer's vocabulary."""
    from bench_train import SHAPES

    from entrenar.models.config import ModelConfig

    if shape in HF_SHAPES:
        return ModelConfig.from_hf(hf_shape_config(shape, tiny, vocab).to_dict(), source=shape)
    fields = {**{**SHAPES, **MOE_SHAPES}[shape], "vocab_size": vocab}
    if tiny:
        fields.update(TINY, **(TINY_MOE if fields.get("num_experts") else {}))
    return ModelConfig(**fields, max_position_embeddings=max(seq, 4096))


def hf_shape_config(shape: str, tiny: bool = False, vocab: int = 0):
    """transformers' config object for an HF_SHAPES shape (--tiny: at TINY_HF's toy size, with the tokenizer's
    vocabulary ``vocab`` as the other shapes have: the real 262k one makes a CPU step minutes long)."""
    import transformers

    fields = dict(HF_SHAPES[shape])
    if tiny:
        fields.update(TINY_HF, **(TINY_HF_MOE if fields.get("num_local_experts") else {}))
        fields["vocab_size"] = vocab or fields["vocab_size"]
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


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


# ---------------------------------------------------------------- inputs


def make_model_folder(shape: str, vocab: int, seq: int, tokenizer_dir: Path, folder: Path,
                      tiny: bool = False, weights: str = "bf16") -> Path:
    """A random bf16 Hugging Face folder of `shape` (transformers' own initialisation) with the tokenizer;
    ``weights="mxfp4"``: a gpt-oss shape's folder as its release lays it out (bench/gpt_oss_folder.py)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    if weights == "mxfp4":
        from gpt_oss_folder import write_mxfp4_folder

        timings = write_mxfp4_folder(hf_shape_config(shape, tiny, vocab), folder, tokenizer_dir, device())
        print(f"[{shape}] MXFP4 folder: {timings['bytes'] / GiB:.1f} GiB, drawn in {timings['draw_s']:.0f}s, "
              f"written in {timings['write_s']:.0f}s", flush=True)
        return folder
    if shape in HF_SHAPES:
        config = hf_shape_config(shape, tiny, vocab)
    else:
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
    if torch.cuda.is_available():
        # Every caller launches the runs in other processes: what the model was drawn in is theirs. (2026-11-27:
        # FSDP ranks launched by bench/multi_gpu.py found 62.5 of GPU 0's 79.1 GiB free, about the 8B model this
        # process had drawn there.)
        torch.cuda.empty_cache()
    tmp.rename(folder)
    return folder


def case_folder(case: dict, work: Path, tiny: bool) -> Path:
    """Where a case's model folder goes: one per shape and weight layout (bf16, or gpt-oss's MXFP4 experts)."""
    weights = case.get("weights", "bf16")
    return work / (case["shape"] + ("" if weights == "bf16" else f"-{weights}") + ("-tiny" if tiny else ""))


def matched_settings(case: dict, config) -> dict:
    """entrenar-matched's training keys over the fast ones: MATCHED, the embeddings in CPU memory where the model's
    are untied, the NF4 base streamed for QLoRA; the case's "matched" key last."""
    settings = dict(MATCHED)
    if not config.tie_word_embeddings:
        settings["offload_embeddings"] = True
    if case["method"] == "qlora":
        settings["offload_weights"] = True
    return {**settings, **case.get("matched", {})}


def row_settings(row: str, case: dict, config) -> dict | None:
    """The training keys an entrenar row sets over the case's fast ones (None: the fast ones alone)."""
    if row == "entrenar-matched":
        return matched_settings(case, config)
    return dict(NO_CKPT) if row == "entrenar-no-ckpt" else None


def recipe_for(case: dict, folder: Path, text: Path, run_dir: Path, fast: bool,
               matched: dict | None = None) -> dict:
    """The recipe a user would write for the case (fast: plus the documented fast settings; matched: plus
    :func:`matched_settings`, the memory-matched row)."""
    training = {"max_steps": case["steps"], "batch_size": case["batch"], "grad_accum": 1, "max_grad_norm": 1.0,
                "precision": case.get("precision", "bf16"), "activation_checkpointing": case["ckpt"], "kernels": "auto",
                "seed": 0, "eval_every": 0, "save_every": 0, "log_every": 1}
    if fast:
        training.update(case["fast"])
        training.update(matched or {})
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


def run_entrenar(case_name: str, case: dict, folder: Path, text: Path, work: Path, fast: bool, skip: int,
                 flops: float, overrides: tuple[str, ...] = (), matched: dict | None = None,
                 mode: str | None = None, start: Path | None = None) -> dict:
    mode = mode or ("matched" if matched else "fast" if fast else "default")
    run_dir = work / f"run-{case_name}-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    recipe_path = work / f"{case_name}-{mode}.yaml"
    recipe = recipe_for(case, folder, text, run_dir, fast, matched)
    if start is not None:  # --start peft: the adapter PEFT drew, trained on (model.path an adapter folder)
        recipe["model"]["path"] = str(start)
    if device() == "cpu" and case.get("device") != "cpu":  # --tiny without CUDA: CUDA-only settings left out
        for key in ("cuda_graphs", "offload_activations", "offload_embeddings", "offload_weights"):
            recipe["training"].pop(key, None)
    returncode, output, max_rss, wall = run_recipe(recipe, recipe_path, work / f"{case_name}-{mode}.log", overrides)
    if returncode != 0:
        return {"status": "failed", "error": output[-2000:], "recipe": recipe}
    steps = logged_steps(run_dir)
    step_s = [r["tokens"] / r["tokens_per_s"] for r in steps]
    peak = peak_bytes(steps, max_rss, on_cpu=case.get("device") == "cpu")
    out = summarise(step_s, [r["tokens"] for r in steps], [r["loss"] for r in steps], skip, flops, peak, wall)
    return {"status": "ok", **out, "recipe": recipe}


def run_hf(case: dict, folder: Path, tokenizer_dir: Path, text: Path, row: str, skip: int, flops: float,
           start: Path | None = None) -> dict:
    """transformers + PEFT (+ bitsandbytes, + Liger) under bf16 autocast, in this process; on the CPU case in
    fp32 (``hf``) or under CPU bf16 autocast (``hf-bf16``). ``hf-docmask``: ``hf`` with each packed document
    attending only to itself, as entrenar's rows do (a trajectory reference, not a speed row: its mask is a
    dense ``[rows, 1, T, T]`` boolean made in the step). ``start``: PEFT's adapter from that folder (--start
    peft), not a new one."""
    import torch
    import transformers

    try:
        import peft
    except ImportError as e:
        return {"status": "skipped", "error": f"peft: {e}"}
    wrapped = row.endswith("-wrapped")
    row = row.removesuffix("-wrapped")
    docmask = row == "hf-docmask"
    row = "hf" if docmask else row
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
    kwargs = {"attn_implementation": case.get("hf_attention", "sdpa")}
    aux_coef = (case.get("moe") or {}).get("aux_loss", 0.0)
    if case.get("target_parameters"):  # MoE: the grouped experts and the router loss entrenar's recipe has
        kwargs.update(experts_implementation="grouped_mm", output_router_logits=aux_coef > 0,
                      router_aux_loss_coef=aux_coef)
    if case.get("weights") == "mxfp4":  # the release's layout: transformers refuses bitsandbytes over it
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
        if dev == "cuda":
            kwargs["device_map"] = {"": 0}
    elif case["method"] == "qlora":
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
    load_s, experts = time.perf_counter() - started, expert_storage(model)
    if "device_map" not in kwargs:
        model = model.to(dev)
    model.config.use_cache = False
    if liger:
        _apply_liger_kernel_to_instance(model=model)
    if case["method"] == "qlora" and case.get("kbit_prepare", True):
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    elif case["ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if case["method"] in ("lora", "qlora") and start is not None:
        model = peft.PeftModel.from_pretrained(model, start, is_trainable=True)
    elif case["method"] in ("lora", "qlora"):
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
            target_modules=case.get("target_modules", "all-linear"),
            target_parameters=case.get("target_parameters"), task_type="CAUSAL_LM"))
    model.train()  # from_pretrained returns eval mode, where gradient checkpointing is not in effect
    trainable, step_s, tokens, losses = timed_steps(model, batches, dev, autocast, aux_coef, docmask)
    wall = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None  # CPU: the parent reads ru_maxrss
    out = summarise(step_s, tokens, losses, skip, flops, peak, wall)
    gc_checkpointing = getattr(getattr(model, "base_model", model), "is_gradient_checkpointing", None)
    return {"status": "ok", **out, "gradient_checkpointing": gc_checkpointing,
            "experts_implementation": getattr(model.config, "_experts_implementation", None),
            "trainable_params": sum(p.numel() for p in trainable), "load_s": load_s, "expert_weights": experts}


def expert_storage(model) -> str | None:
    """How a transformers (or Unsloth) model holds its first stacked expert weight, e.g. "Parameter bfloat16
    [32, 2880, 5760]", "Params4bit uint8 [...]" (bitsandbytes NF4) or an MXFP4 class: what a MoE row trains
    through, recorded as loaded since the rows' libraries choose differently. None for a dense model."""
    for name, param in model.named_parameters():
        if "experts" in name and name.endswith("gate_up_proj"):
            return f"{type(param).__name__} {str(param.dtype).removeprefix('torch.')} {list(param.shape)}"
    return None


def timed_steps(model, batches: list[dict], dev: str, autocast: bool, aux_coef: float,
                docmask: bool = False) -> tuple[list, list[float], list[int], list[float]]:
    """The transformers-style loop every baseline row runs (HF Trainer's step with `bf16=True`): forward with
    labels under bf16 autocast, backward, clipping at 1.0, fused AdamW; each step timed to its loss read.
    Returns (trainable parameters, step seconds, real tokens per step, losses)."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, fused=True)
    step_s, tokens, losses = [], [], []
    for batch in batches:
        ids, labels = batch["input_ids"].to(dev), batch["labels"].to(dev)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        extra = document_mask(batch, dev) if docmask else {}
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            output = model(input_ids=ids, labels=labels, **extra)
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
    return trainable, step_s, tokens, losses


def document_mask(batch: dict, dev: str) -> dict:
    """transformers' inputs for packed rows whose documents attend only to themselves: a boolean ``[rows, 1, T,
    T]`` mask (True: attends; passed to SDPA as it is) and positions from each document's start."""
    import torch

    docs = batch["document_ids"].to(dev)
    n = docs.shape[1]
    allowed = (docs[:, :, None] == docs[:, None, :]) & torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    allowed |= torch.eye(n, dtype=torch.bool, device=dev)  # a padding position attends to itself (label ignored)
    return {"attention_mask": allowed[:, None], "position_ids": batch["position_ids"].to(dev)}


def peft_start(case: dict, folder: Path, work: Path) -> Path:
    """--start peft: PEFT's own adapter for the case (get_peft_model's draws after torch.manual_seed(0), B zero),
    saved once, so every entrenar and transformers row starts from the same adapter."""
    import peft
    import torch
    import transformers

    out = work / f"{folder.name}-peft-start"
    if (out / "adapter_config.json").is_file():
        return out
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    torch.manual_seed(0)
    adapted = peft.get_peft_model(model, peft.LoraConfig(
        r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=case.get("target_modules",
                                                                                          "all-linear")))
    adapted.save_pretrained(out)
    return out


def unsloth_settings(case: dict, folder: Path, row: str) -> dict:
    """The arguments of Unsloth's row: FastLanguageModel.from_pretrained on the case's folder (bf16, or NF4 for
    QLoRA through its bitsandbytes path) and get_peft_model with the adapters every row trains (r=16 on every
    linear layer of the blocks; MoE: attention and each expert through target_parameters)."""
    mode = UNSLOTH_ROWS[row]
    from_pretrained = {"model_name": str(folder), "max_seq_length": case["seq"], "dtype": "bfloat16",
                       "load_in_4bit": case["method"] == "qlora", "load_in_8bit": False, "full_finetuning": False,
                       "use_gradient_checkpointing": mode, "local_files_only": True}
    targets = case.get("target_modules", "all-linear")
    if targets == "all-linear":  # PEFT's all-linear on these decoders (the output layer left out)
        targets = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]
    peft = {"r": LORA["r"], "lora_alpha": LORA["alpha"], "lora_dropout": 0.0, "bias": "none",
            "target_modules": targets, "use_gradient_checkpointing": mode, "random_state": 0}
    if case.get("target_parameters"):
        peft["target_parameters"] = case["target_parameters"]
    aux_coef = (case.get("moe") or {}).get("aux_loss", 0.0)
    if aux_coef:  # the router loss the other rows add (passed on to transformers' config)
        from_pretrained.update(output_router_logits=True, router_aux_loss_coef=aux_coef)
    return {"from_pretrained": from_pretrained, "get_peft_model": peft}


def import_unsloth() -> tuple[object | None, str]:
    """Unsloth imported first (it patches transformers as it loads), offline: (module, "") or (None, why not)."""
    if "unsloth" in sys.modules:
        return sys.modules["unsloth"], ""
    for key, value in UNSLOTH_ENV.items():
        os.environ.setdefault(key, value)
    if "transformers" in sys.modules:
        return None, "transformers was imported before unsloth in this process (Unsloth must come first)"
    try:
        import unsloth
    except Exception as e:  # noqa: BLE001 (Unsloth raises what it likes: ImportError, NotImplementedError...)
        return None, f"import unsloth: {type(e).__name__}: {e}"
    return unsloth, ""


def run_unsloth(case: dict, folder: Path, tokenizer_dir: Path, text: Path, row: str, skip: int, flops: float,
                dry: bool = False) -> dict:
    """Unsloth's row, in this process (imported before transformers): FastLanguageModel on the same folder and
    batches, the same loop as the transformers rows (Unsloth's trainer is HF Trainer with `bf16=True`)."""
    settings = unsloth_settings(case, folder, row)
    if dry:
        return {"status": "dry", "settings": settings}
    unsloth, why = import_unsloth()
    if unsloth is None:
        return {"status": "skipped", "error": why, "settings": settings}
    import torch

    batches = packed_batches(tokenizer_dir, text, case, case["steps"])
    dev = case.get("device", device())
    started = time.perf_counter()
    kwargs = dict(settings["from_pretrained"], dtype=torch.bfloat16)
    model, _ = unsloth.FastLanguageModel.from_pretrained(**kwargs)
    load_s, experts = time.perf_counter() - started, expert_storage(model)
    model = unsloth.FastLanguageModel.get_peft_model(model, **settings["get_peft_model"])
    model.train()
    aux_coef = (case.get("moe") or {}).get("aux_loss", 0.0)
    trainable, step_s, tokens, losses = timed_steps(model, batches, dev, dev == "cuda", aux_coef)
    wall = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None
    out = summarise(step_s, tokens, losses, skip, flops, peak, wall)
    return {"status": "ok", **out, "settings": settings, "unsloth": unsloth.__version__,
            "trainable_params": sum(p.numel() for p in trainable), "load_s": load_s, "expert_weights": experts}


def run_row_process(row: str, case_name: str, folder: Path, args: argparse.Namespace,
                    start: Path | None = None) -> dict:
    """A transformers or Unsloth row in a fresh process, so neither stack's memory counts against the other."""
    out = Path(args.work) / f"{case_name}-{row}.json"
    cmd = [sys.executable, __file__, "--hf-row", row, "--cases", case_name, "--folder", str(folder),
           "--text", args.text, "--tokenizer", args.tokenizer, "--work", args.work, "--skip", str(args.skip),
           "--out", str(out), *(["--start-adapter", str(start)] if start is not None else [])]
    return run_row(cmd, out, args)


# ---------------------------------------------------------------- report


def print_table(results: list[dict]) -> None:
    """One line per case and row; with several repeats, the median over them (and min-max of tokens/s). The
    ratios to a baseline row are medians of per-repeat ratios (rows of one repeat ran minutes apart); a column
    for each baseline row that ran (``vs hf-bf16-wrapped``: against that row on group_texts batches)."""
    bases = bases_that_ran((b for b in ROWS if b.startswith("hf") and b != "hf-docmask" or b in UNSLOTH_ROWS),
                           results)
    header = (f"{'case':<13}{'row':<17}{'tok/s':>9}{'min-max':>14}{'MFU':>6}{'peak GiB':>9}"
              + ratio_headers(bases, "vs ") + f"{'mem/liger':>10}{'mem/unsloth':>12}"
              + f"{'loss first->last':>20}")
    print(header)
    keys = list(dict.fromkeys((r["case"], r["row"]) for r in results))
    for case, row in keys:
        runs = [r for r in results if (r["case"], r["row"]) == (case, row)]
        ok = [r for r in runs if r["status"] == "ok"]
        if not ok:
            print(failed_line(case, row, runs[-1], (13, 17)))
            continue
        median = lambda key: statistics.median(r[key] or 0 for r in ok)  # noqa: E731
        tps = [r["tokens_per_s"] for r in ok]
        spread = f"{min(tps):.0f}-{max(tps):.0f}" if len(tps) > 1 else ""
        mfu = f"{median('mfu'):6.1%}" if ok[0]["mfu"] and case not in CPU_CASES else f"{'-':>6}"
        print(f"{case:<13}{row:<17}{median('tokens_per_s'):9.0f}{spread:>14}{mfu}{median('peak_gib'):9.2f}"
              + ratio_cells(results, ok, bases, "tokens_per_s", "vs ")
              + f"{ratio(results, ok, 'hf-liger', 'peak_gib'):>10}{ratio(results, ok, 'unsloth', 'peak_gib'):>12}"
              + f"{ok[0]['loss_first']:10.4f} ->{ok[0]['loss_last']:8.4f}")


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
    p.add_argument("--dry", action="store_true", help="print what each row would run (Unsloth's arguments, "
                   "entrenar's training keys) and stop")
    p.add_argument("--drop-folders", action="store_true",
                   help="delete a case's model folder once no later case in --cases uses its shape (disk)")
    p.add_argument("--start", choices=("own", "peft"), default="own",
                   help="peft: the entrenar and transformers rows start from one adapter PEFT drew (entrenar "
                   "trains it on from its folder), so their losses compare step by step (Unsloth's rows draw "
                   "their own)")
    p.add_argument("--hf-row", default="", help=argparse.SUPPRESS)
    p.add_argument("--start-adapter", default="", help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if device() == "cpu" and not args.tiny and not args.dry and not all(c in CPU_CASES for c in args.cases.split(",")):
        p.error("no CUDA device: the cases are GPU measurements (--tiny runs them at a toy size on the CPU)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir, text = Path(args.tokenizer), Path(args.text)
    vocab_size = model_vocab(tokenizer_dir)

    if args.hf_row:  # one transformers or Unsloth row, called by run_row_process
        unsloth_why = import_unsloth()[1] if args.hf_row in UNSLOTH_ROWS else ""  # before transformers
        case = case_for(args.cases, args.steps, args.tiny)
        cfg = shape_config(case["shape"], vocab_size, case["seq"], args.tiny)
        flops = case_flops(cfg, case["method"], case["seq"])
        if unsloth_why:
            result = {"status": "skipped", "error": unsloth_why}
        elif args.hf_row in UNSLOTH_ROWS:
            result = run_unsloth(case, Path(args.folder), tokenizer_dir, text, args.hf_row, args.skip, flops)
        else:
            result = run_hf(case, Path(args.folder), tokenizer_dir, text, args.hf_row, args.skip, flops,
                            Path(args.start_adapter) if args.start_adapter else None)
        Path(args.out).write_text(json.dumps(result))
        return
    if args.dry:
        dry_run(args, vocab_size)
        return

    import torch

    results = []
    for index, case_name in enumerate(args.cases.split(",")):
        case = case_for(case_name, args.steps, args.tiny)
        cfg = shape_config(case["shape"], vocab_size, case["seq"], args.tiny)
        flops = case_flops(cfg, case["method"], case["seq"])
        t0 = time.perf_counter()
        folder = make_model_folder(case["shape"], vocab_size, case["seq"], tokenizer_dir,
                                   case_folder(case, work, args.tiny), args.tiny, case.get("weights", "bf16"))
        print(f"[{case_name}] model folder {folder} ready in {time.perf_counter() - t0:.0f}s", flush=True)
        torch.cuda.empty_cache()
        rows = rows_for(case, args.rows)
        start = peft_start(case, folder, work) if args.start == "peft" and case["method"] != "full" else None
        for repeat in range(args.repeat):
            for row in rows:
                t0 = time.perf_counter()
                if row.startswith("entrenar"):
                    r = run_entrenar(case_name, case, folder, text, work, row != "entrenar", args.skip, flops,
                                     tuple(args.set), row_settings(row, case, cfg),
                                     None if row == "entrenar" else row.removeprefix("entrenar-"), start)
                    row = " ".join([row, *args.set])
                else:
                    try:
                        r = run_row_process(row, case_name, folder, args,
                                            None if row in UNSLOTH_ROWS else start)
                    except Exception as e:  # noqa: BLE001 (one row's failure is that row's result)
                        r = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
                results.append({"case": case_name, "row": row, "label": ROW_LABELS.get(row.split()[0], row),
                                "repeat": repeat, "load_avg": os.getloadavg(), **r})
                print(f"[{case_name}] {row}: {r['status']} {r.get('tokens_per_s') or ''} in "
                      f"{time.perf_counter() - t0:.0f}s", flush=True)
                write_results(args.out, results)  # after every row: a run cut short keeps what it measured
        later = [case_folder(case_for(c, args.steps, args.tiny), work, args.tiny)
                 for c in args.cases.split(",")[index + 1:]]
        if args.drop_folders and folder not in later:  # disk: gpt-oss-20b's bf16 folder alone is 39 GiB
            shutil.rmtree(folder, ignore_errors=True)
    print_table(results)


def rows_for(case: dict, rows: str) -> list[str]:
    """--rows, else the case's own, else GPU_ROWS (full fine-tuning: entrenar's and the transformers rows)."""
    if rows:
        return rows.split(",")
    return list(case.get("rows", GPU_ROWS if case["method"] != "full" else ROWS[:4]))


def dry_run(args: argparse.Namespace, vocab_size: int) -> None:
    """--dry: what each row of each case would run, without running it (the Unsloth rows' arguments, the entrenar
    rows' recipes): a check of those code paths on a machine that cannot run them."""
    work = Path(args.work)
    for case_name in args.cases.split(","):
        case = case_for(case_name, args.steps, args.tiny)
        cfg = shape_config(case["shape"], vocab_size, case["seq"], args.tiny)
        folder = case_folder(case, work, args.tiny)
        for row in rows_for(case, args.rows):
            if row in UNSLOTH_ROWS:
                what = unsloth_settings(case, folder, row)
            elif row.startswith("entrenar"):
                what = recipe_for(case, folder, Path(args.text), work / "run", row != "entrenar",
                                  row_settings(row, case, cfg))["training"]
            else:
                what = {"attn_implementation": case.get("hf_attention", "sdpa"), "method": case["method"],
                        "target_modules": case.get("target_modules", "all-linear"),
                        "target_parameters": case.get("target_parameters")}
            print(f"[{case_name}] {ROW_LABELS.get(row, row)}: {json.dumps(what)}")


if __name__ == "__main__":
    main()
