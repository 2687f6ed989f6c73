#!/usr/bin/env bash
# One call on the GPU machine: the GPU and loop tests, then a 1-process NCCL run of the quickstart through
# `entrenar train --nproc-per-node 1` (DDP forced). Wheels of packages the image lacks travel in .whl/.
# Usage (from the repository root): bash bench/device_tests.sh [pytest paths...]
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl/extra/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
paths=${*:-tests/kernels tests/models tests/quant tests/train tests/test_load.py tests/test_lora.py}
timeout ${PYTEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -rfE $paths 2>&1 | tee "$OUT/pytest-gpu.log" | tail -25
(cd /tmp && timeout 150 python3 -m entrenar.cli.main train --nproc-per-node 1 --no-progress \
  --set output.dir=/tmp/qs-nccl --set training.max_steps=40 --set training.parallel=ddp \
  --set training.replica_check_every=10 --set model.device=cuda 2>&1 | tail -20) | tee "$OUT/nccl.log"
grep -c '"step"' /tmp/qs-nccl/metrics.jsonl; tail -1 /tmp/qs-nccl/metrics.jsonl | tee -a "$OUT/nccl.log"
