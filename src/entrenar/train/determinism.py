"""``training.deterministic``: a GPU run whose reruns and resumes give the same bits.

A CPU run already does. On CUDA, some kernels accumulate in whatever order their thread blocks finish
(FlashAttention's backward adds each query block's gradient with atomics; cuBLAS may pick a split-K reduction),
so two identical runs drift apart in the last bits from the first step. PyTorch's deterministic mode makes
each op take an order-fixed algorithm (FlashAttention then splits ``dq`` and sums the splits in order) or
refuse to run; cuBLAS needs a fixed workspace configuration for the same. entrenar's own Triton kernels use no
atomics and no autotuning, so they are deterministic either way. PyTorch's mode also fills every new
uninitialised tensor (NaN for floats), so nothing can read leftover memory; with the attention's ordered
reduction, this is what the mode costs (7% on the LoRA-1B bench, docs/TRAINING.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from entrenar.errors import ConfigError

# cuBLAS: a fixed workspace per stream, so a product's reduction order does not depend on what ran before.
CUBLAS_WORKSPACE = ":4096:8"
_CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the values PyTorch accepts for deterministic products
_NONDETERMINISTIC = "does not have a deterministic implementation"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Run the body with PyTorch's deterministic algorithms on (when ``enabled``), and put the caller's setting
    back after. An op with no deterministic version becomes a ConfigError naming it."""
    if not enabled:
        yield
        return
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace is not None and workspace not in _CUBLAS_DETERMINISTIC:
        raise ConfigError(f"training.deterministic: CUBLAS_WORKSPACE_CONFIG={workspace} in the environment is not "
                          f"one cuBLAS products are deterministic with; unset it or set it to {CUBLAS_WORKSPACE}")
    # PyTorch sizes cuBLAS's workspace from this once per process, and checks it is set before every product
    # under deterministic algorithms; it is taken back after the run.
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace or CUBLAS_WORKSPACE
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    except RuntimeError as error:
        if _NONDETERMINISTIC not in str(error):
            raise
        op = str(error).split(_NONDETERMINISTIC)[0].strip().rstrip(",")
        raise ConfigError(f"training.deterministic: {op} has no deterministic implementation on this device; "
                          "turn training.deterministic off for this run") from None
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
