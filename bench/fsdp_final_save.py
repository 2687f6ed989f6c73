"""The final save of an FSDP full fine-tune: `entrenar train --nproc-per-node N` with `training.parallel: fsdp` on
a random Llama-shaped folder (bench/fsdp_startup.py builds it), each rank's save timed and its peak resident memory
read (VmHWM reset as the save starts, read as it ends: the save's own peak, and its growth over the resident size
it started at).

    PYTHONPATH=src python bench/fsdp_final_save.py --layers 8 --hidden 1024 --intermediate 2816 --vocab 32768
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fsdp_startup import make_folder, make_text, recipe  # noqa: E402

PROBE = '''
import json, os, re, time
def _hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
def _rss():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
try:
    from entrenar.train import trainer as _t
    _orig = _t.Trainer._save_result
    def _save_result(self, folder):
        start_rss = _rss()
        open("/proc/self/clear_refs", "w").write("5")
        t0 = time.time()
        out = _orig(self, folder)
        row = {"rank": int(os.environ.get("RANK", 0)), "save_s": round(time.time() - t0, 2),
               "rss_at_start": start_rss, "peak": _hwm()}
        with open(os.path.join(os.environ["ENTRENAR_SAVE_PROBE"], f"rank-{row['rank']}.json"), "w") as f:
            json.dump(row, f)
        return out
    _t.Trainer._save_result = _save_result
except ImportError:
    pass
'''


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 8), ("hidden", 1024), ("intermediate", 2816), ("heads", 16), ("kv-heads", 8),
                          ("vocab", 32768), ("nproc", 2), ("steps", 1), ("batch", 1), ("seq", 32)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--work", type=Path, default=Path("/tmp/fsdp_final_save"))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    folder = make_folder(args.work / f"l{args.layers}-h{args.hidden}-i{args.intermediate}-v{args.vocab}", args)
    text = make_text(args.work / "text.jsonl", 400)
    run_dir = args.work / "run"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    recipe_path = args.work / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(folder, text, run_dir, args), sort_keys=False))
    with tempfile.TemporaryDirectory(prefix="fsdp-save-") as tmp:
        site, records = Path(tmp) / "site", Path(tmp) / "rows"
        site.mkdir()
        records.mkdir()
        (site / "sitecustomize.py").write_text(PROBE)
        env = dict(os.environ, ENTRENAR_SAVE_PROBE=str(records),
                   PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "entrenar.cli.main", "train", str(recipe_path), "--nproc-per-node",
               str(args.nproc), "--no-progress"]
        launched = time.time()
        code = subprocess.run(cmd, env=env).returncode
        rows = [json.loads(p.read_text()) for p in sorted(records.glob("rank-*.json"))]
    from entrenar.models.hf import read_config

    print(f"exit {code}, {time.time() - launched:.1f} s, {read_config(folder).num_parameters:,} parameters")
    for r in rows:
        print(f"rank {r['rank']}: save {r['save_s']:.2f} s, peak RSS {r['peak'] / 2**30:.2f} GiB "
              f"(+{(r['peak'] - r['rss_at_start']) / 2**30:.2f} GiB over the {r['rss_at_start'] / 2**30:.2f} "
              "GiB at the save's start)")


if __name__ == "__main__":
    main()
