"""Export verification runs each GGUF through llama.cpp itself (llama-cpp-python, an optional extra).

llama.cpp is the reference nobody here wrote: its own tensor layout, RoPE, tokenizer and end-of-generation rules
read the file entrenar's exporter wrote. A clean f16 / q8_0 export of a tiny random Llama (base + LoRA) must give
llama.cpp the trained model's logits on the same token ids; a tensor corrupted in the file, a special token no
longer marked special and a wrong EOS id must each be flagged in the llama.cpp section. Skipped where
llama-cpp-python is not installed (CI: it compiles llama.cpp); the one test that needs no llama.cpp checks the
report says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from entrenar.export.verify import export_verified, report_path, verify_export

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_export import make_adapter, make_base  # noqa: E402

# The tiny model's next-token distributions are near uniform, so KLs are small: the gguf reader's q8_0 check sits
# near 1e-6 nats/token and a corrupted tensor near 1e-2 (tests/test_export_verify.py); the same threshold is used.
MAX_KL = 1e-3


def needs_llama_cpp() -> None:
    pytest.importorskip("llama_cpp")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A base, an adapter, and an f16 and a q8_0 GGUF of their merge, each verified as exported."""
    pytest.importorskip("llama_cpp")
    d = tmp_path_factory.mktemp("cpp")
    base = make_base(d / "base")
    adapter = make_adapter(base, d / "adapter")
    reports = {q: export_verified(base, adapter, d / f"model-{q}.gguf", gguf=q, max_kl=MAX_KL)[1]
               for q in ("f16", "q8_0")}
    return base, adapter, d, reports


@pytest.mark.parametrize("qtype", ["f16", "q8_0"])
def test_llama_cpp_runs_a_clean_export_as_the_trained_model(exports, qtype):
    base, adapter, d, reports = exports
    report = reports[qtype]
    assert report.problems == [] and report.llama_cpp.startswith("llama-cpp-python 0.")
    (reader,), (cpp,) = report.checks, report.llama_cpp_checks
    c, r = cpp.comparison, reader.comparison
    assert cpp.path == d / f"model-{qtype}.gguf" and cpp.reader.startswith("llama.cpp")
    assert c.tokens == r.tokens >= 100 and c.reference_loss == r.reference_loss
    # llama.cpp's logits on the same ids are the trained model's, to the file's rounding: f16 weights (and
    # llama.cpp's f16 activations in its matmuls) cost ~1e-6 nats/token, q8_0 a little more; a fault is 1e-2+.
    assert c.kl < (1e-5 if qtype == "f16" else 1e-4)
    assert abs(c.candidate_loss - c.reference_loss) < 2e-3
    # Near-uniform distributions make top-1 fragile where two logits almost tie; still nearly all agree.
    assert c.top1_agreement >= 0.95
    assert c.chat_template_same is True and set(c.special_tokens.values()) == {"ok"}
    assert c.eos["missing"] == [] and {1, 3} <= set(c.eos["candidate"])
    assert len(c.continuations) == 2
    saved = json.loads(report_path(d / f"model-{qtype}.gguf").read_text())
    assert saved["llama.cpp"]["version"] == report.llama_cpp and saved["llama.cpp"]["checks"][0]["kl"] == c.kl
    assert "llama.cpp" in "\n".join(report.lines())


def planted(exports, tmp_path: Path, edit) -> Path:
    """A copy of the f16 export with ``edit(reader)`` applied in place through the gguf package's reader."""
    _, _, d, _ = exports
    bad = tmp_path / "bad.gguf"
    bad.write_bytes((d / "model-f16.gguf").read_bytes())
    reader = gguf.GGUFReader(bad, "r+")
    edit(reader)
    reader.data.flush()
    del reader
    return bad


def test_a_corrupted_tensor_is_flagged_by_llama_cpp(exports, tmp_path):
    def scale(reader):
        tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
        tensor.data[:] *= np.float16(-8)

    base, adapter, _, _ = exports
    report = verify_export(base, adapter, [planted(exports, tmp_path, scale)], max_kl=MAX_KL)
    (cpp,) = report.llama_cpp_checks
    assert cpp.comparison.kl > MAX_KL
    assert any(p.startswith("bad.gguf in llama.cpp: KL divergence") for p in report.problems)


@pytest.mark.parametrize(("token_id", "name"), [(0, "bos_token")])
def test_a_special_token_llama_cpp_no_longer_parses_is_flagged(exports, tmp_path, token_id, name):
    """BOS marked a normal token: llama.cpp then splits its text into pieces (a converter's mistake: a prompt's
    special token text is no longer the token the model was trained on). EOS and <|im_end|> would not do here:
    llama.cpp marks the end-of-generation texts it knows as control tokens itself, whatever the file says."""

    def unmark(reader):
        types = reader.fields["tokenizer.ggml.token_type"]
        types.parts[types.data[token_id]][:] = gguf.TokenType.NORMAL

    base, adapter, _, _ = exports
    report = verify_export(base, adapter, [planted(exports, tmp_path, unmark)], max_kl=MAX_KL)
    (cpp,) = report.llama_cpp_checks
    assert cpp.comparison.special_tokens[name] != "ok"
    assert f"bad.gguf in llama.cpp: special token {name}: " + cpp.comparison.special_tokens[name] in report.problems


def test_a_wrong_eos_id_is_flagged_by_llama_cpp(exports, tmp_path):
    """``tokenizer.ggml.eos_token_id`` pointing at another token. llama.cpp also ends generations on the texts it
    knows as end markers (``<|end_of_text|>``, ``<|im_end|>``...), which would hide the fault here, so EOS's text is
    also renamed to one it does not know (as a model whose EOS is some other text would be)."""

    def wrong_eos(reader):
        field = reader.fields["tokenizer.ggml.eos_token_id"]
        field.parts[field.data[0]][:] = 2  # <|im_start|>: EOS (1) no longer ends a generation
        tokens = reader.fields["tokenizer.ggml.tokens"]
        text = tokens.parts[tokens.data[1]]
        assert bytes(text) == b"<|end_of_text|>"
        text[:] = np.frombuffer(b"<|end_of_texx|>", dtype=np.uint8)

    base, adapter, _, _ = exports
    report = verify_export(base, adapter, [planted(exports, tmp_path, wrong_eos)], max_kl=MAX_KL)
    (cpp,) = report.llama_cpp_checks
    assert 1 in cpp.comparison.eos["missing"]
    assert any(p.startswith("bad.gguf in llama.cpp: token ids [1] end the trained model") for p in report.problems)


def test_without_llama_cpp_the_report_says_so(tmp_path, monkeypatch):
    import entrenar.export.verify as verify

    monkeypatch.setattr(verify, "llama_cpp_version", lambda: None)
    base = make_base(tmp_path / "base")
    _, report = export_verified(base, None, tmp_path / "m.gguf", gguf="f16", max_kl=MAX_KL)
    assert report.llama_cpp_checks == [] and report.problems == []
    assert "llama.cpp: not installed (pip install llama-cpp-python)" in report.lines()
    saved = json.loads(report_path(tmp_path / "m.gguf").read_text())
    assert saved["llama.cpp"] == {"version": "not installed (pip install llama-cpp-python)", "checks": []}
