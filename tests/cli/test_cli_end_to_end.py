"""The console script for real: the quickstart trains, resumes, evaluates and generates."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from entrenar.train.metrics import read_metrics


def entrenar(*args: str, cwd) -> subprocess.CompletedProcess:
    exe = shutil.which("entrenar")
    command = [exe] if exe else [sys.executable, "-m", "entrenar.cli.main"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def test_quickstart_trains_resumes_and_its_model_is_usable(tmp_path):
    short = ["--set", "training.max_steps=40", "--set", "training.eval_every=20", "--set", "training.save_every=20",
             "--no-progress"]
    done = entrenar("train", *short, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run = tmp_path / "runs" / "quickstart"
    assert "held-out loss" in done.stdout and "held-out acc." in done.stdout
    for name in ("metrics.jsonl", "recipe.yaml", "loss_curve.png", "model/config.json", "model/tokenizer.json",
                 "checkpoints/step-40/model.safetensors"):
        assert (run / name).is_file(), name
    losses = [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 40 and losses[-1] < losses[0]

    again = entrenar("train", *short, cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.startswith("error: ") and "--resume" in again.stderr
    assert "Traceback" not in again.stderr
    assert [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == losses  # nothing damaged

    # A run folder alone is enough to resume: its saved recipe is used, not the bundled one.
    longer = entrenar("train", "--resume", str(run), "--set", "training.max_steps=50", "--no-progress", cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr
    assert len([r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]) == 50

    validation = run / "quickstart" / "validation.jsonl"
    evaluated = entrenar("eval", str(run / "model"), "--data", str(validation), "--train-on", "completion",
                         cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr
    assert "perplexity" in evaluated.stdout

    prompt = json.loads(validation.read_text().splitlines()[0])["prompt"]
    generated = entrenar("generate", str(run / "model"), "--prompt", prompt, "--max-new-tokens", "4", cwd=tmp_path)
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.strip().isdigit() or generated.stdout.strip() == ""


def test_dry_run_and_a_bad_override_through_the_console_script(tmp_path):
    dry = entrenar("train", "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "trainable" in dry.stdout and "memory estimate" in dry.stdout
    assert not (tmp_path / "runs" / "quickstart" / "checkpoints").exists()
    bad = entrenar("train", "--set", "training.batch_size=eight", cwd=tmp_path)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: --set training.batch_size=eight: 'training.batch_size' must be an integer > 0, got 'eight'"
    ]
