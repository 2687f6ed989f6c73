#!/usr/bin/env bash
# DDP scaling of `entrenar train` on one host (issue 20): the bench_e2e LoRA case given as $1 (default lora-1b),
# trained through `entrenar train --nproc-per-node N` for each N in $2 (default "1 2"), DDP forced (N=1 is the
# same code path), replica check every 10 steps. Prints tokens/s of the job and per GPU, scaling efficiency
# against N=1, and each rank's peak memory. Usage (repository root, wheels in .whl/):
#   bash bench/ddp_scaling.sh lora-1b "1 2 4"
set -o pipefail
CASE=${1:-lora-1b}; COUNTS=${2:-"1 2"}; STEPS=${STEPS:-30}; W=${WORK:-/tmp/ddp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$W"
python3 - "$CASE" "$W" "$STEPS" <<'PY'
import json, sys, yaml
from pathlib import Path
from bench_e2e import CASES, make_model_folder, recipe_for
case_name, work, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
case = dict(CASES[case_name], steps=steps)
vocab = len(json.loads(Path(".e2e/tokenizer.json").read_text())["model"]["vocab"])
folder = make_model_folder(case["shape"], max(vocab, 49152), case["seq"], Path(".e2e"), work / case["shape"])
(work / "recipe.yaml").write_text(yaml.safe_dump(recipe_for(case, folder, Path(".e2e/text.jsonl"), work / "run", False)))
PY
for n in $COUNTS; do
  timeout 300 python3 -m entrenar.cli.main train "$W/recipe.yaml" --nproc-per-node "$n" --no-progress \
    --set training.parallel=ddp --set training.replica_check_every=10 --set output.dir="$W/run-$n" 2>&1 | tail -3
done
python3 - "$W" $COUNTS <<'PY'
import json, statistics, sys
from pathlib import Path
work, counts = Path(sys.argv[1]), [int(n) for n in sys.argv[2:]]
base = None
for n in counts:
    rows = [json.loads(l) for l in (work / f"run-{n}" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    tps = statistics.median(r["tokens_per_s"] for r in rows[5:])
    base = base or tps
    peaks = rows[-1].get("peak_mem_gb_ranks") or [rows[-1].get("peak_mem_gb")]
    print(json.dumps({"gpus": n, "steps": len(rows), "tokens_per_s": round(tps), "per_gpu": round(tps / n),
                      "efficiency": round(tps / (base * n), 3), "peak_gb_ranks": peaks,
                      "loss_first_last": [rows[0]["loss"], rows[-1]["loss"]]}))
PY
