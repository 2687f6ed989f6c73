"""`entrenar ablate` from the command line: one `error:` line and exit 2 for what the user got wrong, and a run
that prints the report."""

from __future__ import annotations

import json

import pytest

from entrenar.cli.main import main

MOE = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 16, "max_position_embeddings": 64}


def write_recipe(tmp_path, config=MOE, **model):
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps({
        "model": {"init": "random", "device": "cpu", "config": config, **model},
        "data": {"train": "synth:mixture:24", "validation_split": 0.2, "seq_len": 32, "train_on": "completion"},
        "lora": None, "training": {"max_steps": 1, "batch_size": 2, "log_every": 1},
        "output": {"dir": str(tmp_path / "run")}}))
    return path


@pytest.mark.parametrize("args, message", [
    (["--arms", "moe,bogus"], "error: --arms: unknown arm 'bogus' (choose from moe, moe-sigmoid, dense)"),
    (["--set", "model.config.model_type=qwen3"], "has no mixture-of-experts layers"),
    (["--set", "model.config.model_type=olmoe", "--arms", "dense"], "olmoe has no dense family"),
    (["--bias-update-rate", "0"], "error: --bias-update-rate: must be a positive number, got 0.0"),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    path = write_recipe(tmp_path)
    assert main(["ablate", str(path), "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert not (tmp_path / "run-ablation").exists()


def test_a_pretrained_recipe_is_refused_naming_the_file(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps({"model": {"path": str(tmp_path)}, "data": {"train": "synth:mixture:8"}}))
    assert main(["ablate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ablate trains models from scratch") and err.count("\n") == 1


def test_ablate_prints_the_report(tmp_path, capsys):
    path = write_recipe(tmp_path)
    assert main(["ablate", str(path), "--arms", "dense,moe", "--match", "total", "--output", str(tmp_path / "a"),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"arm dense: training in {tmp_path / 'a' / 'dense'}\n")
    assert f"arm moe: training in {tmp_path / 'a' / 'moe'}\n" in out
    assert "| dense |" in out and "| moe |" in out and "parameters for the MoE's" in out and " total (" in out
    assert f"report: {tmp_path / 'a' / 'ablation.json'}" in out
    saved = json.loads((tmp_path / "a" / "ablation.json").read_text())
    assert list(saved["arms"]) == ["dense", "moe"] and saved["match"]["match"] == "total"
