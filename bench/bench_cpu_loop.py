"""The CPU case of bench_e2e.py stepped round-robin in one process: steadier than separate runs on a busy machine.

    PYTHONPATH=src:bench OMP_NUM_THREADS=1 python bench/bench_cpu_loop.py --work /tmp/e2e-cpu --steps 5

Rows (any of): ent-fp32 / ent-bf16 (entrenar as `entrenar train` steps with `training.kernels: false`),
entk-fp32 / entk-bf16 (with the kernels, what `kernels: auto` takes on a CPU: the fused LoRA node and the chunked
loss), hf-fp32 / hf-bf16 (transformers + PEFT; bf16 = CPU bf16 autocast, Trainer's `bf16=True`). Every model is
built first (the same random folder bench_e2e.py makes, fp32 weights, LoRA r=16 all-linear), then each step
runs one batch on every row in turn (the batches entrenar's data pipeline makes), so the machine's drift falls
on every row alike. Reported per row: median wall and process CPU time per step after the first, and the first
and last losses. Forward, backward, clipping at 1.0 and AdamW; not the loop's host work, data or metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import yaml
from bench_e2e import CASES, make_model_folder, packed_batches, recipe_for

ROWS = ("ent-fp32", "entk-fp32", "hf-fp32", "ent-bf16", "entk-bf16", "hf-bf16")


def build_row(row: str, folder: Path, recipe):
    """(step function, trainable parameters) of one row."""
    precision = "bf16" if row.endswith("bf16") else "fp32"
    torch.manual_seed(0)
    if row.startswith("hf"):
        import peft
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
        model.config.use_cache = False
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                           target_modules="all-linear", task_type="CAUSAL_LM"))
        model.train()

        def step(batch: dict) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            loss.backward()
            return loss.detach()
    else:
        from entrenar import tasks
        from entrenar.data import padding_free
        from entrenar.evaluation.loss import autocast_for
        from entrenar.kernels import apply_kernels
        from entrenar.kernels.fused_linear_ce import FUSED_LOSS_CHUNK, fused_linear_cross_entropy
        from entrenar.models.loss import token_cross_entropy
        from entrenar.train.prepare import build_model

        model, _ = build_model(recipe, tasks.for_recipe(recipe), "float32", torch.device("cpu"), None)
        kernels = row.startswith("entk")
        if kernels:
            apply_kernels(model)

        def step(batch: dict) -> torch.Tensor:  # the loop's loss_sum_of / micro_step
            batch = padding_free(batch)  # what the loop runs on a CPU (data.padding_free: auto)
            inputs = (batch["input_ids"], batch["position_ids"], None)
            layout = {"cu_seqlens": batch["cu_seqlens"], "max_seqlen": batch["max_seqlen"]}
            targets = (batch["labels"][:, 1:] != -100).sum()
            with autocast_for(torch.device("cpu"), precision):
                if kernels:
                    hidden = model.hidden_states(*inputs, **layout)
                    loss_sum = fused_linear_cross_entropy(hidden, model.lm_head.weight, batch["labels"],
                                                          FUSED_LOSS_CHUNK)[0]
                else:
                    loss_sum = token_cross_entropy(model(*inputs, **layout), batch["labels"])[0]
                loss = loss_sum / targets
            loss.backward()
            return loss.detach()
    return step, [p for p in model.parameters() if p.requires_grad]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--text", default=".e2e/text.jsonl")
    p.add_argument("--tokenizer", default=".e2e")
    p.add_argument("--work", default="/tmp/e2e")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    case = {**CASES["cpu-smollm2"], "steps": args.steps}
    tokenizer, text, work = Path(args.tokenizer), Path(args.text), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder = make_model_folder(case["shape"], 49152, case["seq"], tokenizer, work / case["shape"])
    from entrenar.config import load_recipe

    recipe_path = work / "cpu-loop.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe_for(case, folder, text, work / "cpu-loop", fast=False)))
    recipe = load_recipe(recipe_path)
    batches = packed_batches(tokenizer, text, case, args.steps)
    rows = args.rows.split(",")
    built = {}
    for row in rows:
        step, params = build_row(row, folder, recipe)
        built[row] = (step, params, torch.optim.AdamW(params, lr=1e-4))
    wall = {r: [] for r in rows}
    cpu = {r: [] for r in rows}
    losses = {r: [] for r in rows}
    load = [os.getloadavg()[0]]
    for batch in batches:
        for row in rows:
            step, params, optimizer = built[row]
            t0, c0 = time.perf_counter(), time.process_time()
            loss = step(batch)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[row].append(float(loss))
            wall[row].append(time.perf_counter() - t0)
            cpu[row].append(time.process_time() - c0)
        load.append(os.getloadavg()[0])
    print(f"{torch.get_num_threads()} threads, load average {min(load):.1f}..{max(load):.1f}")
    result = {"threads": torch.get_num_threads(), "load_average": load, "torch": torch.__version__, "rows": {}}
    for row in rows:
        w, c = wall[row][1:], cpu[row][1:]
        result["rows"][row] = {"wall_s": wall[row], "cpu_s": cpu[row], "losses": losses[row]}
        print(f"{row:<11} wall median {statistics.median(w):6.2f} s  CPU median {statistics.median(c):6.2f} s  "
              f"loss {losses[row][0]:.4f} -> {losses[row][-1]:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
