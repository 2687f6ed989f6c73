"""The longest sequence that trains on one GPU, batch 1: entrenar against Unsloth, found by bisection (issue 37).

For each case (``lora-1b``: LoRA r=16 on every linear layer of a random Llama-3.2-1B-shape folder; ``qlora-8b``: the
same over an NF4 base of the Llama-3.1-8B shape; both with SmolLM2's tokenizer from ``--tokenizer``) and each row,
a trial at sequence length T trains ``--steps`` steps on one row of T tokens: ONE document as long as the row (the
texts of ``--text`` concatenated and repeated to length; no packing of short documents). Each trial runs in its own
process under ``--trial-timeout`` seconds. It *fits* when the process exits 0 with every loss finite. The search
starts at ``--start`` tokens and doubles until a trial fails (or ``--max``), then bisects between the longest that
fit and the shortest that failed until they are within ``--tolerance`` (5%), in multiples of 1024 tokens, as long
as the row's ``--budget-s`` lasts. A failure is ``oom`` (CUDA out of memory), ``timeout`` (the trial ran out of
time: the length may fit, in more time) or ``error``; the result says which bounded it.

Rows:

  entrenar   `entrenar train --force` (the plan's memory refusal off: the GPU decides) with the long-context
             settings: bf16, every layer checkpointed with its input in pinned CPU memory
             (training.offload_activations), tiled MLP (training.tiled_mlp, ``--tile`` tokens), the fused
             chunked loss and kernels (auto), CUDA graphs off (tiled MLP refuses them; one long row gains nothing).
             Its prediction: `entrenar inspect RECIPE` ("longest context"), run once per case in a separate process.
  unsloth    Unsloth (its wheels: bench/unsloth_setup.sh) as bench_e2e.py's Unsloth rows load it:
             FastLanguageModel.from_pretrained on the same folder (bf16, or load_in_4bit for QLoRA) with
             ``unsloth_tiled_mlp=True`` (its tiled MLP, documented as the switch for long context) and
             get_peft_model(r=16, alpha=32, q/k/v/o/gate/up/down, ``use_gradient_checkpointing="unsloth"``: its
             default, every layer's input offloaded to CPU memory); the step is the model's own loss with labels,
             backward, fused AdamW (lr 1e-4), as HF Trainer with `bf16=True` runs it. Imported first, offline.

Each trial's tokens/s is the median over its steps after the first; its peak is torch.cuda.max_memory_allocated
(entrenar's metrics.jsonl ``peak_mem_gb``, converted to GiB). The JSON (``--out``, rewritten after every trial,
so a call cut short keeps what it found) holds every trial and, per case and row, the longest length that fit,
tokens/s and peak memory there, what bounded it, and for entrenar inspect's prediction.

On the GPU machine (one call of at most 10 minutes: the four searches share it through --budget-s; a qlora-8b
trial at 128k tokens takes about a minute, so at these budgets a row is usually bounded by time, which the JSON
says: give one case a call of its own, with larger --budget-s and --trial-timeout, to find its memory bound):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl/extra/*.whl \\
      && bash bench/unsloth_setup.sh install \\
      && PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false python3 bench/longest_context.py \\
         --cases lora-1b qlora-8b --rows entrenar unsloth --text .e2e/text.jsonl --tokenizer .e2e \\
         --work /tmp/longctx --budget-s 130 --trial-timeout 100 --out $OUT/longest-context.json \\
         2>&1 | tee $OUT/longest-context.log | grep -v Warning

``--tiny`` runs the whole procedure on a toy model (hidden 64, 2 layers) on the CPU in a minute or two, with a
synthetic memory limit (``--tiny-limit`` tokens: a longer trial counts as ``oom`` after it ran): a check of the
search, the trials and the report, not a measurement. Unsloth needs a GPU; without one its row is skipped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import UNSLOTH_ENV  # noqa: E402 (the end-to-end benchmarks' shared helpers)

GiB = 2**30
CASES = {"lora-1b": {"shape": "llama-1b", "method": "lora"}, "qlora-8b": {"shape": "llama-8b", "method": "qlora"}}
ROWS = ("entrenar", "unsloth")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA_ERROR_OUT_OF_MEMORY", re.IGNORECASE)


# ---------------------------------------------------------------- the search


def search(trial, start: int, maximum: int, tolerance: float, step: int, deadline: float) -> dict:
    """Longest length ``trial(n)`` fits: ``start`` doubling to the first failure (halving when ``start`` fails),
    then bisection to within ``tolerance`` in multiples of ``step``, while ``time.monotonic() < deadline``.
    ``trial(n)`` returns a dict with ``fits`` (bool) and ``reason`` for a failure; a failure for ``budget`` (the
    row's time ran out mid-trial) says nothing of its length: the search stops there."""
    fit: int | None = None
    failed: int | None = None
    reason = None
    n = start
    stopped = False

    def run(length: int) -> bool | None:  # fits, or None when the budget cut the trial short
        nonlocal stopped
        result = trial(length)
        if not result["fits"] and result.get("reason") == "budget":
            stopped = True
            return None
        return bool(result["fits"])

    while not stopped and time.monotonic() < deadline and n <= maximum:  # up by doubling
        fits = run(n)
        if fits is None:
            break
        if fits:
            fit = n
            if n == maximum:
                break
            n = min(2 * n, maximum)
        else:
            failed, reason = n, trial.last["reason"]
            break
    while not stopped and fit is None and failed is not None and failed > step and time.monotonic() < deadline:
        n = max(step, failed // 2 // step * step)  # down by halving
        fits = run(n)
        if fits is None:
            break
        if fits:
            fit = n
        else:
            failed, reason = n, trial.last["reason"]
    while (not stopped and fit is not None and failed is not None and failed > fit * (1 + tolerance)
           and time.monotonic() < deadline):
        middle = (fit + failed) // 2 // step * step
        if middle <= fit:
            break
        fits = run(middle)
        if fits is None:
            break
        if fits:
            fit = middle
        else:
            failed, reason = middle, trial.last["reason"]
    done = failed is None and fit == maximum or (
        fit is not None and failed is not None and (failed <= fit * (1 + tolerance) or failed - fit <= step))
    bound = reason if failed is not None else ("maximum" if fit == maximum else "budget")
    return {"longest": fit, "shortest_failed": failed, "bounded_by": bound,
            "converged": bool(done)}


class Trials:
    """Runs and records trials of one case and row: ``self(n)`` runs the trial at ``n`` tokens (once)."""

    def __init__(self, run, record) -> None:
        self.run, self.record, self.seen, self.last = run, record, {}, {}

    def __call__(self, n: int) -> dict:
        if n not in self.seen:
            started = time.perf_counter()
            result = self.run(n)
            result.update(seq_len=n, wall_s=round(time.perf_counter() - started, 1))
            self.seen[n] = result
            self.record(result)
            print(f"  T={n:>8,}: {'fits' if result['fits'] else 'fails (' + result['reason'] + ')'}"
                  + (f", {result['tokens_per_s']:,.0f} tokens/s, {result['peak_gib']:.2f} GiB"
                     if result["fits"] and result.get("tokens_per_s") else "")
                  + f" [{result['wall_s']:.0f} s]", flush=True)
        self.last = self.seen[n]
        return self.last


# ---------------------------------------------------------------- inputs


def vocab_size(tokenizer_dir: Path) -> int:
    """bench_e2e.py's rule: SmolLM2's 49,152 (the embedding rows the published model has)."""
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return 49152 if len(vocab) <= 49152 else len(vocab)


def make_folder(case: dict, tokenizer_dir: Path, folder: Path, max_len: int, tiny: bool) -> float:
    """The case's random bf16 folder (bench_e2e.make_model_folder), made in a child process so this one never
    holds CUDA memory; seconds it took (0 if it was there)."""
    if (folder / "config.json").is_file():
        return 0.0
    started = time.perf_counter()
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); import bench_e2e; "
            "bench_e2e.make_model_folder(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]), "
            "Path(sys.argv[6]), tiny=sys.argv[7] == '1')")
    subprocess.run([sys.executable, "-c", code, str(HERE), case["shape"], str(vocab_size(tokenizer_dir)),
                    str(max_len), str(tokenizer_dir), str(folder), "1" if tiny else "0"], check=True)
    return time.perf_counter() - started


def make_document(text: Path, tokenizer_dir: Path, out: Path, tokens: int) -> int:
    """One JSONL record: the texts of ``text`` concatenated (a blank line between) and repeated until the
    document has at least ``tokens`` + 1 tokens by the tokenizer; returns its token count."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = [json.loads(line)["text"] for line in text.read_text().splitlines() if line.strip()]
    counts = [len(tokenizer.encode(t).ids) for t in texts]
    parts, total = [], 0
    while total <= tokens:
        for t, n in zip(texts, counts, strict=True):
            parts.append(t)
            total += n + 2
            if total > tokens:
                break
    document = "\n\n".join(parts)
    n = len(tokenizer.encode(document).ids)
    while n <= tokens:  # the counts summed per text were short: one more pass
        document += "\n\n" + "\n\n".join(texts)
        n = len(tokenizer.encode(document).ids)
    out.write_text(json.dumps({"text": document}) + "\n")
    return n


# ---------------------------------------------------------------- entrenar


def entrenar_recipe(case: dict, folder: Path, document: Path, seq_len: int, steps: int, tile: int, run_dir: Path,
                    tiny: bool) -> dict:
    """The long-context recipe (module docstring)."""
    lora = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
    if case["method"] == "qlora":
        lora["quantize_base"] = "nf4"
    return {
        "model": {"path": str(folder), "dtype": "float32" if tiny else "bfloat16", "device": "auto"},
        "data": {"train": str(document), "seq_len": seq_len, "packing": False, "format": "text",
                 "validation_split": 0.0, "add_eos": False},
        "lora": lora,
        "optimizer": {"name": "adamw", "lr": 1e-4},
        "training": {"max_steps": steps, "batch_size": 1, "precision": "fp32" if tiny else "bf16",
                     "activation_checkpointing": True, "offload_activations": not tiny, "tiled_mlp": tile,
                     "cuda_graphs": False, "offload_weights": False, "log_every": 1, "save_every": 0,
                     "eval_every": 0},
        "output": {"dir": str(run_dir)},
    }


def run_process(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int | None, str]:
    """(exit code, or None when it ran past ``timeout`` and was killed with its process group; its output)."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, log.read_text(errors="replace")


def failure(code: int | None, output: str, cut_by_budget: bool = False) -> dict:
    """A trial that did not fit: ``oom``, ``error``, ``timeout`` (past --trial-timeout), or ``budget`` (stopped by
    the row's --budget-s before --trial-timeout: nothing is known of its length, and the search stops)."""
    reason = ("budget" if cut_by_budget else "timeout") if code is None else ("oom" if OOM.search(output) else "error")
    return {"fits": False, "reason": reason, "exit": code, "tail": output[-1500:]}


def steady(step_s: list[float], tokens: list[int]) -> float | None:
    """Tokens/s: the median over the steps after the first (all of them if there is one)."""
    timed = list(zip(step_s, tokens, strict=True))[1:] or list(zip(step_s, tokens, strict=True))
    return statistics.median(n / s for s, n in timed) if timed else None


def entrenar_trial(case: dict, folder: Path, document: Path, work: Path, args: argparse.Namespace, n: int,
                   deadline: float) -> dict:
    import yaml

    run_dir = work / f"run-entrenar-{n}"
    recipe = entrenar_recipe(case, folder, document, n, args.steps, args.tile, run_dir, args.tiny)
    path = work / f"entrenar-{n}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    timeout = min(args.trial_timeout, deadline - time.monotonic())
    code, output = run_process([sys.executable, "-m", "entrenar.cli.main", "train", str(path), "--no-progress",
                                "--force"], work / f"entrenar-{n}.log", timeout,
                               {**os.environ, "PYTHONUNBUFFERED": "1"})
    if code != 0:
        return failure(code, output, timeout < args.trial_timeout)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and r.get("tokens")]
    losses = [r["loss"] for r in steps]
    if len(steps) < args.steps or not all(math.isfinite(x) for x in losses):
        return {"fits": False, "reason": "nonfinite" if steps else "error", "losses": losses}
    peak = max((r.get("peak_mem_gb") or 0) for r in steps) * 1e9 / GiB
    if args.tiny and n > args.tiny_limit:  # --tiny's synthetic memory limit
        return {"fits": False, "reason": "oom", "synthetic": True, "losses": losses}
    return {"fits": True, "tokens_per_s": steady([r["tokens"] / r["tokens_per_s"] for r in steps],
                                                 [r["tokens"] for r in steps]),
            "peak_gib": peak, "losses": losses}


def entrenar_prediction(case: dict, folder: Path, document: Path, work: Path, args: argparse.Namespace) -> dict:
    """`entrenar inspect RECIPE` (planned for CUDA) in its own process: the longest context it predicts."""
    import yaml

    path = work / "entrenar-inspect.yaml"
    path.write_text(yaml.safe_dump(entrenar_recipe(case, folder, document, 4096, args.steps, args.tile,
                                                   work / "run-inspect", False), sort_keys=False))
    code, output = run_process([sys.executable, "-m", "entrenar.cli.main", "inspect", str(path), "--device", "cuda",
                                "--gpu-memory", str(args.gpu_memory)], work / "entrenar-inspect.log", 300)
    found = re.search(r"longest context +([\d,]+) tokens in one row \(batch 1\) fit ([\d.]+) GiB \(([^)]*)\)",
                      output)
    if code != 0 or not found:
        return {"error": output[-1500:]}
    return {"longest": int(found.group(1).replace(",", "")), "budget_gib": float(found.group(2)),
            "budget": found.group(3), "estimate_line": next((line for line in output.splitlines()
                                                              if line.startswith("memory estimate")), None)}


# ---------------------------------------------------------------- Unsloth


def unsloth_trial(case: dict, folder: Path, document: Path, work: Path, args: argparse.Namespace, n: int,
                  deadline: float) -> dict:
    out = work / f"unsloth-{n}.json"
    out.unlink(missing_ok=True)
    timeout = min(args.trial_timeout, deadline - time.monotonic())
    code, output = run_process([sys.executable, __file__, "--unsloth-trial", str(n), "--method", case["method"],
                                "--folder", str(folder), "--document", str(document), "--tokenizer",
                                args.tokenizer, "--steps", str(args.steps), "--out", str(out),
                                "--unsloth-tiled-mlp", str(args.unsloth_tiled_mlp)],
                               work / f"unsloth-{n}.log", timeout, {**os.environ, **UNSLOTH_ENV})
    if code != 0 or not out.is_file():
        result = failure(code, output, timeout < args.trial_timeout)
        if "import unsloth" in output and "SKIPPED" in output:
            result["reason"] = "skipped"
        return result
    result = json.loads(out.read_text())
    if not all(math.isfinite(x) for x in result["losses"]):
        return {"fits": False, "reason": "nonfinite", **result}
    return {"fits": True, **result}


def run_unsloth_trial(args: argparse.Namespace) -> None:
    """One Unsloth trial in this process (module docstring): writes tokens/s, peak and losses to ``--out``."""
    for key, value in UNSLOTH_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import unsloth
    except Exception as e:  # noqa: BLE001 (Unsloth raises what it likes where it cannot run)
        print(f"SKIPPED: import unsloth: {type(e).__name__}: {e}")
        sys.exit(3)
    import torch
    from tokenizers import Tokenizer

    n = args.unsloth_trial
    tokenizer = Tokenizer.from_file(str(Path(args.tokenizer) / "tokenizer.json"))
    ids = tokenizer.encode(json.loads(Path(args.document).read_text())["text"]).ids[:n]
    settings = dict(model_name=args.folder, max_seq_length=n, dtype=torch.bfloat16,
                    load_in_4bit=args.method == "qlora", load_in_8bit=False, full_finetuning=False,
                    use_gradient_checkpointing="unsloth", local_files_only=True)
    tiled = args.unsloth_tiled_mlp
    try:
        model, _ = unsloth.FastLanguageModel.from_pretrained(**settings, unsloth_tiled_mlp=tiled)
    except TypeError as e:  # a version without the switch: its default, and the JSON says so
        if "unsloth_tiled_mlp" not in str(e):
            raise
        model, _ = unsloth.FastLanguageModel.from_pretrained(**settings)
        tiled = False
    model = unsloth.FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=32, lora_dropout=0.0, bias="none", target_modules=TARGETS,
        use_gradient_checkpointing="unsloth", random_state=0)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    input_ids = torch.tensor([ids], device="cuda")
    step_s, losses = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - t0)
    Path(args.out).write_text(json.dumps({
        "tokens_per_s": steady(step_s, [n - 1] * len(step_s)),
        "peak_gib": torch.cuda.max_memory_allocated() / GiB, "losses": losses, "unsloth": unsloth.__version__,
        "unsloth_tiled_mlp": tiled}))


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--text", default=".e2e/text.jsonl")
    p.add_argument("--tokenizer", default=".e2e", help="folder with SmolLM2's tokenizer.json")
    p.add_argument("--work", default="/tmp/longctx")
    p.add_argument("--out", default=None, help="JSON of every trial and each search's result")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps a trial trains (default 3)")
    p.add_argument("--start", type=int, default=16384, help="first length tried (default 16384)")
    p.add_argument("--max", type=int, default=1048576, help="longest length tried (default 1048576)")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--tile", type=int, default=8192, help="entrenar's training.tiled_mlp (tokens a tile)")
    p.add_argument("--trial-timeout", type=float, default=100.0, help="seconds a trial may run")
    p.add_argument("--budget-s", type=float, default=130.0, help="seconds each case's row may search")
    p.add_argument("--gpu-memory", type=float, default=80.0,
                   help="inspect's --gpu-memory (GiB) where it plans for a GPU it lacks")
    p.add_argument("--unsloth-tiled-mlp", type=lambda v: v.lower() in ("1", "true", "yes"), default=True,
                   help="Unsloth's unsloth_tiled_mlp (default true; false: its offloaded checkpointing alone, where "
                        "its tiled MLP fails: 2026.10.9 on torch 2.11 raised 'A view was created in no_grad mode' "
                        "in its backward)")
    p.add_argument("--tiny", action="store_true", help="a toy model on the CPU (module docstring)")
    p.add_argument("--tiny-limit", type=int, default=700, help="--tiny: longer trials count as out of memory")
    # one Unsloth trial (internal: run by the parent in its own process)
    p.add_argument("--unsloth-trial", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--method", default="lora", help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    p.add_argument("--document", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.unsloth_trial is not None:
        run_unsloth_trial(args)
        return
    if args.tiny:
        args.start, args.max = min(args.start, 128), min(args.max, 2048)
        args.tile = min(args.tile, 64)
    step = 16 if args.tiny else 1024
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(args.tokenizer)
    report: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "host": platform.node(), "argv": sys.argv[1:], "device": gpu_name(), "cases": {}}

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))

    for name in args.cases:
        case = CASES[name]
        case_work = work / name
        case_work.mkdir(exist_ok=True)
        folder = case_work / "model"
        made = make_folder(case, tokenizer_dir, folder, args.max, args.tiny)
        document = case_work / "document.jsonl"
        doc_tokens = make_document(Path(args.text), tokenizer_dir, document, args.max)
        entry: dict = {"folder_s": round(made, 1), "document_tokens": doc_tokens, "rows": {}}
        report["cases"][name] = entry
        print(f"[{name}] folder {made:.0f} s, one document of {doc_tokens:,} tokens", flush=True)
        for row in args.rows:
            trials: list[dict] = []
            row_entry: dict = {"trials": trials}
            entry["rows"][row] = row_entry
            if row == "entrenar":
                row_entry["prediction"] = entrenar_prediction(case, folder, document, case_work, args)
                print(f"[{name}] entrenar inspect predicts {row_entry['prediction'].get('longest')}", flush=True)
            deadline = time.monotonic() + args.budget_s
            run = entrenar_trial if row == "entrenar" else unsloth_trial
            print(f"[{name}] {row}:", flush=True)
            trial = Trials(lambda n, run=run: run(case, folder, document, case_work, args, n, deadline),
                           lambda r: (trials.append(r), save()))
            first = trial(args.start) if row == "unsloth" else {"fits": True}
            if not first["fits"] and first["reason"] == "skipped":
                row_entry.update(status="skipped", error=trial.last["tail"])
                print(f"[{name}] unsloth skipped", flush=True)
                save()
                continue
            result = search(trial, args.start, args.max, args.tolerance, step, deadline)
            longest = trial.seen.get(result["longest"]) if result["longest"] else None
            row_entry.update(result, tokens_per_s=longest and longest.get("tokens_per_s"),
                             peak_gib=longest and longest.get("peak_gib"))
            prediction = row_entry.get("prediction", {}).get("longest")
            if prediction and result["longest"]:
                row_entry["prediction_over_measured"] = round(prediction / result["longest"], 3)
            print(f"[{name}] {row}: longest {result['longest']} (next failed: {result['shortest_failed']}, "
                  f"{result['bounded_by']}), converged {result['converged']}", flush=True)
            save()
    print_table(report)
    save()


def gpu_name() -> str:
    """The GPU's name from nvidia-smi (this process never initialises CUDA), or 'cpu'."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "cpu"
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"


def print_table(report: dict) -> None:
    print(f"\nlongest context, batch 1 ({report['device']}, {report['date']})")
    print(f"{'case':<10}{'row':<10}{'longest':>10}{'failed at':>11}{'bound':>10}{'tok/s':>10}{'peak GiB':>10}"
          f"{'predicted':>11}")
    for name, entry in report["cases"].items():
        for row, r in entry["rows"].items():
            if r.get("status") == "skipped":
                print(f"{name:<10}{row:<10}  skipped")
                continue
            pred = (r.get("prediction") or {}).get("longest")
            print(f"{name:<10}{row:<10}{r.get('longest') or 0:>10,}{r.get('shortest_failed') or 0:>11,}"
                  f"{r.get('bounded_by') or '':>10}{r.get('tokens_per_s') or 0:>10,.0f}{r.get('peak_gib') or 0:>10.2f}"
                  f"{pred or 0:>11,}")


if __name__ == "__main__":
    main()
