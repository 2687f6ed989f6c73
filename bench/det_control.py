"""Two identical bf16 LoRA runs on the GPU with and without training.deterministic: do their bits differ?"""
import sys, tempfile, pathlib, torch
sys.path[:0] = ["tests", "tests/train"]
from conftest import make_workspace
from test_deterministic_gpu import long_documents, records, adapters, same
from test_loop import recipe_for
from entrenar.train.loop import train
for flag in ("false", "true"):
    ws = make_workspace(pathlib.Path(tempfile.mkdtemp()))
    common = long_documents(ws)
    runs = [train(recipe_for(ws, *common, f"training.deterministic={flag}", f"output.dir={ws / n}"), progress=False) for n in "ab"]
    ra, rb = records(runs[0].run_dir), records(runs[1].run_dir)
    first = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), None)
    print(f"deterministic={flag}: metrics equal {ra == rb} (first differing step {first}), adapters equal {same(adapters(runs[0]), adapters(runs[1]))}", flush=True)
