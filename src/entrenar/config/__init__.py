"""The run recipe: a YAML file <-> typed dataclasses, plus ``--set`` overrides.

A recipe has ten sections (model, data, lora, qat, optimizer, schedule, training, output, task, moe). Each is a
frozen dataclass whose fields carry a default and a rule; the rules run whenever a section is built, so a
``Recipe`` in hand is valid. Errors name the file, the line, the dotted key and what is allowed.

The package, one idea a module: ``rules`` (what a value may be, and the wording of what went wrong),
``sections`` (the dataclasses), ``yaml_source`` (YAML with the line of every key; merge configs use it too),
``overrides`` (``--set``), ``recipe`` (the whole recipe: load, save, compare), ``catalog`` (the bundled recipes).

``recipes/lora-llama.yaml`` documents every key with a comment.
"""

from __future__ import annotations

from entrenar.config.recipe import (
    QUICKSTART,
    RESUMABLE_KEYS,
    Recipe,
    load_recipe,
    recipe_changes,
    save_recipe,
)
from entrenar.config.rules import DEVICE_NAMES, Reject, is_device_name
from entrenar.config.sections import (
    MAX_SEQ_LEN,
    DataSection,
    LoraSection,
    ModelSection,
    MoeSection,
    OptimizerSection,
    OutputSection,
    QatSection,
    RewardSection,
    ScheduleSection,
    TaskSection,
    TrainingSection,
    setting,
)
from entrenar.config.yaml_source import Where, key_lines, load_yaml, read_yaml_text

__all__ = [
    "DEVICE_NAMES",
    "MAX_SEQ_LEN",
    "QUICKSTART",
    "RESUMABLE_KEYS",
    "DataSection",
    "LoraSection",
    "ModelSection",
    "MoeSection",
    "OptimizerSection",
    "OutputSection",
    "QatSection",
    "Recipe",
    "Reject",
    "ScheduleSection",
    "RewardSection",
    "TaskSection",
    "TrainingSection",
    "Where",
    "is_device_name",
    "key_lines",
    "load_recipe",
    "load_yaml",
    "read_yaml_text",
    "recipe_changes",
    "save_recipe",
    "setting",
]
