"""GRPO speed that users get: `entrenar train` on a GRPO recipe against TRL's GRPOTrainer + PEFT with transformers'
`generate` (no vLLM), on the same prompts, the same reward function and the same call.

A step is one generation batch and one update on it (TRL's `num_iterations: 1`, `steps_per_generation: 1`): PROMPTS
prompts, 8 completions each sampled at temperature 1 with a KV cache, exactly 256 new tokens each (no early end: the
same work for every row), rewarded by `reward_len` below, then the DAPO loss (both stacks' default), no KL term
(`beta` 0, TRL's default: no reference pass), LoRA r=16 alpha 32 on every linear layer, bf16, AdamW, clipping at 1.0.
Each case builds one random Hugging Face folder of a real model's shape (bench_e2e.py's `make_model_folder`, with the
tokenizer of --tokenizer) and one JSONL of prompts: the first PROMPT tokens (128 on the GPU cases) of documents of
real text (bench_dpo.py's `--prepare` folder), decoded to strings. Each row runs in its own process:

  entrenar    `entrenar train RECIPE` (the CLI's `main`, in a process of this script's that first drops the
              tokenizer's end-of-sequence ids from the GRPO task's stop tokens, so that every completion is 256
              tokens): task.type grpo, num_generations 8, max_new_tokens 256, `kernels: auto`; the metrics from
              its metrics.jsonl (step time: the difference of consecutive steps' elapsed_s, log_every 1;
              peak_mem_gb)
  entrenar-matched  the same with every layer checkpointed and its input in pinned CPU memory
              (``activation_checkpointing``, ``offload_activations``), as Unsloth's default holds memory, and the
              MLP in tiles of 8,192 tokens (``tiled_mlp``)
  trl         TRL 1.16 `GRPOTrainer` on a PEFT model (same LoRA), `GRPOConfig(bf16=True, use_vllm=False,
              generation_kwargs={"min_new_tokens": 256})` (no end-of-sequence before 256 tokens),
              per_device_train_batch_size = PROMPTS x 8 (TRL counts completions), gradient checkpointing off as
              entrenar's, fused AdamW; step time from a callback around each optimizer step (generation included)
  unsloth     Unsloth's GRPO as its users run it without vLLM: `import unsloth` first (its import rewrites TRL's
              GRPOTrainer and GRPOConfig into UnslothGRPOTrainer / its config), FastLanguageModel.from_pretrained
              on the same folder (bf16, load_in_4bit False, fast_inference False: no vLLM),
              FastLanguageModel.get_peft_model (r=16 alpha 32 on the same modules, use_gradient_checkpointing
              "unsloth", its default: each layer's input offloaded to CPU memory and the layer recomputed), then
              TRL's GRPOTrainer with the trl row's GRPOConfig fields, prompts, reward and step clock, in its own
              process offline (common.py's UNSLOTH_ENV, bench_e2e.py's import_unsloth). Generation stays transformers'
              `generate` loop, but Unsloth routes it through its fast generate (its own decode forward; on
              Llama and Qwen3 with CUDA its decode step replayed from CUDA graphs inside RL rollouts) and
              computes the loss from hidden states in chunks. The row's result records what Unsloth did: its
              versions, the trainer class (`grpo_patch`: whether TRL's GRPOTrainer was Unsloth's), the
              generation hook, whether its fast generate ran, its decode graphs' counters, the checkpointing.
              Three GRPOConfig fields are pinned in both rows to TRL's defaults, because Unsloth changes them
              for an explicit `loss_type="dapo"` or by its own defaults: epsilon_high 0.2 (Unsloth: 0.28),
              mask_truncated_completions False (Unsloth: True, which here would mask every completion, since
              all stop at the limit) and weight_decay 0.0 (Unsloth: 0.001)

samples/s = completions a step / step time; tokens/s = new (completion) tokens a step / step time, and
total_tokens_per_s counts the prompt tokens too (PROMPTS x 8 x (mean prompt tokens + 256)); medians over the steps
after the first --skip. Each row's `completion_mean_length` (from its own metrics) should be 256: a row that ended
completions early did less work, and the table flags it. Peak memory: torch.cuda.max_memory_allocated over the
whole process (model load included), in GiB; on the CPU (--tiny) each process's peak resident memory.

GPU (an H100; .e2e/ from `bench_dpo.py --prepare .e2e` on any machine, carried along; trl 1.16 and datasets from
.whl/extra as bench/device_tests.sh installs them; Unsloth's wheels from .whl/unsloth, `bash bench/unsloth_setup.sh
download` here, installed offline by its `install`). Unsloth 2026.10.9 declares trl <= 1.15 and datasets < 5: with
the trl row's trl 1.16 its GRPO patch may not apply, which the row's `grpo_patch` records. One case per call
keeps a call under the 10-minute limit (`--rows` splits a case's rows over calls on a warm machine; the model
folder and prompts stay in --work):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/extra/*.whl \
      && bash bench/unsloth_setup.sh install \
      && PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false python3 bench/bench_grpo.py \
         --cases lora-1b --text .e2e/text.jsonl --tokenizer .e2e --work /tmp/grpo --out $OUT/grpo-lora1b.json

    PYTHONPATH=src python bench/bench_grpo.py --tiny --cases lora-1b     # CPU smoke test: every row starts
    PYTHONPATH=src python bench/bench_grpo.py --dry --cases lora-1b      # what each row would run, nothing run

`--tiny` runs a case at a toy size (bench_e2e.py's: hidden 64, 2 layers; 2 prompts of 16 tokens, 8 completions of
16 tokens, 3 steps; fp32 in both rows) on the CPU when there is no GPU, building a temporary --prepare folder when
the tokenizer folder is absent (it needs the SmolLM2 GGUF, see bench_dpo.py): a smoke test that every row starts,
trains and reports, not a measurement. Rows whose package is missing (peft, trl, datasets) are reported as skipped,
and so is the unsloth row where Unsloth cannot be imported (not installed, or no GPU: the row sets
UNSLOTH_DISABLE_CPU_FALLBACK=1, so that Unsloth's import raises instead of taking its CPU backend, which is stock
TRL without its GRPO), with the reason. `--dry` prints each row's set-up (the entrenar recipe's task and training
keys, the GRPOConfig fields, Unsloth's from_pretrained and get_peft_model arguments) without running anything.
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

from bench_e2e import (  # noqa: E402 (the language-model benchmark's shapes and its offline Unsloth set-up)
    LORA,
    case_for,
    import_unsloth,
    make_model_folder,
    unsloth_settings,
)
from common import (  # noqa: E402 (the end-to-end benchmarks' shared helpers)
    GiB,
    bases_that_ran,
    case_arguments,
    device,
    failed_line,
    logged_steps,
    peak_bytes,
    ratio_cells,
    ratio_headers,
    read_jsonl,
    run_recipe,
    run_row_process,
    start_cases,
    step_clock,
    write_results,
)

LR = 1e-5  # LoRA GRPO (TRL's default 1e-6 is for full fine-tuning; the rate does not change the speed)
GENERATIONS = 8
CASES: dict[str, dict] = {
    # batch counts prompts (each sampled GENERATIONS times); seq bounds prompt + completion (entrenar's data.seq_len)
    "lora-1b": {"shape": "llama-1b", "method": "lora", "batch": 8, "prompt": 128, "completion": 256, "seq": 512,
                "ckpt": False, "steps": 8},
    "lora-qwen3": {"shape": "qwen3-1.7b", "method": "lora", "batch": 8, "prompt": 128, "completion": 256,
                   "seq": 512, "ckpt": False, "steps": 8},
}
TINY_GRPO = {"batch": 2, "prompt": 16, "completion": 16, "seq": 64, "steps": 3}
ROWS = ("entrenar", "entrenar-matched", "trl", "unsloth")
# entrenar-matched: what Unsloth's GRPO runs by default for memory (use_gradient_checkpointing "unsloth"): every
# layer checkpointed with its input in pinned CPU memory; and the MLP in tiles of 8,192 tokens (without them the
# update of 64 completions held 5.47 GiB against Unsloth's 5.32, H200 2026-11-27).
MATCHED = {"activation_checkpointing": True, "offload_activations": True, "tiled_mlp": 8192}
BASELINES = ("trl", "unsloth")  # the rows that run in a process of their own through GRPOTrainer
# GRPOConfig fields both baseline rows pin to TRL 1.16's defaults (epsilon_high None means epsilon, 0.2), as Unsloth's
# GRPOConfig changes them when left unset: with an explicit loss_type "dapo" it sets epsilon_high 0.28 and
# mask_truncated_completions True (every completion here stops at the limit, so all would be masked out), and its
# default weight decay is 0.001
TRL_DEFAULTS = {"epsilon_high": 0.2, "mask_truncated_completions": False, "weight_decay": 0.0}


def reward_len(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """A cheap reward with TRL's signature (both rows score with it): closeness of the completion to 400
    characters."""
    return [-abs(len(c) - 400) / 400 for c in completions]


# ---------------------------------------------------------------- inputs


def make_prompts(tokenizer_dir: Path, text: Path, case: dict, out: Path) -> Path:
    """The case's prompts file ({"prompt": str}): each document's first ``case["prompt"]`` tokens, decoded."""
    from entrenar.data.tokenizer import Tokenizer

    if out.is_file():
        return out
    tokenizer = Tokenizer.from_folder(tokenizer_dir)
    prompts = []
    for line in text.read_text(encoding="utf-8").splitlines():
        if line.strip():
            ids = tokenizer.encode(json.loads(line)["text"])
            if len(ids) >= case["prompt"]:
                prompts.append(tokenizer.decode(ids[: case["prompt"]]))
    tmp = out.with_suffix(".partial")
    tmp.write_text("".join(json.dumps({"prompt": p}, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    tmp.rename(out)
    return out


def recipe_for(case: dict, folder: Path, prompts: Path, run_dir: Path, matched: bool = False) -> dict:
    """The GRPO recipe a user would write for the case (``matched``: with :data:`MATCHED`'s training keys)."""
    recipe = {
        "model": {"path": str(folder), "device": device()},
        "task": {"type": "grpo", "num_generations": GENERATIONS, "max_new_tokens": case["completion"],
                 "temperature": 1.0, "loss_type": "dapo", "kl_beta": 0.0, "samples_every": 0},
        "reward": {"functions": ["bench_grpo:reward_len"]},
        "data": {"train": str(prompts), "validation_split": 0.0, "seq_len": case["seq"], "shuffle": True},
        "lora": {**LORA, "dropout": 0.0, "target_modules": "all-linear"},
        "optimizer": {"name": "adamw", "lr": LR},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "training": {"max_steps": case["steps"], "batch_size": case["batch"], "grad_accum": 1, "max_grad_norm": 1.0,
                     "precision": "bf16" if device() == "cuda" else "fp32", "activation_checkpointing": case["ckpt"],
                     "kernels": "auto", "seed": 0, "eval_every": 0, "save_every": 0, "log_every": 1},
        "output": {"dir": str(run_dir)},
    }
    if matched:
        recipe["training"].update(MATCHED)
    return recipe


def prompt_tokens(prompts: Path, folder: Path) -> float:
    """Mean tokens of a prompt as the model folder's tokenizer encodes it (both rows encode the same strings)."""
    from entrenar.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(folder)
    lengths = [len(tokenizer.encode(r["prompt"])) for r in read_jsonl(prompts)]
    return statistics.mean(lengths)


def summarise(step_s: list[float], case: dict, mean_prompt: float, skip: int, peak_bytes: float | None,
              wall_s: float, losses: list[float], lengths: list[float]) -> dict:
    """Medians over the timed steps: samples/s, new tokens/s, all tokens/s, step time."""
    timed = step_s[min(skip, len(step_s) - 1):]
    step = statistics.median(timed)
    completions = case["batch"] * GENERATIONS
    return {"samples_per_s": completions / step, "tokens_per_s": completions * case["completion"] / step,
            "total_tokens_per_s": completions * (mean_prompt + case["completion"]) / step,
            "step_ms_median": step * 1e3, "steps": len(step_s), "step_s": step_s,
            "peak_gib": peak_bytes / GiB if peak_bytes else None, "wall_s": wall_s, "losses": losses,
            "completion_mean_length": statistics.mean(lengths) if lengths else None,
            "mean_prompt_tokens": mean_prompt}


# ---------------------------------------------------------------- rows


def entrenar_row(recipe: str) -> int:
    """`entrenar train RECIPE` with no stop tokens (every completion max_new_tokens long): the entrenar row."""
    import entrenar.tasks.rl.grpo_task as grpo_task
    from entrenar.cli.main import main as cli

    settings_of = grpo_task.settings_of
    grpo_task.settings_of = lambda recipe, stop_ids=(): settings_of(recipe, ())
    return cli(["train", recipe, "--no-progress"])


def run_entrenar(case_name: str, case: dict, folder: Path, prompts: Path, work: Path, skip: int,
                 mean_prompt: float, matched: bool = False) -> dict:
    name = f"{case_name}-grpo" + ("-matched" if matched else "")
    run_dir = work / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    recipe = recipe_for(case, folder, prompts, run_dir, matched)
    recipe_path = work / f"{name}.yaml"
    returncode, output, max_rss, wall = run_recipe(recipe, recipe_path, work / f"{name}.log",
                                                   cmd=[sys.executable, __file__, "--entrenar-row", str(recipe_path)])
    if returncode != 0:
        return {"status": "failed", "error": output[-2000:], "recipe": recipe}
    steps = logged_steps(run_dir)
    # a step's time: the clock between logged steps (tokens_per_s counts prompt tokens only, rounded); the first's
    # from its rate (it is left out of the medians anyway)
    step_s = [steps[0]["tokens"] / max(steps[0]["tokens_per_s"], 1e-9)] + [
        b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:], strict=False)]
    peak = peak_bytes(steps, max_rss, on_cpu=device() == "cpu")
    out = summarise(step_s, case, mean_prompt, skip, peak, wall, [r["loss"] for r in steps],
                    [r["completions/mean_length"] for r in steps])
    return {"status": "ok", **out, "reward_last": steps[-1].get("reward"), "recipe": recipe}


def grpo_config(case: dict, output_dir: Path, dev: str) -> dict:
    """The GRPOConfig fields of the trl and unsloth rows (the same for both; TRL_DEFAULTS pinned)."""
    return dict(
        output_dir=str(output_dir), per_device_train_batch_size=case["batch"] * GENERATIONS,
        gradient_accumulation_steps=1, num_generations=GENERATIONS, max_completion_length=case["completion"],
        generation_kwargs={"min_new_tokens": case["completion"]}, temperature=1.0, use_vllm=False, beta=0.0,
        loss_type="dapo", num_iterations=1, max_steps=case["steps"], learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, bf16=dev == "cuda", optim="adamw_torch_fused" if dev == "cuda" else "adamw_torch",
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=dev == "cpu",
        gradient_checkpointing=case["ckpt"], dataloader_num_workers=0, **TRL_DEFAULTS)


def train_grpo(trl, model, tokenizer, case: dict, prompts: Path, output_dir: Path, skip: int, mean_prompt: float,
               started: float) -> tuple[dict, object]:
    """TRL's GRPOTrainer (Unsloth's where its import replaced it) on ``model`` over the prompts, with
    :func:`grpo_config`, :func:`reward_len` and the step clock: (the row's result, the trainer)."""
    import datasets
    import torch

    dev = device()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = datasets.Dataset.from_list(read_jsonl(prompts))
    config = trl.GRPOConfig(**grpo_config(case, output_dir, dev))
    step_s: list[float] = []
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward_len], args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[step_clock(dev, step_s)])
    trainer.train()
    wall = time.perf_counter() - started
    history = [h for h in trainer.state.log_history if "loss" in h]
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None  # CPU: the parent reads ru_maxrss
    out = summarise(step_s, case, mean_prompt, skip, peak, wall, [h["loss"] for h in history],
                    [h["completions/mean_length"] for h in history if "completions/mean_length" in h])
    return {"status": "ok", **out, "reward_last": history[-1].get("reward") if history else None,
            "gradient_checkpointing": config.gradient_checkpointing, "trl": trl.__version__}, trainer


def run_trl(case: dict, folder: Path, prompts: Path, work: Path, skip: int, mean_prompt: float) -> dict:
    """TRL's GRPOTrainer on a PEFT model with transformers' generate, in this process."""
    import torch
    import transformers

    try:
        import datasets  # noqa: F401 (train_grpo's)
        import peft
        import trl
    except ImportError as e:
        return {"status": "skipped", "error": str(e)}
    dev = device()
    started = time.perf_counter()
    # GRPOConfig(bf16=True) as users run LoRA: the base in bf16 as loaded, adapters fp32, autocast. On the CPU
    # (--tiny) fp32 throughout, as the entrenar row there (CPU bf16 autocast is slow and this is a smoke test).
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model = model.to(dev)
    model = peft.get_peft_model(model, peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                                       target_modules="all-linear", task_type="CAUSAL_LM"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return train_grpo(trl, model, tokenizer, case, prompts, work / "trl-grpo", skip, mean_prompt, started)[0]


def unsloth_grpo_settings(case: dict, folder: Path) -> dict:
    """Unsloth's FastLanguageModel arguments for the case: bench_e2e.py's LoRA ones (bf16, r=16 alpha 32 on the
    modules PEFT's all-linear picks, use_gradient_checkpointing "unsloth", random_state 0, local files only), with
    vLLM off (fast_inference False: vLLM is not on the GPU machine)."""
    settings = unsloth_settings(case, folder, "unsloth")
    settings["from_pretrained"].update(load_in_4bit=False, fast_inference=False)
    return settings


def run_unsloth(case: dict, folder: Path, prompts: Path, work: Path, skip: int, mean_prompt: float) -> dict:
    """Unsloth's GRPO without vLLM, in this process (Unsloth imported before trl and transformers, so its patch of
    TRL's GRPOTrainer applies): FastLanguageModel on the same folder, then :func:`train_grpo`."""
    settings = unsloth_grpo_settings(case, folder)
    unsloth, why = import_unsloth()
    if unsloth is None:
        return {"status": "skipped", "error": why, "settings": settings}
    import torch

    try:
        import datasets  # noqa: F401 (train_grpo's)
        import trl
    except ImportError as e:
        return {"status": "skipped", "error": str(e), "settings": settings}
    started = time.perf_counter()
    model, tokenizer = unsloth.FastLanguageModel.from_pretrained(**dict(settings["from_pretrained"],
                                                                        dtype=torch.bfloat16))
    model = unsloth.FastLanguageModel.get_peft_model(model, **settings["get_peft_model"])
    result, trainer = train_grpo(trl, model, tokenizer, case, prompts, work / "unsloth-grpo", skip, mean_prompt,
                                 started)
    return {**result, **unsloth_did(unsloth, trainer, model), "settings": settings}


def unsloth_did(unsloth, trainer, model) -> dict:
    """What Unsloth did in its row: its versions; `grpo_patch`, whether the GRPOTrainer that ran was the class
    Unsloth generates from TRL's at import (else TRL's own ran, as Unsloth falls back when its rewrite fails);
    whether its GRPOConfig was the run's; the hook TRL's generation went through (Unsloth's
    `unsloth_unwrap_model_for_generation` puts the model in its inference mode); whether its fast generate was
    installed on the model; its decode CUDA graphs' counters summed over the model (captures, replays, eager
    steps: replays > 0 means the rollouts' decode ran from graphs); the gradient checkpointing it recorded."""
    import importlib.metadata

    trainer_class = type(trainer)
    module = sys.modules.get(trainer_class.__module__)
    unwrap = getattr(module, "unwrap_model_for_generation", None)
    graphs: dict[str, int] = {}
    try:
        from unsloth.models import _decode_graphs

        for m in model.modules():
            if "_unsloth_decode_graphs" in m.__dict__:
                for key, value in _decode_graphs.stats(m).items():
                    if isinstance(value, int) and not isinstance(value, bool):
                        graphs[key] = graphs.get(key, 0) + value
    except Exception as e:  # noqa: BLE001 (a private module: its absence is recorded, not fatal)
        graphs = {"error": f"{type(e).__name__}: {e}"}
    fast_generate = any(getattr(getattr(m, "generate", None), "__name__", "") == "unsloth_fast_generate"
                        for m in model.modules())
    try:
        zoo = importlib.metadata.version("unsloth_zoo")
    except importlib.metadata.PackageNotFoundError:
        zoo = None
    return {"unsloth": unsloth.__version__, "unsloth_zoo": zoo, "device_type": getattr(unsloth, "DEVICE_TYPE", None),
            "trainer_class": f"{trainer_class.__module__}.{trainer_class.__qualname__}",
            "grpo_patch": trainer_class.__name__.startswith("Unsloth"),
            "config_patched": bool(getattr(type(trainer.args), "_unsloth_patched_rl_config", False)),
            "generation_unwrap": getattr(unwrap, "__name__", None), "fast_generate": fast_generate,
            "decode_graphs": graphs,
            "unsloth_gradient_checkpointing": getattr(model, "_unsloth_gradient_checkpointing", None)}


def run_baseline_process(row: str, case_name: str, folder: Path, prompts: Path, mean_prompt: float,
                         args: argparse.Namespace) -> dict:
    """A baseline row (trl, unsloth) in a fresh process, so neither stack's memory counts against the other, and
    Unsloth's patches of transformers and TRL reach no other row."""
    out = Path(args.work) / f"{case_name}-{row}-grpo.json"
    cmd = [sys.executable, __file__, "--baseline-row", row, "--cases", case_name, "--folder", str(folder),
           "--prompts", str(prompts), "--work", args.work, "--skip", str(args.skip), "--out", str(out),
           "--mean-prompt", str(mean_prompt)]
    return run_row_process(cmd, out, args)


# ---------------------------------------------------------------- report


def print_table(results: list[dict]) -> None:
    """One line per case and row: samples/s, tokens/s, peak memory, the ratios of samples/s and of peak memory to
    each baseline row that ran (trl, unsloth), the completion length."""
    bases = bases_that_ran(BASELINES, results)
    print(f"{'case':<12}{'row':<10}{'samples/s':>10}{'tok/s':>9}{'all tok/s':>10}{'step ms':>9}{'peak GiB':>9}"
          + ratio_headers(bases, "vs ") + ratio_headers(bases, "mem/") + f"{'length':>8}")
    for r in results:
        if r["status"] != "ok":
            print(failed_line(r["case"], r["row"], r, (12, 10)))
            continue
        length = r.get("completion_mean_length")
        flag = "" if length is not None and abs(length - r["recipe_completion"]) < 1e-6 else " (!)"
        print(f"{r['case']:<12}{r['row']:<10}{r['samples_per_s']:10.2f}{r['tokens_per_s']:9.0f}"
              f"{r['total_tokens_per_s']:10.0f}{r['step_ms_median']:9.0f}{r['peak_gib'] or 0:9.2f}"
              + ratio_cells(results, [r], bases, "samples_per_s", "vs ")
              + ratio_cells(results, [r], bases, "peak_gib", "mem/")
              + f"{length if length is not None else float('nan'):8.1f}{flag}")


def dry_run(args: argparse.Namespace) -> None:
    """--dry: each row's set-up for each case, as one JSON line, without building or running anything: the
    entrenar recipe's task and training keys, the baselines' GRPOConfig fields, Unsloth's FastLanguageModel
    arguments (a check of those paths on a machine that cannot run them)."""
    work, dev = Path(args.work), device()
    for case_name in args.cases.split(","):
        case = _case(case_name, args)
        folder = work / (case["shape"] + ("-tiny" if args.tiny else ""))
        for row in args.rows.split(","):
            if row in ("entrenar", "entrenar-matched"):
                recipe = recipe_for(case, folder, work / "prompts.jsonl", work / "run", row == "entrenar-matched")
                what = {"task": recipe["task"], "training": recipe["training"]}
            else:
                what = {"grpo_config": grpo_config(case, work / f"{row}-grpo", dev)}
                if row == "unsloth":
                    what.update(unsloth_grpo_settings(case, folder))
            print(f"[{case_name}] {row}: {json.dumps(what)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    case_arguments(p, CASES, ROWS, "/tmp/grpo", "prompts", skip=2)
    p.add_argument("--tiny", action="store_true", help="toy sizes, CPU without a GPU: a smoke test, not a measurement")
    p.add_argument("--dry", action="store_true", help="print what each row would run (GRPOConfig fields, Unsloth's "
                   "arguments, entrenar's task and training keys) and stop")
    p.add_argument("--gguf", default="data/SmolLM2-135M-Instruct.Q4_1.gguf", help="the GGUF --tiny prepares from")
    p.add_argument("--entrenar-row", default="", help=argparse.SUPPRESS)
    p.add_argument("--baseline-row", default="", choices=("", *BASELINES), help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    p.add_argument("--prompts", default="", help=argparse.SUPPRESS)
    p.add_argument("--mean-prompt", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.entrenar_row:  # the entrenar row's process, started by run_entrenar
        raise SystemExit(entrenar_row(args.entrenar_row))
    if args.baseline_row:  # a baseline row's process, started by run_baseline_process
        run = run_unsloth if args.baseline_row == "unsloth" else run_trl  # Unsloth imported first, in run_unsloth
        result = run(_case(args.cases, args), Path(args.folder), Path(args.prompts), Path(args.work), args.skip,
                     args.mean_prompt)
        Path(args.out).write_text(json.dumps(result))
        return
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        p.error(f"--rows: unknown {', '.join(unknown)} (of {', '.join(ROWS)})")
    if args.dry:
        dry_run(args)
        return
    work, tokenizer_dir, text, vocab_size = start_cases(p, args, "grpo-prepare-")

    results = []
    for case_name in args.cases.split(","):
        case = _case(case_name, args)
        t0 = time.perf_counter()
        folder = make_model_folder(case["shape"], vocab_size, case["seq"], tokenizer_dir,
                                   work / (case["shape"] + ("-tiny" if args.tiny else "")), args.tiny)
        prompts = make_prompts(tokenizer_dir, text, case, work / f"prompts-{case['prompt']}.jsonl")
        mean_prompt = prompt_tokens(prompts, folder)
        print(f"[{case_name}] model folder {folder} and prompts {prompts} ({mean_prompt:.1f} tokens) ready in "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
        for row in args.rows.split(","):
            t0 = time.perf_counter()
            if row in ("entrenar", "entrenar-matched"):
                r = run_entrenar(case_name, case, folder, prompts, work, args.skip, mean_prompt,
                                 matched=row == "entrenar-matched")
            else:
                r = run_baseline_process(row, case_name, folder, prompts, mean_prompt, args)
            results.append({"case": case_name, "row": row, "load_avg": os.getloadavg(),
                            "recipe_completion": case["completion"], "prompts_per_step": case["batch"],
                            "generations": GENERATIONS, **r})
            print(f"[{case_name}] {row}: {r['status']} {r.get('samples_per_s') or ''} samples/s in "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
            write_results(args.out, results)  # after every row: a run cut short keeps what it measured
    print_table(results)


def _case(name: str, args: argparse.Namespace) -> dict:
    case = case_for(name, args.steps, args.tiny, CASES)
    if args.tiny:
        case.update(TINY_GRPO)
        case["steps"] = args.steps or TINY_GRPO["steps"]
    return case


if __name__ == "__main__":
    main()
