"""What is live on the GPU at a training step's peak, by the code that allocated it.

Runs a bench_e2e case's default recipe through `entrenar train`'s loop in this process for a few steps with
CUDA's allocator history on (CUDA graphs off, so every allocation is seen; the graphed step holds the same
tensors in its private pool), then replays the allocation trace, finds the peak and groups the blocks alive at
that moment by the innermost entrenar (or torch) frame that made them.

    PYTHONPATH=src:bench python3 bench/memory_peak.py --case lora-1b --out peak.json
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
import yaml


def main() -> None:
    import bench_e2e

    p = argparse.ArgumentParser()
    p.add_argument("--case", default="lora-1b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--work", default="/tmp/e2e")
    p.add_argument("--out", default="")
    p.add_argument("--set", action="append", default=[])
    args = p.parse_args()
    case = bench_e2e.case_for(args.case, args.steps, False)
    work = Path(args.work)
    vocab = len(json.loads(Path(".e2e/tokenizer.json").read_text())["model"]["vocab"])
    vocab = 49152 if vocab <= 49152 else vocab  # as bench_e2e sizes it
    folder = bench_e2e.make_model_folder(case["shape"], vocab, case["seq"], Path(".e2e"), work / case["shape"])
    recipe = bench_e2e.recipe_for(case, folder, Path(".e2e/text.jsonl"), work / "peak-run", fast=False)
    recipe["training"]["cuda_graphs"] = False
    path = work / "peak.yaml"
    path.write_text(yaml.safe_dump(recipe))
    from entrenar.config import load_recipe
    from entrenar.train.loop import train

    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    train(load_recipe(path, [f"output.dir={work / 'peak-run'}-{id(path)}", *args.set]), progress=False)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    groups = collections.Counter()
    counts = collections.Counter()
    for size, site in at_peak.values():
        groups[site] += size
        counts[site] += 1
    rows = [{"site": s, "gib": b / 2**30, "blocks": counts[s]} for s, b in groups.most_common(40)]
    print(f"peak of the traced allocations: {peak / 2**30:.2f} GiB (max_memory_allocated "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB)")
    for r in rows:
        print(f"{r['gib']:7.3f} GiB {r['blocks']:5d}  {r['site']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"peak_gib": peak / 2**30, "sites": rows}, indent=1))


def where(frames: list[dict]) -> str:
    """The innermost frames in entrenar's code (else torch's Python), as file:line function."""
    mine = [f for f in frames if "entrenar" in f.get("filename", "")]
    chosen = mine[:2] or [f for f in frames if f.get("filename", "").endswith(".py")][:2]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in chosen) or "?"


if __name__ == "__main__":
    main()
