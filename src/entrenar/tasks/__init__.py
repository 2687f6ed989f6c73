"""Tasks: what a batch means and how it is scored. The one training loop takes a task.

``for_recipe(recipe)`` gives :class:`~entrenar.tasks.causal_lm.CausalLMTask`
(next-token loss, the default) or
:class:`~entrenar.tasks.classification.ClassificationTask` (``task.type:
classification``: a head on the decoder, CE / BCE / MSE, a report at the end).
"""

from __future__ import annotations

from typing import Any


def for_recipe(recipe: Any) -> Any:
    """The task object of a recipe's ``task`` section."""
    if recipe.task.type == "classification":
        # TEMPORARY: the old train/loop.py's call forms; ClassificationTask (the protocol) once the Trainer lands.
        from entrenar.tasks.classification.legacy import LoopClassificationTask

        return LoopClassificationTask(recipe)
    from entrenar.tasks.causal_lm import CausalLMTask

    return CausalLMTask(recipe)


__all__ = ["for_recipe"]
