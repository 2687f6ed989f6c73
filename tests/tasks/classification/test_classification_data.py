"""Class weights are counted on the rows trained on."""

from __future__ import annotations

from classification_workspace import recipe_for

from entrenar import tasks
from entrenar.tasks.classification.data import class_weights
from entrenar.train.run_data import read_data


def test_class_weights_count_only_the_rows_trained_on(workspace):
    """The validation split is taken out before the weights are counted (they were counted on every row)."""
    recipe = recipe_for(workspace, "task.class_weights=inverse_freq")
    task = tasks.for_recipe(recipe)
    _, tokenizer = task.load(dtype="float32", device="cpu", quantize=None)
    data = read_data(recipe, task, tokenizer)
    assert task.weights == class_weights("inverse_freq", data.examples, 2)
    assert task.weights != class_weights("inverse_freq", data.examples + data.validation, 2)
    assert any(note.startswith("class weights: ") for note in data.notes)
