#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests, then bench_train.py; logs and JSON go to $OUT.
# Usage (from the repository root): bash bench/device_run.sh "<bench_train.py arguments>" [pytest seconds]
# TESTS (default tests/kernels) names the test paths to run first.
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" | tee -a "$OUT/gpu.txt"
if [ "${2:-120}" != 0 ]; then
  timeout "${2:-120}" python3 -m pytest ${TESTS:-tests/kernels} -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
eval "python3 bench/bench_train.py --out $OUT/bench.json $1" 2>&1 | tee "$OUT/bench.log" | grep -v Warning
