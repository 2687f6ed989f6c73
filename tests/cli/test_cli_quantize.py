"""``entrenar quantize`` end to end on a tiny model: the table, the perplexity change, a folder that loads back;
bad settings are one-line errors naming the layer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from cli_helpers import build_chat_model, run_cli

import entrenar
from entrenar.quant.int import QuantLinear
from entrenar.quant.nf4.format import NF4Linear

LINEARS = [f"model.layers.{i}.{p}" for i in range(2) for p in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
ROW = re.compile(r"^(\S+)\s+(\d\.\d{3}e[-+]\d\d)\s+(\d\.\d{3}e[-+]\d\d)$")


@pytest.fixture
def model(hf_folder) -> Path:
    return build_chat_model(hf_folder)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "valid.jsonl"
    path.write_text("".join(json.dumps({"text": "The quick brown fox jumps over the lazy dog."}) + "\n"
                            for _ in range(6)))
    return path


def test_quantize_prints_the_table_and_perplexity_and_writes_a_loadable_folder(capsys, model, data, tmp_path):
    out_dir = tmp_path / "int4"
    code, out, err = run_cli(capsys, "quantize", model, "--method", "int4", "--group-size", 32, "--asymmetric",
                             "--data", data, "--seq-len", 64, "--device", "cpu", "--output", out_dir)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split() == ["layer", "rel.", "Frobenius", "max", "abs"]
    rows = [ROW.match(line) for line in lines[1:15]]
    assert [r.group(1) for r in rows] == LINEARS  # every linear layer, the output head left out

    loaded, _ = entrenar.load(out_dir, device="cpu")
    original, _ = entrenar.load(model, device="cpu")
    for r in rows:  # the table shows the error of the weights that were written
        w, w_q = original.get_submodule(r.group(1)).weight, loaded.get_submodule(r.group(1)).weight
        assert float(r.group(2)) == pytest.approx(((w - w_q).norm() / w.norm()).item(), rel=1e-3)
        assert float(r.group(3)) == pytest.approx((w - w_q).abs().max().item(), rel=1e-3)
        assert isinstance(loaded.get_submodule(r.group(1)), QuantLinear)

    assert lines[15].startswith("14 layers: mean relative error ")
    ppl = re.fullmatch(r"perplexity (\S+) -> (\S+) \(([-+]\S+), ([-+]\S+)%\); loss (\S+) -> (\S+) \((\d+) tokens\)",
                       lines[16])
    before, after, change = float(ppl.group(1)), float(ppl.group(2)), float(ppl.group(3))
    assert change == pytest.approx(after - before, abs=2e-3) and before != after
    assert lines[17].startswith(f"wrote {out_dir} (int4, group 32, asymmetric; quantized weights ")
    size = re.fullmatch(r"on disk (\S+) KiB -> (\S+) KiB \((\d+)% of the input; unquantized weights in float32\)",
                        lines[18])
    on_disk = sum(p.stat().st_size for p in out_dir.iterdir() if p.name != "export_report.json")  # written after
    assert float(size.group(2)) == pytest.approx(on_disk / 1024, abs=0.06)
    assert float(size.group(1)) == pytest.approx(sum(p.stat().st_size for p in model.iterdir()) / 1024, abs=0.06)
    assert lines[19].startswith("verify (quick) against ") and len(lines) == 19 + 8  # export_verify's report

    ids = torch.tensor([[1, 5, 9, 2]])
    assert not torch.equal(loaded(ids), original(ids))  # it is quantized, and only a little off
    torch.testing.assert_close(loaded(ids), original(ids), atol=0.1, rtol=0)


def test_nf4_without_data_has_no_perplexity_line(capsys, model, tmp_path):
    code, out, err = run_cli(capsys, "quantize", model, "--method", "nf4", "--output", tmp_path / "nf4",
                             "--device", "cpu", "--verify", "none")  # the report's lines: test_export_verify.py
    assert (code, err) == (0, "")
    assert not any(line.startswith("perplexity") for line in out.splitlines())
    assert out.splitlines()[-2].startswith(f"wrote {tmp_path / 'nf4'} (nf4, group size 64")
    loaded, _ = entrenar.load(tmp_path / "nf4", device="cpu")
    assert isinstance(loaded.get_submodule(LINEARS[0]), NF4Linear)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--method", "int4", "--group-size", "48"],
         "error: group size 48 does not divide the input width of 14 of 14 layers, e.g. "
         "model.layers.0.self_attn.q_proj (64); the layer widths are 64, 128. group sizes that divide every layer: "
         "64, 32, 16; or leave the group size out (no --group-size) for one scale per output channel\n"),
        (["--method", "int8", "--group-size", "128"],
         "error: group size 128 does not divide the input width of 12 of 14 layers, e.g. "
         "model.layers.0.self_attn.q_proj (64); the layer widths are 64, 128. group sizes that divide every layer: "
         "64, 32, 16; or leave the group size out (no --group-size) for one scale per output channel\n"),
        (["--method", "nf4", "--group-size", "48"],
         "error: nf4 block size 48 is not supported (choose one of 32, 64, 128, 256, 512, 1024, 2048, 4096; "
         "default 64)\n"),
        (["--method", "int9"],
         "error: int9: unsupported bit width 9; integer quantization supports 2 to 8 bits\n"),
        (["--method", "int8", "--percentile", "99"],
         "error: percentile 99.0 is used only with calibration 'percentile', not 'minmax'\n"),
        (["--method", "int8", "--calibration", "percentile", "--percentile", "150"],
         "error: percentile must be in (0, 100], got 150.0\n"),
        (["--method", "nf4", "--calibration", "percentile"],
         "error: nf4 scales each block by its absolute maximum; asymmetric and percentile calibration apply to "
         "integer methods (int8, int4)\n"),
    ],
)
def test_bad_settings_are_one_line_errors(capsys, model, tmp_path, args, message):
    code, out, err = run_cli(capsys, "quantize", model, *args, "--output", tmp_path / "q", "--device", "cpu")
    assert (code, out, err) == (2, "", message)
    assert not (tmp_path / "q").exists()


def test_the_input_is_never_the_output(capsys, model):
    files = {p.name: p.read_bytes() for p in model.iterdir()}
    code, out, err = run_cli(capsys, "quantize", model, "--method", "int8", "--output", model)
    assert code == 2 and "the output is the input model" in err
    assert {p.name: p.read_bytes() for p in model.iterdir()} == files


def test_method_and_output_are_required(capsys, model):
    code, _, err = run_cli(capsys, "quantize", model, "--output", "x")
    assert code == 2 and "--method" in err
    code, _, err = run_cli(capsys, "quantize", model, "--method", "int8")
    assert code == 2 and "--output" in err


def test_shapes_are_checked_before_the_model_is_loaded_or_evaluated(capsys, model, data, tmp_path, monkeypatch):
    monkeypatch.setattr(entrenar, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    code, out, err = run_cli(capsys, "quantize", model, "--method", "int4", "--group-size", 128, "--data", data,
                             "--output", tmp_path / "q", "--device", "cpu")
    assert code == 2 and "group sizes that divide every layer: 64, 32, 16" in err


def test_a_layer_as_wide_as_one_group_keeps_the_folders_one_layout(capsys, model, tmp_path):
    """q/k/v/gate/up are 64 wide: at group size 64 they hold one group per row, down_proj two."""
    out_dir = tmp_path / "int4-g64"
    code, out, err = run_cli(capsys, "quantize", model, "--method", "int4", "--group-size", 64, "--output", out_dir,
                             "--device", "cpu")
    assert (code, err) == (0, "")
    entry = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    assert (entry["granularity"], entry["group_size"]) == ("group", 64)
    loaded, _ = entrenar.load(out_dir, device="cpu")
    original, _ = entrenar.load(model, device="cpu")
    from entrenar.quant.int import dequantize_int, quantize_int

    for name in LINEARS:  # exactly what quantizing each weight in groups of 64 gives
        w = original.get_submodule(name).weight
        torch.testing.assert_close(loaded.get_submodule(name).weight, dequantize_int(quantize_int(w, 4, 64)),
                                   atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unquantized_weights_keep_the_inputs_dtype_and_the_folder_shrinks(capsys, hf_folder, tmp_path, dtype):
    from cli_helpers import chat_tokenizer
    from safetensors.torch import load_file

    folder, hf = hf_folder("llama", vocab_size=chat_tokenizer().vocab_size)
    hf.to(dtype).save_pretrained(folder)
    chat_tokenizer().save(folder)
    out_dir = tmp_path / "int8"
    code, out, err = run_cli(capsys, "quantize", folder, "--method", "int8", "--output", out_dir, "--device", "cpu",
                             "--verify", "none")
    assert (code, err) == (0, "")
    stored = load_file(out_dir / "model.safetensors")
    name = str(dtype).removeprefix("torch.")
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert stored[key].dtype == dtype, key
    assert json.loads((out_dir / "config.json").read_text())["dtype"] == name
    size_in = sum(p.stat().st_size for p in folder.iterdir())
    size_out = sum(p.stat().st_size for p in out_dir.iterdir())
    assert size_out < size_in
    assert out.splitlines()[-1].endswith(f"% of the input; unquantized weights in {name})")
    loaded, _ = entrenar.load(out_dir, device="cpu", dtype=torch.float32)
    original, _ = entrenar.load(folder, device="cpu", dtype=torch.float32)
    torch.testing.assert_close(loaded.model.embed_tokens.weight, original.model.embed_tokens.weight, atol=0, rtol=0)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), original(ids), atol=0.05, rtol=0)


def test_an_earlier_output_needs_overwrite_and_other_files_stay(capsys, model, tmp_path):
    out_dir = tmp_path / "q"
    assert run_cli(capsys, "quantize", model, "--method", "int8", "--output", out_dir, "--device", "cpu")[0] == 0
    (out_dir / "notes.txt").write_text("mine")
    code, out, err = run_cli(capsys, "quantize", model, "--method", "nf4", "--output", out_dir, "--device", "cpu")
    assert (code, out) == (2, "") and "the folder exists and is not empty; pass --overwrite to replace" in err
    assert "overwrite=True" not in err  # the command line's spelling only
    code, _, err = run_cli(capsys, "quantize", model, "--method", "nf4", "--output", out_dir, "--device", "cpu",
                           "--overwrite")
    assert (code, err) == (0, "")
    assert (out_dir / "notes.txt").read_text() == "mine"
    assert json.loads((out_dir / "config.json").read_text())["quantization_config"]["method"] == "nf4"


@pytest.mark.parametrize("damage", ["truncated", "random bytes"])
def test_a_damaged_weights_file_is_named_not_an_internal_error(capsys, hf_folder, tmp_path, damage):
    folder, _ = hf_folder()
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else bytes(range(256)) * (len(data) // 256))
    code, out, err = run_cli(capsys, "quantize", folder, "--method", "nf4", "--output", tmp_path / "q")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {weights}: cannot read safetensors file (") and "bug" not in err
    assert not (tmp_path / "q").exists()


def test_a_folder_without_a_tokenizer_is_quantized_with_a_note_saying_so(capsys, hf_folder, tmp_path):
    folder, _ = hf_folder()
    code, _, err = run_cli(capsys, "quantize", folder, "--method", "int8", "--output", tmp_path / "q")
    assert code == 0
    assert err.startswith(f"note: {tmp_path / 'q'}: written without a tokenizer, as {folder} has none;")
    assert len(err.splitlines()) == 1  # one line: no Python source location
