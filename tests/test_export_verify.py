"""Every export checks itself: the report passes a clean export and flags each planted fault.

Faults are planted in what an export wrote, as a broken converter would leave them: a swapped chat template, a
dropped end-of-turn id, one tensor's quantization scales corrupted in a GGUF file (edited through the gguf package's
own reader), one tensor wrong in a merged folder, and a merge into the wrong base.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from entrenar.export.verify import REPORT_FILE, export_verified, report_path, verify_export

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export import make_adapter, make_base  # noqa: E402

# A tiny random model's next-token distributions are near uniform, so every KL is small: the clean q8_0 export is
# about 1e-6 nats/token here, a corrupted tensor 1e-2; the threshold sits between them for clean and faulty alike.
MAX_KL = 1e-3
LLAMA2_TEMPLATE = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A base, an adapter, and their merged folder with a q8_0 GGUF, verified as exported."""
    d = tmp_path_factory.mktemp("verify")
    base = make_base(d / "base")
    adapter = make_adapter(base, d / "adapter")
    written, report = export_verified(base, adapter, d / "out", gguf="q8_0", max_kl=MAX_KL)
    return base, adapter, d / "out", written, report


def test_a_clean_export_passes_and_its_report_is_written(clean):
    _, _, out, written, report = clean
    assert [c.path for c in report.checks] == [out, out / "model-q8_0.gguf"]
    assert report.problems == []
    folder, q8 = (c.comparison for c in report.checks)
    assert folder.kl < 1e-6 and folder.top1_agreement == 1.0
    assert abs(folder.candidate_loss - folder.reference_loss) < 1e-4
    assert 0 < q8.kl < MAX_KL and folder.tokens >= 100
    assert all(c.same for c in folder.continuations)
    saved = json.loads((out / REPORT_FILE).read_text())
    assert saved["ok"] is True and saved["checks"][1]["path"].endswith("model-q8_0.gguf")


def copy_export(out: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(out, to)
    (to / REPORT_FILE).unlink()
    return to


def test_a_swapped_chat_template_is_flagged(clean, tmp_path):
    base, adapter, out, _, _ = clean
    bad = copy_export(out, tmp_path / "bad")
    config = json.loads((bad / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA2_TEMPLATE
    (bad / "tokenizer_config.json").write_text(json.dumps(config))
    report = verify_export(base, adapter, [bad], max_kl=MAX_KL)
    assert report.problems == [f"{bad.name}: the chat template differs from the trained model's"]
    assert json.loads((bad / REPORT_FILE).read_text())["ok"] is False


def test_a_dropped_end_of_turn_id_is_flagged(clean, tmp_path):
    base, adapter, out, _, _ = clean
    bad = copy_export(out, tmp_path / "bad")
    generation = json.loads((bad / "generation_config.json").read_text())
    generation["eos_token_id"] = 1  # <|im_end|> (3) no longer stops a generation
    (bad / "generation_config.json").write_text(json.dumps(generation))
    report = verify_export(base, adapter, [bad], max_kl=MAX_KL)
    assert len(report.problems) == 1 and "[3] end the trained model's generations" in report.problems[0]


def test_corrupted_quantization_scales_in_a_gguf_are_flagged(clean, tmp_path):
    base, adapter, out, _, _ = clean
    bad = tmp_path / "bad.gguf"
    bad.write_bytes((out / "model-q8_0.gguf").read_bytes())
    reader = gguf.GGUFReader(bad, "r+")
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    blocks = tensor.data.view(np.uint8).reshape(-1, 34)  # Q8_0: an f16 scale, then 32 int8
    blocks[:, :2].view(np.float16)[:] *= np.float16(-8)
    reader.data.flush()
    del reader
    report = verify_export(base, adapter, [bad], max_kl=MAX_KL)
    (comparison,) = (c.comparison for c in report.checks)
    assert comparison.kl > MAX_KL and any("KL divergence" in p for p in report.problems)
    assert report_path(bad).is_file()


def test_a_wrong_tensor_in_a_merged_folder_is_flagged(clean, tmp_path):
    base, adapter, out, _, _ = clean
    bad = copy_export(out, tmp_path / "bad")
    (bad / "model-q8_0.gguf").unlink()
    weights = load_file(bad / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"] *= -4
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    report = verify_export(base, adapter, [bad], max_kl=MAX_KL)
    assert any("KL divergence" in p for p in report.problems)


@pytest.mark.filterwarnings("ignore:.*an adapter means little on another base")
def test_a_merge_into_the_wrong_base_is_flagged(clean, tmp_path):
    base, adapter, _, _, _ = clean
    other = make_base(tmp_path / "other")
    with torch.no_grad():  # same architecture and tokenizer, other weights (another checkpoint of the family)
        weights = load_file(other / "model.safetensors")
        save_file({k: v + 0.05 * torch.randn_like(v) for k, v in weights.items()}, other / "model.safetensors",
                  metadata={"format": "pt"})
    written, _ = export_verified(other, adapter, tmp_path / "merged", merge=True, verify="none")
    report = verify_export(base, adapter, written, max_kl=MAX_KL)
    assert any("KL divergence" in p for p in report.problems)


def test_strict_export_and_eval_compare_exit_non_zero_on_a_fault(clean, tmp_path, capsys):
    from entrenar.cli.main import main

    base, adapter, out, _, _ = clean
    code = main(["export", str(base), "--adapter", str(adapter), "--output", str(tmp_path / "ok"), "--merge",
                 "--strict", "--max-kl", str(MAX_KL)])
    printed = capsys.readouterr().out
    assert code == 0 and "verified: within the thresholds" in printed and (tmp_path / "ok" / REPORT_FILE).is_file()
    bad = copy_export(out, tmp_path / "bad")
    generation = json.loads((bad / "generation_config.json").read_text())
    generation["eos_token_id"] = 1
    (bad / "generation_config.json").write_text(json.dumps(generation))
    data = tmp_path / "held.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["The capital of France is Paris."] * 8))
    args = ["eval", str(tmp_path / "ok"), "--data", str(data), "--compare", str(bad), "--dtype", "float32"]
    assert main(args) == 0
    assert "MISSING [3]" in capsys.readouterr().out
    assert main([*args, "--strict"]) == 1


def test_a_qlora_merge_says_its_base_and_scores_both(workspace, tmp_path):
    """``--merge-base trained`` merges into the dequantized NF4 base the adapter trained on: the model as trained,
    to float rounding; ``full`` into the full-precision base, a different model. The report gives both losses."""
    from test_runs import make_run

    run = make_run(workspace, "lora.quantize_base=nf4", "training.max_steps=2", "training.eval_every=2",
                   "training.save_every=2")
    reports = {}
    for base in ("trained", "full"):
        _, reports[base] = export_verified(run, None, tmp_path / base, merge=True, merge_base=base)
    trained, full = (reports[b].checks[0].comparison for b in ("trained", "full"))
    assert trained.kl < 1e-6 and abs(trained.candidate_loss - trained.reference_loss) < 1e-4
    assert full.kl > 100 * max(trained.kl, 1e-9)
    for base, report in reports.items():
        assert report.merge_base == base and "(nf4 base)" in report.reference
        assert report.data.endswith("train.jsonl (the 0.2 validation split the run held out)")
        assert set(report.merge_bases) == {"trained", "full", "as trained"}
        assert report.merge_bases[base] == report.checks[0].comparison.candidate_loss
    assert reports["trained"].merge_bases["full"] == pytest.approx(full.candidate_loss, abs=1e-5)


def test_a_quantized_folder_is_verified_and_corrupted_scales_flagged(clean, tmp_path, capsys):
    from entrenar.cli.main import main

    base = clean[0]
    args = ["quantize", str(base), "--method", "int8", "--output", str(tmp_path / "q"), "--strict",
            "--max-kl", str(MAX_KL)]
    assert main(args) == 0 and "verified: within the thresholds" in capsys.readouterr().out
    assert json.loads((tmp_path / "q" / REPORT_FILE).read_text())["ok"] is True
    weights = load_file(tmp_path / "q" / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.weight_scale"] *= 8  # the loader refuses non-positive ones
    save_file(weights, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    report = verify_export(base, None, [tmp_path / "q"], max_kl=MAX_KL)
    assert any("KL divergence" in p for p in report.problems)
