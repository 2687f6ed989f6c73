"""What the loop does with doubtful input: skipped records listed, no quickstart by accident, a dry run that
writes nothing, and seq_len bounded by the model's context."""

from __future__ import annotations

import json
import os

import pytest

from entrenar.config import load_recipe
from entrenar.data.batching import CONTEXT_FACTOR, BatchStream
from entrenar.data.tokenize import Example
from entrenar.errors import ConfigError
from entrenar.train.loop import train


def recipe_for(ws, *overrides):
    path = ws / "recipe.yaml"
    path.write_text(f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32, train_on: completion}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
training: {{max_steps: 2, batch_size: 2, log_every: 1}}
output: {{dir: {ws / 'run'}}}
""")
    return load_recipe(path, list(overrides))


def tree(folder) -> set[str]:
    return {os.path.relpath(os.path.join(root, name), folder)
            for root, dirs, files in os.walk(folder) for name in dirs + files}


def test_every_skipped_record_is_listed_in_the_run_folder_and_counted_in_the_summary(workspace):
    lines = (workspace / "train.jsonl").read_text().splitlines()
    lines[4] = '{"prompt": "1+1=", "completion": 2}'
    lines[1] = "{not json"
    lines[20] = '{"prompt": "' + "[" * 3000  # cut short: invalid JSON
    (workspace / "bad.jsonl").write_text("\n".join(lines) + "\n")
    (workspace / "val.jsonl").write_text('{"prompt": "1+2=", "completion": "3"}\n{"text": null}\n')
    recipe = recipe_for(workspace, f"data.train={workspace / 'bad.jsonl'}",
                        f"data.validation={workspace / 'val.jsonl'}", "data.on_error=skip")
    result = train(recipe, progress=False)
    rows = [json.loads(line) for line in (result.run_dir / "skipped.jsonl").read_text().splitlines()]
    bad, val = str(workspace / "bad.jsonl"), str(workspace / "val.jsonl")
    assert [(r["file"], r["line"], r["reason"]) for r in rows] == [
        (bad, 2, "invalid JSON"), (bad, 5, "field not a string"), (bad, 21, "invalid JSON"),
        (val, 2, "field not a string")]
    assert f"data.train: 3 malformed record(s) skipped (2 invalid JSON, 1 field not a string); first: {bad} line 2: " \
           "invalid JSON" in result.summary
    assert (f"data.validation: 1 malformed record(s) skipped (1 field not a string); first: {val} line 2"
            in result.summary)


def test_a_clean_run_writes_no_skipped_file(workspace):
    result = train(recipe_for(workspace, "data.on_error=skip"), progress=False)
    assert not (result.run_dir / "skipped.jsonl").exists()


def test_a_dry_run_writes_nothing_anywhere_it_could(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    (workspace / "val.jsonl").write_text('{"text": null}\n{"prompt": "1+2=", "completion": "3"}\n')
    before = tree(workspace)
    result = train(recipe_for(workspace, f"data.validation={workspace / 'val.jsonl'}", "data.on_error=skip"),
                   dry_run=True, progress=False)
    assert result.dry_run and "1 malformed record(s) skipped" in result.summary
    assert tree(workspace) == before | {"recipe.yaml"}  # the recipe this test wrote, nothing else
    # The bundled quickstart builds its model and data, in a temporary folder: the run folder stays untouched.
    quick = train(load_recipe(None, [f"output.dir={workspace / 'q'}", "training.max_steps=40"]), dry_run=True,
                  progress=False)
    assert "memory estimate" in quick.summary and "held" not in quick.summary
    assert tree(workspace) == before | {"recipe.yaml"}


def test_seq_len_is_bounded_by_the_model_context(workspace):
    config_file = workspace / "model" / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = 64
    config_file.write_text(json.dumps(config))

    fine = train(recipe_for(workspace, "data.seq_len=64"), dry_run=True, progress=False)
    assert "beyond the context" not in fine.summary
    beyond = train(recipe_for(workspace, "data.seq_len=65"), dry_run=True, progress=False)
    assert "data.seq_len=65 is beyond the context of" in beyond.summary and "(64 tokens" in beyond.summary
    with pytest.raises(ConfigError, match=r"'data.seq_len' is 513, more than 8x the context of .*model \(64 tokens, "
                                          r"max_position_embeddings\); use at most 512"):
        train(recipe_for(workspace, f"data.seq_len={CONTEXT_FACTOR * 64 + 1}"), dry_run=True, progress=False)

    # The largest accepted seq_len trains: rows hold each of the 40 examples once, then padding.
    result = train(recipe_for(workspace, f"data.seq_len={CONTEXT_FACTOR * 64}"), progress=False)
    assert result.steps == 2 and result.final_loss is not None


def test_packing_never_repeats_an_example_in_a_row():
    examples = [Example([i, i + 1, i + 2], [i, i + 1, i + 2], f"e{i}") for i in range(0, 30, 3)]  # 10 x 3 tokens
    stream = BatchStream(examples, batch_size=2, seq_len=10_000, shuffle=False)
    batch = next(stream)
    for row in range(2):  # each row: all 10 examples once (30 tokens), then padding
        assert batch["input_ids"][row, :30].tolist() == list(range(30))
        assert batch["document_ids"][row, :30].tolist() == [d for d in range(10) for _ in range(3)]
        assert (batch["document_ids"][row, 30:] == -1).all()
    assert stream.state_dict()["epoch"] == 2 and stream.state_dict()["position"] == 0


def test_dry_run_refuses_early_stopping_without_validation(workspace):
    """What the real run refuses, the dry run refuses too (it used to call such a recipe valid)."""
    from entrenar.errors import ConfigError
    from entrenar.train.loop import train

    recipe = recipe_for(workspace, "data.validation_split=0", "training.eval_every=1",
                        "training.early_stopping={metric: eval_loss}")
    with pytest.raises(ConfigError, match="early_stopping: needs a validation set"):
        train(recipe, dry_run=True, progress=False)
