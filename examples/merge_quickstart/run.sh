#!/usr/bin/env bash
# Two LoRA fine-tunes of the quickstart model, merged three ways, with held-out loss of each.
#
#   bash examples/merge_quickstart/run.sh [WORKDIR] [SEED]     (a few minutes on an idle 2-core CPU)
#
# SEED (default 0) seeds the quickstart: its random base model, its train/held-out split and its training; the
# adapters train with seeds SEED+1 and SEED+2. On one machine and version the output is the same run after run.
#
# 1. base: the quickstart (a tiny random Llama learning two-digit addition), trained briefly;
# 2. two LoRA adapters on that base, one trained on sums whose first number is < 50, one on the rest
#    (different seeds and learning rates);
# 3. merges: the adapters averaged into one adapter (linear), and the models base+adapter merged with
#    task_arithmetic (weights 1 and 0.5) and with ties (inputs `base+adapter`: nothing merged is written but the result);
# 4. held-out loss (answer tokens) of each on the quickstart's validation sums.
set -euo pipefail
W=${1:-runs/merge-example}
SEED=${2:-0}
mkdir -p "$W"
entrenar train --set output.dir="$W/base" --set training.max_steps=300 --set training.eval_every=0 \
    --set training.save_every=0 --set training.seed="$SEED" > "$W/base.log"
BASE="$W/base/model"
DATA="$W/base/quickstart"
python - "$DATA" <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
rows = [json.loads(l) for l in (d / "train.jsonl").read_text().splitlines()]
for name, keep in (("low", lambda a: a < 50), ("high", lambda a: a >= 50)):
    with open(d / f"train-{name}.jsonl", "w") as f:
        for r in rows:
            if keep(int(r["prompt"].split("+")[0])):
                f.write(json.dumps(r) + "\n")
PY
for spec in "low $((SEED + 1)) 3e-3" "high $((SEED + 2)) 2e-3"; do
    set -- $spec
    entrenar train --set model.path="$BASE" --set data.train="$DATA/train-$1.jsonl" \
        --set data.validation="$DATA/validation.jsonl" --set lora.r=8 --set lora.alpha=16 \
        --set lora.target_modules=all-linear --set training.seed="$2" --set optimizer.lr="$3" \
        --set training.max_steps=200 --set training.eval_every=0 --set training.save_every=0 \
        --set schedule.warmup_steps=10 --set output.dir="$W/lora-$1" > "$W/lora-$1.log"
done
cat > "$W/adapters.yaml" <<YAML
merge_method: linear
models:
  - {model: $W/lora-low/adapter, parameters: {weight: 1.0}}
  - {model: $W/lora-high/adapter, parameters: {weight: 1.0}}
YAML
for spec in "task_arithmetic 1.0" "task_arithmetic-half 0.5" "ties 1.0"; do
    set -- $spec
    extra=""; [ "$1" = ties ] && extra=", density: 0.5"
    cat > "$W/$1.yaml" <<YAML
merge_method: ${1%-half}
base_model: $BASE
models:
  - {model: $BASE+$W/lora-low/adapter, parameters: {weight: $2$extra}}
  - {model: $BASE+$W/lora-high/adapter, parameters: {weight: $2$extra}}
YAML
done
entrenar merge "$W/adapters.yaml" --output "$W/merged-adapter" --quiet
entrenar merge "$W/task_arithmetic.yaml" --output "$W/merged-task-arithmetic" --quiet
entrenar merge "$W/task_arithmetic-half.yaml" --output "$W/merged-task-arithmetic-half" --quiet
entrenar merge "$W/ties.yaml" --output "$W/merged-ties" --quiet
loss() { entrenar eval "$@" --data "$DATA/validation.jsonl" --train-on completion --seq-len 64 | awk '/^loss/ {print $2}'; }
echo "seed $SEED, $(date -u +%Y-%m-%d), $(uname -m) $(nproc) cores, torch $(python -c 'import torch; print(torch.__version__)')"
echo
echo "| model | held-out loss |"
echo "| --- | --- |"
echo "| base | $(loss "$BASE") |"
echo "| base + adapter (a < 50) | $(loss "$BASE" --adapter "$W/lora-low/adapter") |"
echo "| base + adapter (a >= 50) | $(loss "$BASE" --adapter "$W/lora-high/adapter") |"
echo "| base + merged adapter (linear, mean) | $(loss "$BASE" --adapter "$W/merged-adapter") |"
echo "| task_arithmetic, weights 1 + 1 (sum of both updates) | $(loss "$W/merged-task-arithmetic") |"
echo "| task_arithmetic, weights 0.5 + 0.5 | $(loss "$W/merged-task-arithmetic-half") |"
echo "| ties, weights 1 + 1, density 0.5 | $(loss "$W/merged-ties") |"
