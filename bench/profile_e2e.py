"""Where a step of `entrenar train` goes: the loop run in-process under torch.profiler on a bench_e2e case.

Prints, over the profiled steps, the wall time per step against the GPU's busy time per step (kernels only:
the gap is host time the GPU waited for), the top CUDA kernels, and the top host-side operators. Use it
before changing the loop for speed (measure, don't guess).

    PYTHONPATH=src:bench python bench/profile_e2e.py --case lora-1b --steps 12 [--set KEY=VALUE ...]
    PYTHONPATH=src:bench python bench/profile_e2e.py --recipe /tmp/dpo/qlora-8b-dpo.yaml --steps 10  # any recipe
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import yaml


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="lora-1b")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--fast", action="store_true", help="the case's documented fast settings")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--text", default=".e2e/text.jsonl")
    p.add_argument("--tokenizer", default=".e2e")
    p.add_argument("--work", default="/tmp/e2e")
    p.add_argument("--active", type=int, default=4, help="steps profiled, the last ones of the run")
    p.add_argument("--trace", default="", help="write a Chrome trace here")
    p.add_argument("--recipe", default="", help="profile this recipe (e.g. bench_dpo.py's) instead of --case's; "
                                               "its training.max_steps is set to --steps")
    args = p.parse_args(argv)

    from bench_e2e import CASES, case_folder, make_model_folder, recipe_for
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    from entrenar.config import load_recipe
    from entrenar.train.loop import train

    work = Path(args.work)
    if args.recipe:
        recipe_path = Path(args.recipe)
        run_dir = Path(yaml.safe_load(recipe_path.read_text())["output"]["dir"])
        sets = [f"training.max_steps={args.steps}", *args.set]
    else:
        case = dict(CASES[args.case], steps=args.steps)
        vocab = json.loads((Path(args.tokenizer) / "tokenizer.json").read_text())["model"]["vocab"]
        folder = make_model_folder(case["shape"], 49152 if len(vocab) <= 49152 else len(vocab), case["seq"],
                                   Path(args.tokenizer), case_folder(case, work, False),
                                   weights=case.get("weights", "bf16"))
        run_dir = work / f"profile-{args.case}"
        recipe_path = work / f"profile-{args.case}.yaml"
        recipe_path.write_text(yaml.safe_dump(recipe_for(case, folder, Path(args.text), run_dir, args.fast)))
        sets = list(args.set)
    recipe = load_recipe(recipe_path, sets)
    shutil.rmtree(run_dir, ignore_errors=True)
    # Profile steady-state steps only: the window is moved by a hook after every optimizer step.
    wait = max(args.steps - args.active - 1, 1)
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=wait, warmup=1, active=args.active, repeat=1)) as prof:
        hook = register_optimizer_step_post_hook(lambda *_: prof.step())
        try:
            train(recipe, progress=False)
        finally:
            hook.remove()
    wall = time.perf_counter() - started
    if args.trace:
        prof.export_chrome_trace(args.trace)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    step_ms = [r["tokens"] / r["tokens_per_s"] * 1e3 for r in rows if "loss" in r and r.get("tokens")][-args.active:]
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e3 / args.active
    print(f"whole run {wall:.1f}s; profiled steps (wall ms, under the profiler): {[round(x, 1) for x in step_ms]}; "
          f"GPU kernel time per profiled step {gpu_ms:.1f} ms")
    print(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    print(gap_report(prof.events(), args.active))


def gap_report(events, steps: int, attribute_over_us: float = 100.0) -> str:
    """Where the GPU sat idle in the profiled window: idle time by gap length, and for the gaps longer than
    ``attribute_over_us`` what the host was running meanwhile (top-level operators; "(python)" for time no
    operator covers: the loop's own Python, batch building, logging)."""
    # Device activity only: the profiler's step and optimizer ranges are also CUDA-typed (annotations).
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
                     and not e.name.startswith(("ProfilerStep", "Optimizer.")))
    if not kernels:
        return "no GPU activity recorded"
    busy = [list(kernels[0])]
    for start, end in kernels[1:]:
        if start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:])]
    buckets = {"<5us": 0.0, "5-50us": 0.0, "50us-1ms": 0.0, ">=1ms": 0.0}
    for start, end in gaps:
        d = end - start
        key = "<5us" if d < 5 else "5-50us" if d < 50 else "50us-1ms" if d < 1000 else ">=1ms"
        buckets[key] += d
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(e - s for s, e in busy)
    top_level = [e for e in events if e.device_type.name == "CPU" and e.cpu_parent is None
                 and not e.name.startswith("ProfilerStep")]
    blamed: dict[str, float] = {}
    for start, end in gaps:
        if end - start < attribute_over_us:
            continue
        covered = 0.0
        for e in top_level:
            overlap = min(end, e.time_range.end) - max(start, e.time_range.start)
            if overlap > 0:
                blamed[e.name] = blamed.get(e.name, 0.0) + overlap
                covered += overlap
        blamed["(python)"] = blamed.get("(python)", 0.0) + max(end - start - covered, 0.0)
    lines = [f"GPU busy {busy_us / 1e3 / steps:.1f} ms per step of a {span / 1e3 / steps:.1f} ms span; idle per "
             "step by gap length: " + ", ".join(f"{k} {v / 1e3 / steps:.2f} ms" for k, v in buckets.items()),
             f"host work during idle gaps >= {attribute_over_us:g} us (ms per step):"]
    for name, us in sorted(blamed.items(), key=lambda kv: -kv[1])[:20]:
        lines.append(f"  {us / 1e3 / steps:8.2f}  {name[:90]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
