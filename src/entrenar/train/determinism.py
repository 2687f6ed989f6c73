"""``training.deterministic``: a GPU run whose reruns and resumes give the same bits.

A CPU run already does. On CUDA, some kernels accumulate in whatever order their thread blocks finish
(FlashAttention's backward adds each query block's gradient with atomics; cuBLAS may pick a split-K reduction),
so two identical runs drift apart in the last bits from the first step. PyTorch's deterministic mode makes
each op take an order-fixed algorithm (FlashAttention then splits ``dq`` and sums the splits in order) or
refuse to run; cuBLAS needs a fixed workspace configuration for the same. entrenar's own Triton kernels use no
atomics and no autotuning, so they are deterministic either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from entrenar.errors import ConfigError

# cuBLAS: a fixed workspace per stream, so a product's reduction order does not depend on what ran before.
CUBLAS_WORKSPACE = ":4096:8"
_NONDETERMINISTIC = "does not have a deterministic implementation"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool) -> Iterator[None]:
    """Run the body with PyTorch's deterministic algorithms on (when ``enabled``), and put the caller's setting
    back after. An op with no deterministic version becomes a ConfigError naming it."""
    if not enabled:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # read by PyTorch when a product runs
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
