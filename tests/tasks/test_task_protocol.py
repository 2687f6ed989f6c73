"""The Task protocol's optional capability (tasks/base.py): every task declares ``fixed_layout``, None where it
lays its rows out as rows, so the Trainer and the micro-step read it instead of probing the task's attributes."""

from __future__ import annotations

import pytest
import torch

from entrenar.config import Recipe
from entrenar.config.sections import RewardSection, TaskSection
from entrenar.distributed.parallelize import Single
from entrenar.tasks import LAYOUTS, for_recipe
from entrenar.tasks.causal_lm import CausalLMTask
from entrenar.train.stepping import MicroStep


def _task(task_type: str):
    reward = RewardSection(functions=("length",), target_length=8) if task_type == "grpo" else RewardSection()
    return for_recipe(Recipe(task=TaskSection(type=task_type), reward=reward))


@pytest.mark.parametrize("task_type", sorted(LAYOUTS))
def test_every_task_declares_its_fixed_layout_as_its_plan_layout_says(task_type):
    """A task has its own fixed layout exactly where its TaskLayout tells the plan so (own_graph_layout): the plan
    turns CUDA graphs on for it, and the Trainer then steps the layout the task gives."""
    task = _task(task_type)
    assert (task.fixed_layout is not None) == (LAYOUTS[task_type].own_graph_layout is not None)
    if task.fixed_layout is not None:
        for method in ("graph_layout", "micro_stats", "add_micro_stats"):
            assert callable(getattr(task.fixed_layout, method))


class _LossWithStats(CausalLMTask):
    """A causal-LM task that happens to have methods named as a fixed layout's, without declaring one."""

    weight = torch.nn.Parameter(torch.ones(()))

    def loss_sum(self, model, batch):
        return self.weight * 3.0

    def micro_stats(self):
        raise AssertionError("read although the task declares no fixed layout")

    def add_micro_stats(self, stats):
        raise AssertionError("called although the task declares no fixed layout")


def test_micro_step_reads_the_declared_capability_not_the_task_attributes():
    """The micro-step hands back the loss alone for a task without a fixed layout, whatever methods it has."""
    model = torch.nn.Linear(2, 1)
    task = _LossWithStats(Recipe())
    step = MicroStep(task, Single(model), None, torch.device("cpu"), "fp32",
                     torch.amp.GradScaler("cpu", enabled=False), [task.weight], graphs=False)
    out = step({"step_targets": torch.tensor(3.0)})
    assert out.ndim == 0 and float(out) == 1.0
