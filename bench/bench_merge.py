"""Merge two random Llama-shaped checkpoints with entrenar (and mergekit, when given) and report time and peak RSS.

    python bench/bench_merge.py                        # two ~1.1B-parameter checkpoints (TinyLlama's shape)
    python bench/bench_merge.py --layers 4             # smaller: same widths, 4 layers (~0.3B)
    python bench/bench_merge.py --mergekit /tmp/mk/bin/mergekit-yaml   # side by side with mergekit
    python bench/bench_merge.py --mergekit /tmp/mk/bin/mergekit-yaml --repeat 3 --threads 1

Each merge runs in its own process; its wall time, CPU time (user + system) and
peak resident memory (``ru_maxrss`` of that child, from ``os.wait4``) are
measured from outside, so both tools are measured the same way. With
``--repeat N`` the tools alternate (entrenar, mergekit, entrenar, mergekit, ...)
so a change in the machine's load falls on both, and the medians and their ratios
(entrenar / mergekit) are reported. Methods: linear, ties, dare_ties, bf16 in and
out. Prints a table and writes bench/results/merge.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def write_checkpoint(folder: Path, seed: int, layers: int, hidden: int, inter: int, vocab: int, kv: int) -> int:
    """A random bf16 Llama checkpoint, sharded at ~2 GB like a hub model; returns its parameter count."""
    folder.mkdir(parents=True)
    heads = hidden // 64
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=hidden, intermediate_size=inter,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                  tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=2048, torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv * 64, hidden),
                   p + "self_attn.v_proj.weight": (kv * 64, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    g = torch.Generator().manual_seed(seed)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        current[name] = shape
        size += 2 * torch.Size(shape).numel()
        if size > 2e9:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map, params = {}, 0
    for k, shard in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shard.items()}
        params += sum(t.numel() for t in tensors.values())
        save_file(tensors, str(folder / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return params


def config_for(method: str, a: Path, b: Path) -> dict:
    if method == "linear":
        return {"merge_method": "linear", "dtype": "bfloat16",
                "models": [{"model": str(a), "parameters": {"weight": 0.5}},
                           {"model": str(b), "parameters": {"weight": 0.5}}]}
    return {"merge_method": method, "base_model": str(a), "dtype": "bfloat16",
            "models": [{"model": str(b), "parameters": {"weight": 1.0, "density": 0.5}}]}


def measure(cmd: list[str], env: dict[str, str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{cmd[0]} failed:\n{err[-3000:]}")
    # CPU time (user + system) is the fairer speed measure on a shared machine: wall time includes waiting for cores.
    return {"seconds": round(seconds, 2), "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
            "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--methods", default="linear,ties,dare_ties")
    parser.add_argument("--mergekit", default=None, metavar="PATH", help="mergekit-yaml executable to compare with")
    parser.add_argument("--threads", type=int, default=None, help="OMP/torch threads for both tools (default: all)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each tool per method, alternating (medians reported)")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp folder)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "merge.json"))
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_merge."))
    a, b = work / "a", work / "b"
    if not a.exists():
        write_checkpoint(a, 0, args.layers, args.hidden, args.intermediate, args.vocab, args.kv_heads)
        write_checkpoint(b, 1, args.layers, args.hidden, args.intermediate, args.vocab, args.kv_heads)
    params = _count(a)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    rows, summary = [], []
    for method in args.methods.split(","):
        cfg = work / f"{method}.yml"
        cfg.write_text(json.dumps(config_for(method, a, b)))  # JSON is YAML
        tools = [("entrenar", work / f"out-entrenar-{method}",
                  [sys.executable, "-m", "entrenar.cli.main", "merge", str(cfg),
                   "--output", str(work / f"out-entrenar-{method}"), "--quiet", "--seed", "0"])]
        if args.mergekit:
            tools.append(("mergekit", work / f"out-mergekit-{method}",
                          [args.mergekit, str(cfg), str(work / f"out-mergekit-{method}"), "--no-copy-tokenizer",
                           "--random-seed", "0"]))
        for run in range(args.repeat):
            for tool, out, cmd in tools:
                shutil.rmtree(out, ignore_errors=True)  # each run writes a fresh folder
                result = measure(cmd, env)
                rows.append({"method": method, "tool": tool, "run": run, **result})
                print(f"{method:10s} {tool:9s} run {run}  wall {result['seconds']:7.1f} s  "
                      f"CPU {result['cpu_seconds']:7.1f} s  "
                      f"peak RSS {result['peak_rss_gib']:.2f} GiB", flush=True)
        medians = {tool: {key: statistics.median(r[key] for r in rows if r["method"] == method and r["tool"] == tool)
                          for key in ("seconds", "cpu_seconds", "peak_rss_gib")} for tool, _, _ in tools}
        line = {"method": method, "median": medians}
        if args.mergekit:
            line["ratio_entrenar_over_mergekit"] = {
                key: round(medians["entrenar"][key] / medians["mergekit"][key], 3) for key in medians["entrenar"]}
        summary.append(line)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or platform.platform()}",
        "command": " ".join(sys.argv),
        "params_per_checkpoint": params,
        "checkpoint_gib": round(2 * params / 2**30, 2),
        "threads": args.threads,
        "repeat": args.repeat,
        "results": rows,
        "summary": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def _count(folder: Path) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from entrenar.merge.stream import HFInput

    model = HFInput(folder, str(folder))
    return sum(torch.Size(i.shape).numel() for i in model.tensors().values())


if __name__ == "__main__":
    main()
