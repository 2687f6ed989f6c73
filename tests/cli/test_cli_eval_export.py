"""``entrenar eval`` and ``entrenar export`` pass their arguments to the library and print its result.

The library sides (entrenar.evaluation.loss, entrenar.export) are stood in for here; their own tests check the numbers.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import build_chat_model, fake_module, run_cli

from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import AdapterError, DataError
from entrenar.evaluation.compare import MAX_KL
from entrenar.models.transformer import Transformer


@pytest.fixture
def chat_model(hf_folder) -> Path:
    return build_chat_model(hf_folder)


def test_eval_loads_the_model_and_prints_loss_and_perplexity(capsys, monkeypatch, chat_model, tmp_path):
    seen = {}

    def evaluate_file(model, tokenizer, path, seq_len, batch_size, train_on, fmt="auto", add_eos=True, columns=None):
        seen.update(model=model, tokenizer=tokenizer, args=(path, seq_len, batch_size, train_on, add_eos))
        return SimpleNamespace(loss=2.5, perplexity=math.exp(2.5), tokens=1234, examples=7)

    fake_module(monkeypatch, "entrenar.evaluation.loss", evaluate_file=evaluate_file)
    data = tmp_path / "valid.jsonl"
    code, out, err = run_cli(capsys, "eval", chat_model, "--data", data, "--seq-len", 64, "--batch-size", 2,
                             "--train-on", "completion", "--device", "cpu")
    assert (code, err) == (0, "")
    assert out == "loss 2.5000  perplexity 12.182  (1,234 tokens, 7 examples)\n"
    assert seen["args"] == (str(data), 64, 2, "completion", True)
    run_cli(capsys, "eval", chat_model, "--data", data, "--no-eos", "--device", "cpu")
    assert seen["args"][-1] is False  # as a recipe with data.add_eos: false trains
    assert isinstance(seen["model"], Transformer) and not seen["model"].training
    assert isinstance(seen["tokenizer"], Tokenizer)


def test_eval_data_error_is_one_line(capsys, monkeypatch, chat_model):
    def evaluate_file(model, tokenizer, path, *args, **kwargs):
        raise DataError(f"{path} line 3: invalid JSON")

    fake_module(monkeypatch, "entrenar.evaluation.loss", evaluate_file=evaluate_file)
    code, out, err = run_cli(capsys, "eval", chat_model, "--data", "bad.jsonl")
    assert (code, out, err) == (2, "", "error: bad.jsonl line 3: invalid JSON\n")


def test_eval_needs_data(capsys):
    code, _, err = run_cli(capsys, "eval", "some-model")
    assert code == 2 and "--data" in err


@pytest.fixture
def exports(monkeypatch):
    calls: list[tuple] = []

    def export_verified(model_path, adapter, output, verify, data, max_kl, merge_base, merge, gguf, dtype, overwrite):
        calls.append((model_path, adapter, output, merge, gguf, dtype, overwrite))
        assert (verify, data, max_kl, merge_base) == ("quick", None, MAX_KL, "full")  # the defaults
        if adapter == "broken":
            raise AdapterError("broken: no adapter_config.json; not an adapter folder")
        paths = [Path(output)] if merge else []
        return paths + ([Path(output) / "model-f16.gguf"] if gguf else []), None

    fake_module(monkeypatch, "entrenar.export.verify", export_verified=export_verified)
    return calls


def test_export_passes_its_options_and_lists_what_it_wrote(capsys, exports):
    code, out, _ = run_cli(capsys, "export", "base", "--adapter", "ad", "--output", "out", "--merge", "--gguf", "f16")
    assert code == 0
    assert exports == [("base", "ad", "out", True, "f16", None, False)]
    assert out == f"wrote out\nwrote {Path('out') / 'model-f16.gguf'}\n"
    assert run_cli(capsys, "export", "base", "--adapter", "ad", "--output", "o")[0] == 0
    assert exports[-1] == ("base", "ad", "o", False, None, None, False)
    assert run_cli(capsys, "export", "full-run", "--output", "o", "--dtype", "bf16", "--overwrite")[0] == 0
    assert exports[-1] == ("full-run", None, "o", False, None, "bf16", True)  # no adapter: a full fine-tune


def test_export_errors_and_usage(capsys, exports):
    code, out, err = run_cli(capsys, "export", "base", "--adapter", "broken", "--output", "o")
    assert (code, out, err) == (2, "", "error: broken: no adapter_config.json; not an adapter folder\n")
    code, _, err = run_cli(capsys, "export", "base", "--adapter", "ad", "--output", "o", "--gguf", "q4_k")
    assert code == 2 and "invalid choice: 'q4_k'" in err
    code, _, err = run_cli(capsys, "export", "base", "--adapter", "ad", "--output", "o", "--dtype", "fp8")
    assert code == 2 and "invalid choice: 'fp8'" in err
    assert len(exports) == 1


@pytest.mark.parametrize("argv", [["export", "m", "--output", "o"], ["eval", "m", "--data", "d", "--compare", "o"],
                                  ["quantize", "m", "--method", "int8", "--output", "o"]], ids=lambda a: a[0])
def test_every_max_kl_flag_defaults_to_the_library_threshold(argv):
    """The CLI builds its parsers without importing torch, so it spells the default out: it must stay the one
    the library's comparison uses (docs/QUANTIZATION.md, "Choosing --max-kl")."""
    from entrenar.cli.main import build_parser

    assert build_parser().parse_args(argv).max_kl == MAX_KL
