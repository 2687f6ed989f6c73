"""Preference optimisation through ``entrenar train``: metrics under TRL's names, the best checkpoint by held-out
preference accuracy, accumulation, the dry run's reference decision, and an exact resume of a precomputed
reference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import crash_after_step
from entrenar.cli.main import main
from entrenar.config import load_recipe
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics

TRL_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from conftest import make_workspace

    root = make_workspace(tmp_path_factory.mktemp("pref"))
    for name, numbers in (("pairs.jsonl", range(24)), ("held_out.jsonl", range(30, 36))):
        with open(root / name, "w") as f:
            for a in numbers:
                f.write(json.dumps({"prompt": f"{a}+{a % 7}=", "chosen": str(a + a % 7), "rejected": str(a * 3 + 1)})
                        + "\n")
    return root


def recipe_for(ws, name, *overrides, lora=True):
    path = ws / f"{name}.yaml"
    path.write_text(f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'pairs.jsonl'}, seq_len: 32, validation_split: 0.25, shuffle: false}}
{'lora: {r: 4, alpha: 8, target_modules: all-linear}' if lora else ''}
task: {{type: preference}}
optimizer: {{lr: 2.0e-2}}
schedule: {{warmup_steps: 0}}
training: {{max_steps: 4, batch_size: 2, eval_every: 2, log_every: 1}}
output: {{dir: {ws / name}}}
""")
    return path, load_recipe(path, list(overrides))


def test_dpo_through_entrenar_train_logs_trl_metrics_and_keeps_the_best(ws, capsys):
    path, _ = recipe_for(ws, "dpo", f"data.validation={ws / 'held_out.jsonl'}", "data.validation_split=0")
    path.write_text(path.read_text().replace("validation_split: 0.25", f"validation: {ws / 'held_out.jsonl'}"))
    assert main(["train", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "held-out preference accuracy" in out
    records = read_metrics(ws / "dpo" / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert set(TRL_NAMES) <= set(r)
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
    assert steps[0]["loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)  # policy = reference
    evals = [r for r in records if "eval_rewards/accuracies" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert all(f"eval_{name}" in r for r in evals for name in TRL_NAMES)
    assert (ws / "dpo" / "adapter" / "adapter_model.safetensors").is_file()
    best = max(evals, key=lambda r: r["eval_rewards/accuracies"])
    if best["step"] > 0:
        assert (ws / "dpo" / "best" / "adapter").is_dir()


def test_accumulation_through_the_trainer_equals_one_large_batch(ws):
    # SGD: the update is the gradient itself (Adam's normalisation would magnify rounding in near-zero gradients)
    sgd = ["optimizer.name=sgd", "optimizer.lr=0.5", "training.eval_every=0"]
    one = train(recipe_for(ws, "one", "training.batch_size=4", *sgd)[1], progress=False)
    two = train(recipe_for(ws, "two", "training.grad_accum=2", *sgd)[1], progress=False)
    a = [r for r in read_metrics(one.run_dir / "metrics.jsonl") if "loss" in r]
    b = [r for r in read_metrics(two.run_dir / "metrics.jsonl") if "loss" in r]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6)
        assert x["rewards/accuracies"] == pytest.approx(y["rewards/accuracies"])
    wa = load_file(one.output / "adapter_model.safetensors")
    wb = load_file(two.output / "adapter_model.safetensors")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("lora", "overrides", "expected"), [
    (True, [], "adapters_off (LoRA"),
    (False, [], "copy (full fine-tuning"),
    (False, ["task.reference=precomputed"], "precomputed (task.reference: precomputed)"),
    (True, ["task.loss=simpo"], "none (task.loss simpo is reference-free)"),
])
def test_dry_run_says_which_reference_and_counts_a_copy(ws, lora, overrides, expected):
    result = train(recipe_for(ws, "dry", *overrides, lora=lora)[1], dry_run=True, progress=False)
    assert "task.reference" in result.summary and expected in result.summary
    assert ("reference copy" in result.summary) == expected.startswith("copy")


def test_full_fine_tune_with_a_precomputed_reference_resumes_exactly(ws, monkeypatch):
    overrides = ["task.reference=precomputed", "training.save_every=2", "training.eval_every=0"]
    straight = train(recipe_for(ws, "straight", *overrides, lora=False)[1], progress=False)
    expected = [r["loss"] for r in read_metrics(straight.run_dir / "metrics.jsonl") if "loss" in r]
    assert (straight.run_dir / "reference_logps.safetensors").is_file()

    _, recipe = recipe_for(ws, "crashed", *overrides, lora=False)
    crash_after_step(monkeypatch, recipe, 3)
    table = ws / "crashed" / "reference_logps.safetensors"
    stamp = table.stat().st_mtime_ns
    resumed = train(recipe, resume=True, progress=False)
    got = [r["loss"] for r in read_metrics(resumed.run_dir / "metrics.jsonl") if "loss" in r]
    assert got == pytest.approx(expected, rel=1e-6)
    assert table.stat().st_mtime_ns == stamp  # the table was reused, not recomputed with trained weights


def test_entrenar_eval_on_preference_data_reports_the_runs_last_evaluation(ws, capsys):
    """`entrenar eval RUN --data held_out.jsonl`: the run's task settings, its adapter against its base, and the
    numbers the run's last evaluation of the same file logged."""
    run = ws / "dpo"
    if not (run / "adapter").is_dir():
        pytest.skip("needs the DPO run of the test above")
    capsys.readouterr()
    assert main(["eval", str(run), "--data", str(ws / "held_out.jsonl"), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "using the run's task settings" in out and "(6 pairs)" in out
    last = [r for r in read_metrics(run / "metrics.jsonl") if "eval_rewards/accuracies" in r][-1]
    printed = dict(zip(out.split()[::2], out.split()[1::2]))
    for name in TRL_NAMES:
        assert float(printed[name]) == pytest.approx(last[f"eval_{name}"], abs=1e-4), name


def test_entrenar_eval_of_a_full_model_needs_its_reference(ws, capsys):
    assert main(["eval", str(ws / "model"), "--data", str(ws / "held_out.jsonl"), "--loss", "dpo",
                 "--device", "cpu"]) == 2
    assert "compares the model with a reference" in capsys.readouterr().err
    assert main(["eval", str(ws / "model"), "--data", str(ws / "held_out.jsonl"), "--loss", "simpo",
                 "--device", "cpu"]) == 0
    assert "rewards/accuracies" in capsys.readouterr().out


def test_a_frozen_copy_under_fsdp_is_refused(ws):
    from entrenar.errors import ConfigError
    from entrenar.train.plan import plan_for

    _, recipe = recipe_for(ws, "fsdp", "training.parallel=fsdp", lora=False)
    with pytest.raises(ConfigError, match="frozen copy is not sharded under FSDP"):
        plan_for(recipe, device="cuda", processes=2)
    plan_for(load_recipe(ws / "fsdp.yaml", ["training.parallel=fsdp", "task.reference=precomputed"]),
             device="cuda", processes=2)
