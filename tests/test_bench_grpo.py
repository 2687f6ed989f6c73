"""bench/bench_grpo.py's unsloth row: it runs in a process of its own with Unsloth imported before anything imports
transformers, is reported as skipped with the reason where Unsloth cannot be imported (this machine: not installed,
no GPU), and trains with the trl row's GRPOConfig, whose fields pinned against Unsloth's changes are TRL's own
defaults (so pinning them leaves the trl row as it was)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_grpo  # noqa: E402


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is not None, reason="Unsloth is importable here: the row "
                    "would run it (this test is of a machine without it)")
def test_the_unsloth_row_is_skipped_in_its_own_process_with_the_import_error(tmp_path):
    args = argparse.Namespace(work=str(tmp_path), skip=2, steps=0, tiny=True)
    folder = tmp_path / "llama-1b-tiny"  # never read: the row stops at `import unsloth`
    result = bench_grpo.run_baseline_process("unsloth", "lora-1b", folder, tmp_path / "prompts.jsonl", 16.0, args)
    assert result["status"] == "skipped"
    # Unsloth's own import failed: nothing had imported transformers before it (import_unsloth refuses that order
    # with another message)
    assert result["error"].startswith("import unsloth: ModuleNotFoundError: No module named 'unsloth'"), result
    assert "transformers" not in result["error"]
    assert result["settings"]["from_pretrained"]["fast_inference"] is False
    assert result["settings"]["from_pretrained"]["model_name"] == str(folder)
    assert (tmp_path / "lora-1b-unsloth-grpo.json").is_file()  # written by the row's process


def test_the_baselines_share_a_grpo_config_whose_pinned_fields_are_trls_defaults(tmp_path, capsys):
    trl = pytest.importorskip("trl")
    bench_grpo.main(["--dry", "--cases", "lora-1b", "--rows", "trl,unsloth", "--work", str(tmp_path)])
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        row, what = line.removeprefix("[lora-1b] ").split(": ", 1)
        rows[row] = json.loads(what)
    trl_config, unsloth_config = rows["trl"]["grpo_config"], rows["unsloth"]["grpo_config"]
    assert trl_config.pop("output_dir") != unsloth_config.pop("output_dir")
    assert trl_config == unsloth_config
    assert unsloth_config["use_vllm"] is False and unsloth_config["loss_type"] == "dapo"
    # what Unsloth's GRPOConfig would change is pinned to what TRL's GRPOTrainer uses when they are left unset
    default = trl.GRPOConfig(output_dir=str(tmp_path / "default"), use_cpu=True, report_to=[])
    pinned = trl.GRPOConfig(**{**unsloth_config, "output_dir": str(tmp_path / "pinned")})
    assert pinned.epsilon_high == (default.epsilon_high if default.epsilon_high is not None else default.epsilon)
    assert pinned.mask_truncated_completions == default.mask_truncated_completions
    assert pinned.weight_decay == default.weight_decay
    peft = rows["unsloth"]["get_peft_model"]
    assert peft["r"] == 16 and peft["lora_alpha"] == 32 and peft["use_gradient_checkpointing"] == "unsloth"
    assert rows["unsloth"]["from_pretrained"]["load_in_4bit"] is False


def test_an_unknown_row_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench_grpo.main(["--dry", "--rows", "trl,unslot"])
    assert e.value.code == 2
    assert "--rows: unknown unslot (of entrenar, entrenar-matched, trl, unsloth)" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_unsloth_row_adapts_the_modules_peft_all_linear_adapts_in_the_trl_row(family, tmp_path):
    peft = pytest.importorskip("peft")
    from conftest import make_hf_model

    model = peft.get_peft_model(make_hf_model(family), peft.LoraConfig(r=16, lora_alpha=32,
                                                                       target_modules="all-linear"))
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
               if isinstance(module, peft.tuners.lora.LoraLayer)}
    case = bench_grpo._case("lora-qwen3" if family == "qwen3" else "lora-1b",
                            argparse.Namespace(steps=0, tiny=True))
    targets = bench_grpo.unsloth_grpo_settings(case, tmp_path)["get_peft_model"]["target_modules"]
    assert sorted(targets) == sorted(adapted)


def test_the_matched_row_is_the_entrenar_recipe_with_unsloths_default_memory_settings(tmp_path, capsys):
    bench_grpo.main(["--dry", "--cases", "lora-1b", "--rows", "entrenar,entrenar-matched", "--work", str(tmp_path)])
    rows = dict(line.split(" ", 1)[1].split(": ", 1) for line in capsys.readouterr().out.splitlines())
    plain, matched = (json.loads(rows[f"{row}"])["training"] for row in ("entrenar", "entrenar-matched"))
    assert matched == {**plain, "activation_checkpointing": True, "offload_activations": True, "tiled_mlp": 8192}
    assert plain["activation_checkpointing"] is False

