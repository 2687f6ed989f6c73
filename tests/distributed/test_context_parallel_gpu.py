"""Context parallelism on 2 to 4 GPUs (NCCL), in bf16 through FlashAttention's variable-length kernel, against the
whole row on one GPU (skipped with fewer than 2 GPUs). Not run on the CPU-only machine it was written on;
tests/distributed/test_context_parallel.py covers the same code on gloo in fp32. Run on a multi-GPU host:

    PYTHONPATH=src python -m pytest -q tests/distributed/test_context_parallel_gpu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from cp_workers import grads_worker  # noqa: E402

from entrenar.distributed.launch import launch_function  # noqa: E402

pytestmark = [pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more CUDA devices"),
              pytest.mark.timeout(300)]

LLAMA = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
             model_type="llama")


def test_a_row_split_over_the_gpus_has_the_gradients_of_the_whole_row_in_bf16():
    nproc = 4 if torch.cuda.device_count() >= 4 else 2
    runs = [(LLAMA, False), ({**LLAMA, "sliding_window": 4}, True)]
    # Spawned, not forked: a process that touched CUDA cannot fork workers that use it.
    ranks = launch_function(grads_worker, (runs, "cuda", "bfloat16"), start_method="spawn", shutdown_timeout=5,
                            nproc_per_node=nproc)
    for got in ranks[0]:
        assert got["local_tokens"] == -(-25 // nproc) and got["split_targets"] == got["targets"]
        assert got["split_loss"] == pytest.approx(got["loss"], rel=2e-2)
        for name, expected in got["one"].items():
            # bf16 products over other tilings of the rows: each tensor compared as a whole.
            error = (got["split"][name] - expected).norm() / expected.norm().clamp(min=1e-12)
            assert error < 3e-2, (name, float(error))
