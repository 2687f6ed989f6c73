"""A run's data from the recipe: files mixed by weight, epochs as steps, paths checked before the model loads."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest

from conftest import crash_after_step
from entrenar.config import Recipe, load_recipe
from entrenar.data import BatchStream
from entrenar.data.mix import mix, weighted
from entrenar.errors import ConfigError, DataError
from entrenar.train import loop
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics


def recipe_for(ws, data: str, *overrides):
    text = f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{{data}, seq_len: 32, train_on: completion}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
optimizer: {{lr: 1.0e-2}}
training: {{batch_size: 2, eval_every: 0, save_every: 4, log_every: 1}}
output: {{dir: {ws / 'run'}}}
"""
    path = ws / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path, list(overrides))


def alpaca_file(ws, count=10):
    path = ws / "alpaca.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"{a}*2", "output": str(2 * a)}) + "\n" for a in range(count)))
    return path


def losses(run_dir):
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def test_a_weight_repeats_whole_copies_and_a_seeded_share():
    items = list(range(10))
    twice_and_half = weighted(items, 2.5, seed=3, index=0)
    counts = Counter(twice_and_half)
    assert len(twice_and_half) == 25 and sorted(Counter(counts.values()).items()) == [(2, 5), (3, 5)]
    assert weighted(items, 2.5, seed=3, index=0) == twice_and_half  # deterministic
    assert weighted(items, 0.5, seed=4, index=0) != weighted(items, 0.5, seed=5, index=0)  # drawn by the seed
    assert mix([(items, 1.0), (["a", "b"], 2.0)], seed=0) == [*items, "a", "b", "a", "b"]


@pytest.mark.parametrize("data", [
    "train: MISSING",  # the single path
    "train: [TRAIN, {path: MISSING, weight: 2}]",  # an entry of a mix
    "train: TRAIN, validation: MISSING",
])
def test_a_missing_data_file_is_found_before_the_model_loads(workspace, monkeypatch, capsys, data):
    def slow_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the data paths were checked")

    monkeypatch.setattr(loop, "load_model", slow_load)
    monkeypatch.setattr(loop, "recipe_model_config", slow_load)
    missing = workspace / "nope.jsonl"
    text = data.replace("MISSING", str(missing)).replace("TRAIN", str(workspace / "train.jsonl"))
    key = {0: "data.train", 1: "data.train[1].path", 2: "data.validation"}[
        ["train: MISSING", "train: [TRAIN, {path: MISSING, weight: 2}]", "train: TRAIN, validation: MISSING"].index(
            data)]
    recipe = recipe_for(workspace, text)
    with pytest.raises(DataError, match=re.escape(f"{key}: no such file or folder: {missing}")):
        train(recipe, progress=False)

    from entrenar.cli.main import main

    assert main(["train", str(workspace / "recipe.yaml"), "--no-progress"]) == 2
    assert f"{key}: no such file or folder: {missing}" in capsys.readouterr().err


def test_epochs_and_max_steps_together_are_refused_naming_both(workspace):
    with pytest.raises(ConfigError, match=r"'training.epochs' \(2\) and 'training.max_steps' \(50\) are both set"):
        recipe_for(workspace, f"train: {workspace / 'train.jsonl'}", "training.epochs=2", "training.max_steps=50")
    assert Recipe().training.max_steps == 1000 and Recipe().training.epochs is None


def test_one_epoch_is_the_fewest_steps_that_pass_over_every_packed_example(workspace):
    recipe = recipe_for(workspace, f"train: {workspace / 'train.jsonl'}, validation_split: 0.25",
                        "training.epochs=1", "training.max_steps=null", "output.dir=" + str(workspace / "dry"))
    result = train(recipe, dry_run=True, progress=False)
    steps = int(re.search(r"epochs 1 = (\d+) steps", result.summary).group(1))
    # The stream the run trains on, read independently: after steps-1 steps the first pass is not done, after
    # `steps` it is.
    from entrenar import tasks
    from entrenar.train.run_data import read_data

    tokenizer = load_tokenizer(workspace)
    data = read_data(recipe, tasks.for_recipe(recipe), tokenizer)
    stream = BatchStream(data.examples, 1, 32, packing=True, shuffle=True, seed=0)
    stream.skip((steps - 1) * 2)
    assert stream.epoch == 0
    stream.skip(2)
    assert stream.epoch == 1
    assert "validation examples   10\n" in result.summary


def load_tokenizer(ws):
    from entrenar.data.tokenizer import Tokenizer

    return Tokenizer.from_folder(ws / "model")


def test_epochs_unpacked_count_examples_and_schedule_and_saves_stay_in_steps(workspace):
    recipe = recipe_for(workspace, f"train: {workspace / 'train.jsonl'}, packing: false", "training.epochs=0.5",
                        "training.max_steps=null", "schedule.warmup_steps=2")
    result = train(recipe, progress=False)
    steps = math.ceil(0.5 * 40 / 2)  # 40 examples, one a row, 2 rows a step
    assert result.steps == steps == 10
    records = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    from entrenar.train.optim import lr_at

    # The schedule of a 10-step run: warmup and cosine in steps.
    assert [r["lr"] for r in records] == pytest.approx([lr_at(s, 1e-2, 2, 10, "cosine", 0.1) for s in range(10)])
    assert {p.name for p in (result.run_dir / "checkpoints").glob("step-*")} == {"step-4", "step-8", "step-10"}


def test_a_mix_of_files_in_their_formats_with_epochs_resumes_bit_exactly(workspace, monkeypatch):
    alpaca = alpaca_file(workspace)
    data = (f"format: prompt_completion, train: [{{path: {workspace / 'train.jsonl'}, weight: 0.5}}, "
            f"{{path: {alpaca}, weight: 2, format: alpaca}}]")
    straight = train(recipe_for(workspace, data, "data.seq_len=256", "training.epochs=1", "training.max_steps=null",
                                f"output.dir={workspace / 'straight'}"), progress=False)
    expected = losses(straight.run_dir)
    assert len(expected) == straight.steps and len(set(expected)) == len(expected)

    recipe = recipe_for(workspace, data, "data.seq_len=256", "training.epochs=1", "training.max_steps=null")
    crash_after_step(monkeypatch, recipe, 6)  # the last checkpoint is step 4
    resumed = train(recipe, resume=True, progress=False)
    assert losses(resumed.run_dir) == expected


def test_a_mix_reads_each_file_in_its_own_format_and_weighs_it(workspace):
    from entrenar import tasks
    from entrenar.train.run_data import read_data

    alpaca = alpaca_file(workspace)
    recipe = recipe_for(workspace, f"format: prompt_completion, train: [{{path: {workspace / 'train.jsonl'}, "
                                   f"weight: 0.5}}, {{path: {alpaca}, weight: 2, format: alpaca}}]", "data.seq_len=256")
    data = read_data(recipe, tasks.for_recipe(recipe), load_tokenizer(workspace))
    assert len(data.examples) == 20 + 20  # half of 40, twice 10
    assert any("data.train: mixed" in note and "x0.5 (20 examples)" in note and "x2 (20 examples)" in note
               for note in data.notes)
    with pytest.raises(DataError, match="no 'prompt' key for data.format: prompt_completion; the record's keys "
                                        r"\(instruction, output\) fit data.format: alpaca"):
        one_format = recipe_for(workspace, f"format: prompt_completion, train: [{alpaca}]", "data.seq_len=256")
        read_data(one_format, tasks.for_recipe(one_format), load_tokenizer(workspace))


def test_a_run_without_held_out_examples_says_nothing_will_be_evaluated(workspace, capsys):
    recipe = recipe_for(workspace, f"train: {workspace / 'train.jsonl'}", "training.max_steps=2")
    result = train(recipe, dry_run=True, progress=False, verbose=True)
    assert "validation examples   0 (nothing will be evaluated" in result.summary
    assert "validation examples 0: nothing will be evaluated" in capsys.readouterr().out


def test_a_random_models_tokenizer_file_is_checked_first_but_a_hub_id_is_left_to_the_loader(workspace):
    from entrenar.train.run_data import check_paths

    def recipe(tokenizer):
        return Recipe.from_dict({"model": {"init": "random", "config": {"model_type": "llama"}, "tokenizer": tokenizer},
                                 "data": {"train": str(workspace / "train.jsonl")}})

    missing = workspace / "tokenizer.json"
    with pytest.raises(DataError, match=re.escape(f"model.tokenizer: no such file or folder: {missing}")):
        check_paths(recipe(str(missing)))
    check_paths(recipe("HuggingFaceTB/SmolLM2-135M"))  # resolved (or refused, naming the id) when loading
