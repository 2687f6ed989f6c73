"""Bad labels name their file and line, or (on_error: skip) are left out and listed in the run's skipped.jsonl."""

from __future__ import annotations

import json

import pytest
from classification_workspace import recipe_for, write_data

from entrenar.errors import DataError
from entrenar.train.loop import train


@pytest.mark.parametrize("bad", ["medium", 7])
def test_unknown_or_out_of_range_label_names_file_and_line(workspace, bad):
    recipe = recipe_for(workspace)
    write_data(workspace, bad=bad)
    with pytest.raises(DataError, match=r"cls\.jsonl line 49"):
        train(recipe, progress=False)
    skipping = recipe_for(workspace, "data.on_error=skip")
    write_data(workspace, bad=bad)
    result = train(skipping, dry_run=True, progress=False)
    assert "1 record(s) skipped" in result.summary


def test_skipped_labels_are_listed_in_the_runs_skipped_jsonl(workspace):
    recipe = recipe_for(workspace, "training.max_steps=1", "data.on_error=skip")
    write_data(workspace, bad="huge")  # one record with a label that is not a class
    result = train(recipe, progress=False)
    lines = [json.loads(line) for line in (result.run_dir / "skipped.jsonl").read_text().splitlines()]
    assert len(lines) == 1 and "huge" in json.dumps(lines[0]) and "line 49" in json.dumps(lines[0])
