"""Model merging: mergekit's YAML, streamed tensor by tensor (``entrenar merge``).

    from entrenar.merge import merge
    plan = merge("merge.yaml", "out/merged")               # a Hugging Face folder
    print(merge("merge.yaml", "out/x", dry_run=True).summary())

Modules: ``config`` (the YAML), ``plan`` (output tensors and their sources),
``methods`` (the formulas, pure functions on tensors), ``stream`` (lazy reads,
sharded writes), ``tokens`` (vocabularies), ``adapters`` (merging LoRA adapters
into one adapter), ``run`` (the merge loop).
"""

from __future__ import annotations

from entrenar.merge.config import MergeConfig, load_config
from entrenar.merge.run import merge, plan_merge

__all__ = ["MergeConfig", "load_config", "merge", "plan_merge"]
