"""Record five small `entrenar train` runs, to check that a refactor of the training core changes no bit of them.

Each case runs `python -m entrenar train ... --no-progress` as a subprocess (the code under test taken from
`--src` through PYTHONPATH, OMP_NUM_THREADS=1) in a fresh work folder `OUT/work/<case>/`, then writes

    OUT/<case>.jsonl       the run's metrics.jsonl without its timing and memory fields (DROPPED below)
    OUT/<case>.files.txt   "sha256  path" of the run's outputs, sorted by path: adapter/ or model/, best/, the
                           checkpoints' safetensors, the quickstart's generated model and data, the classification
                           report.json (a .safetensors file hashed with its header's keys sorted: see digest)

Cases: quickstart (the bundled one, shortened), lora and qlora-cpu (NF4 base) on the quickstart's generated model
and data, classification (LoRA + score head on that model, three labels), ddp2 (the LoRA case on 2 gloo
processes). The later cases need the quickstart's files, so --only runs quickstart too where its folder is missing.
Every path in a recipe is relative to its work folder, so two OUT folders record the same bytes. About 2 minutes on
2 CPU cores. A file recorded in only one of two compared folders counts as a difference.

    python bench/record_runs.py --src /work/base/src --out /work/baseline-runs    # before the refactor
    python bench/record_runs.py --src src --out /tmp/after [--only lora,ddp2]      # after it
    python bench/record_runs.py --compare /work/baseline-runs /tmp/after          # exit 1 on any difference
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

QS = "../quickstart/run/quickstart"  # the quickstart's generated model and data, seen from another case's folder

LORA = f"""\
model: {{path: {QS}/base-model, device: cpu}}
data: {{train: {QS}/train.jsonl, validation: {QS}/validation.jsonl, seq_len: 64, train_on: completion}}
lora: {{r: 8, alpha: 16, dropout: 0.05, target_modules: all-linear, quantize_base: null}}
optimizer: {{lr: 2.0e-3}}
schedule: {{name: cosine, warmup_steps: 4}}
training: {{max_steps: 24, batch_size: 4, grad_accum: 2, eval_every: 12, eval_batches: 8, save_every: 12, log_every: 6,
           cpu_threads: 1, replica_check_every: 5}}
"""

CLASSIFICATION = f"""\
model: {{path: {QS}/base-model, device: cpu}}
data: {{train: train.jsonl, validation: validation.jsonl, seq_len: 16}}
task: {{type: classification, labels: [low, mid, high], class_weights: auto}}
lora: {{r: 4, alpha: 8, dropout: 0.05, target_modules: all-linear}}
optimizer: {{lr: 5.0e-3}}
schedule: {{name: cosine, warmup_steps: 3}}
training: {{max_steps: 20, batch_size: 8, eval_every: 10, save_every: 10, log_every: 5, cpu_threads: 1}}
"""

# name: (recipe text or None for the bundled quickstart, extra `entrenar train` arguments)
CASES = {
    "quickstart": (None, ["--set", "training.max_steps=120", "--set", "training.eval_every=60",
                          "--set", "training.save_every=60"]),
    "lora": (LORA, []),
    "qlora-cpu": (LORA.replace("quantize_base: null", "quantize_base: nf4"), []),
    "classification": (CLASSIFICATION, []),
    "ddp2": (LORA, ["--nproc-per-node", "2", "--set", "training.max_steps=8", "--set", "training.eval_every=4",
                    "--set", "training.save_every=4"]),
}

# Wall-clock and memory fields of metrics.jsonl: they differ from run to run, never from the code's arithmetic.
DROPPED = {"tokens_per_s", "elapsed_s", "step_time_s", "peak_mem_gb", "peak_mem_gb_ranks"}
HASHED = ("adapter/", "model/", "best/", "quickstart/", "report.json")  # and in checkpoints/, the safetensors


def write_classification_data(folder: Path) -> None:
    """Sums 'a+b' labelled by size; the same bytes every time."""
    for name, numbers in (("train.jsonl", range(0, 240)), ("validation.jsonl", range(240, 300))):
        with open(folder / name, "w") as f:
            for i in numbers:
                a, b = (i * 37) % 100, (i * 61 + 7) % 100
                label = "low" if a + b < 66 else "mid" if a + b < 132 else "high"
                f.write(json.dumps({"text": f"{a}+{b}", "label": label}) + "\n")


def run_case(name: str, env: dict, out: Path) -> float:
    """Train one case in a fresh OUT/work/<name>/, write its stripped metrics and file hashes; the wall time."""
    recipe, extra = CASES[name]
    work = out / "work" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    command = [sys.executable, "-m", "entrenar", "train", "--no-progress", "--set", "output.dir=run", *extra]
    if recipe is not None:
        (work / "recipe.yaml").write_text(recipe)
        command.insert(4, "recipe.yaml")
    if name == "classification":
        write_classification_data(work)
    started = time.perf_counter()
    with open(work / "log.txt", "w") as log:
        code = subprocess.run(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    if code != 0:
        sys.exit(f"{name}: exit {code}; the end of {work / 'log.txt'}:\n" + (work / "log.txt").read_text()[-3000:])
    run = work / "run"
    with open(out / f"{name}.jsonl", "w") as f:
        for line in (run / "metrics.jsonl").read_text().splitlines():
            f.write(json.dumps(strip(json.loads(line))) + "\n")
    with open(out / f"{name}.files.txt", "w") as f:
        for path in sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file()):
            if path.startswith(HASHED) or (path.startswith("checkpoints/") and path.endswith(".safetensors")):
                f.write(f"{digest(run / path)}  {path}\n")
    return seconds


def digest(path: Path) -> str:
    """sha256 of a file; of a .safetensors file with its JSON header's keys sorted, since safetensors writes
    ``__metadata__`` (the checkpoints' rng.safetensors has two keys) in hash-map order, not the same every run."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        size = int.from_bytes(data[:8], "little")
        header = json.dumps(json.loads(data[8:8 + size]), sort_keys=True).encode()
        data = header + data[8 + size:]
    return hashlib.sha256(data).hexdigest()


def strip(record: dict) -> dict:
    return {key: value for key, value in record.items() if key not in DROPPED}


def compare(a: Path, b: Path) -> int:
    """Print each recorded file of two OUT folders: identical, or its first differing line; 1 on any difference."""
    names = sorted({p.name for folder in (a, b) for p in folder.glob("*.jsonl")}
                   | {p.name for folder in (a, b) for p in folder.glob("*.files.txt")})
    differ = 0
    for name in names:
        if not (a / name).is_file() or not (b / name).is_file():
            print(f"{name}: only in {a if (a / name).is_file() else b}")
            differ = 1
            continue
        lines_a, lines_b = (a / name).read_text().splitlines(), (b / name).read_text().splitlines()
        first = next((i for i, (x, y) in enumerate(zip(lines_a, lines_b)) if x != y), None)
        if first is None and len(lines_a) == len(lines_b):
            print(f"{name}: identical ({len(lines_a)} lines)")
            continue
        differ = 1
        first = min(len(lines_a), len(lines_b)) if first is None else first
        show = lambda lines: lines[first] if first < len(lines) else "<end of file>"  # noqa: E731
        print(f"{name}: differs at line {first + 1}\n  {a}: {show(lines_a)}\n  {b}: {show(lines_b)}")
    return differ


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, help="the src/ folder whose entrenar to run")
    parser.add_argument("--out", type=Path, help="where to record (each case's work folder is rebuilt)")
    parser.add_argument("--only", help="comma-separated cases (default all: " + ",".join(CASES) + ")")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.src is None or args.out is None:
        parser.error("--src and --out are needed to record (or --compare DIR_A DIR_B)")
    names = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; cases: {', '.join(CASES)}")
    if not (args.out / "work/quickstart/run/quickstart/base-model").is_dir():
        names.append("quickstart")  # the other cases train on its generated model and data
    names = [name for name in CASES if name in names]
    env = {**os.environ, "PYTHONPATH": str(args.src.resolve()), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import entrenar; print(entrenar.__file__)"], env=env,
                           capture_output=True, text=True).stdout.strip()
    if not where or not Path(where).resolve().is_relative_to(args.src.resolve()):
        sys.exit(f"entrenar is imported from {where or 'nowhere'}, not from --src {args.src}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"{name}: {run_case(name, env, args.out):.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
