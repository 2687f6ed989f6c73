"""Tasks: what a batch means and how it is scored. The one Trainer takes a task (:mod:`entrenar.tasks.base`).

``for_recipe(recipe)`` gives :class:`~entrenar.tasks.causal_lm.CausalLMTask` (next-token loss, the default),
:class:`~entrenar.tasks.classification.ClassificationTask` (``task.type: classification``: a head on the
decoder, CE / BCE / MSE, a report at the end) or :class:`~entrenar.tasks.preference.PreferenceTask`
(``task.type: preference``: DPO, IPO, SimPO, ORPO, KTO) or :class:`~entrenar.tasks.rl.grpo_task.GRPOTask`
(``task.type: grpo``: online RL with reward functions). ``layout_of(task.type)`` is what that task tells the run
plan about its batches (:class:`~entrenar.tasks.layout.TaskLayout`), known before any task is built.
"""

from __future__ import annotations

from entrenar.config import Recipe
from entrenar.tasks.base import FixedLayout, Task
from entrenar.tasks.causal_lm import CausalLMTask
from entrenar.tasks.classification import ClassificationTask
from entrenar.tasks.layout import Rollout, TaskLayout
from entrenar.tasks.preference import PreferenceTask
from entrenar.tasks.rl.grpo_task import GRPOTask


def for_recipe(recipe: Recipe, kernels: bool = False) -> Task:
    """The task of a recipe's ``task`` section; ``kernels``: the plan's (the fused loss)."""
    if recipe.task.type == "classification":
        return ClassificationTask(recipe)
    if recipe.task.type == "preference":
        return PreferenceTask(recipe)
    if recipe.task.type == "grpo":
        return GRPOTask(recipe)
    return CausalLMTask(recipe, kernels=kernels)


# Each task.type's layout, as its task class declares it.
LAYOUTS: dict[str, TaskLayout] = {task.name: task.layout for task in (CausalLMTask, ClassificationTask,
                                                                      PreferenceTask, GRPOTask)}


def layout_of(task_type: str) -> TaskLayout:
    """What the task of ``task.type`` tells the run plan about its batches (the recipe checked the name)."""
    return LAYOUTS[task_type]


__all__ = ["LAYOUTS", "FixedLayout", "Rollout", "Task", "TaskLayout", "for_recipe", "layout_of"]
