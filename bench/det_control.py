"""Two identical bf16 LoRA runs on a GPU, without and with `training.deterministic`: do their bits differ?

The runs are the GPU test's (tests/train/test_deterministic_gpu.py): a small Llama-shaped model with head size 64
on ~900-token documents, packed rows through FlashAttention's varlen kernel, CUDA graphs and overlapped steps.

    PYTHONPATH=src:bench python3 bench/det_control.py --out det.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

sys.path[:0] = ["tests", "tests/train"]  # the GPU test's workspace and recipe, so both measure the same runs


def main() -> None:
    from test_deterministic_gpu import adapters, long_documents, records, same
    from test_loop import recipe_for

    from conftest import make_workspace
    from entrenar.train.loop import train

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    args = p.parse_args()
    results = []
    for flag in ("false", "true"):
        ws = make_workspace(pathlib.Path(tempfile.mkdtemp()))
        common = long_documents(ws)
        runs = [train(recipe_for(ws, *common, f"training.deterministic={flag}", f"output.dir={ws / name}"),
                      progress=False) for name in ("a", "b")]
        a, b = records(runs[0].run_dir), records(runs[1].run_dir)
        first = next((x[0] for x, y in zip(a, b) if x != y), None)  # the logged step number
        result = {"deterministic": flag == "true", "metrics_equal": a == b, "first_differing_step": first,
                  "adapters_equal": same(adapters(runs[0]), adapters(runs[1])), "run_a": a, "run_b": b}
        results.append(result)
        print(f"deterministic={flag}: metrics equal {a == b} (first differing step {first}), "
              f"adapters equal {result['adapters_equal']}", flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
