"""A tiny chat model folder for the CLI tests: conftest's random Llama saved with the tiny ChatML tokenizer.

A helper module, not a conftest (tests/conftest.py is imported by name elsewhere).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data"))
from tiny_chat_tokenizer import BOS, EOS, chat_backend, chat_tokenizer

from entrenar.data.tokenizer import Tokenizer


def build_chat_model(hf_folder) -> Path:
    """A model folder (from conftest's ``hf_folder`` fixture) whose vocabulary and special ids are the
    tokenizer's, with a chat template."""
    tokenizer = chat_tokenizer()
    folder, _ = hf_folder("llama", vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_id,
                          eos_token_id=tokenizer.eos_id)
    tokenizer.save(folder)
    return folder


def without_chat_template(folder: Path) -> Path:
    """Replace the folder's tokenizer with the same one lacking a chat template."""
    Tokenizer(chat_backend(), bos_token=BOS, eos_token=EOS).save(folder)
    return folder


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attributes) -> types.ModuleType:
    """Stand in for the library module ``name`` (the CLI imports it lazily, so it finds this one)."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def run_cli(capsys: pytest.CaptureFixture, *argv: object) -> tuple[int, str, str]:
    """``main(argv)`` -> (exit code, stdout, stderr), ignoring what fixtures printed before it."""
    from entrenar.cli.main import main

    capsys.readouterr()  # transformers' save_pretrained draws a progress bar on stderr
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err
