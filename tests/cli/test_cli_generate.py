"""``entrenar generate``: what it prints is ``entrenar.generation.sampling.generate``'s output, decoded, as it
streams."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from cli_helpers import build_chat_model, run_cli, without_chat_template

import entrenar
from entrenar.adapters.lora import LoraConfig, apply_lora, save_adapter
from entrenar.cli.stream import TokenStream
from entrenar.generation.sampling import generate

PROMPT = "The quick brown fox"
CPU = ("--device", "cpu")  # the reference runs on CPU in fp32; so must the command, GPU or not


@pytest.fixture
def chat_model(hf_folder) -> Path:
    return build_chat_model(hf_folder)


def reference(folder, prompt_ids=None, adapter=None, **kwargs) -> str:
    model, tokenizer = entrenar.load(folder, adapter=adapter, device="cpu")
    ids = tokenizer.encode(PROMPT) if prompt_ids is None else prompt_ids
    return tokenizer.decode(generate(model, ids, stop_ids=tokenizer.eos_ids, **kwargs))


def test_greedy_output_equals_generate(capsys, chat_model):
    code, out, err = run_cli(capsys, "generate", chat_model, "--prompt", PROMPT, "--max-new-tokens", 20, *CPU)
    assert (code, err) == (0, "")
    expected = reference(chat_model, max_new_tokens=20)
    assert expected  # a random tiny model may emit special tokens, but not only those
    assert out == expected + "\n"


def test_sampling_options_reach_generate(capsys, chat_model):
    argv = ["--max-new-tokens", 15, "--temperature", 1.5, "--top-p", 0.9, "--seed", 3, *CPU]
    code, out, _ = run_cli(capsys, "generate", chat_model, "--prompt", PROMPT, *argv)
    assert code == 0
    assert out == reference(chat_model, max_new_tokens=15, temperature=1.5, top_p=0.9, seed=3) + "\n"
    assert out != reference(chat_model, max_new_tokens=15, temperature=1.5, top_p=0.9, seed=4) + "\n"


def test_chat_wraps_the_prompt_in_the_template(capsys, chat_model):
    _, tokenizer = entrenar.load(chat_model)
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    code, out, _ = run_cli(capsys, "generate", chat_model, "--prompt", PROMPT, "--chat", "--max-new-tokens", 20, *CPU)
    assert code == 0
    assert out == reference(chat_model, tokenizer.encode(text, add_special_tokens=False), max_new_tokens=20) + "\n"


def test_chat_without_a_template_is_a_clear_error(capsys, chat_model):
    without_chat_template(chat_model)
    code, out, err = run_cli(capsys, "generate", chat_model, "--prompt", PROMPT, "--chat")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {chat_model}: the tokenizer has no chat template") and err.count("\n") == 1


def test_generation_stops_at_an_eos_id_from_generation_config(capsys, chat_model):
    model, tokenizer = entrenar.load(chat_model)
    free = generate(model, tokenizer.encode(PROMPT), max_new_tokens=12)
    stop = free[4]
    (chat_model / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_id, stop]}))
    code, out, _ = run_cli(capsys, "generate", chat_model, "--prompt", PROMPT, "--max-new-tokens", 12, *CPU)
    assert code == 0
    assert out == tokenizer.decode(free[: free.index(stop)]) + "\n"
    assert len(out) < len(tokenizer.decode(free)) + 1


def test_adapter_is_applied(capsys, chat_model, tmp_path):
    model, _ = entrenar.load(chat_model)
    cfg = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    apply_lora(model, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # B starts at zero; make the adapter change the output
    adapter = save_adapter(model, tmp_path / "adapter", cfg)
    code, out, _ = run_cli(capsys, "generate", chat_model, "--adapter", adapter, "--prompt", PROMPT,
                           "--max-new-tokens", 20, *CPU)
    assert code == 0
    assert out == reference(chat_model, adapter=adapter, max_new_tokens=20) + "\n"
    assert out != reference(chat_model, max_new_tokens=20) + "\n"


def test_missing_model_folder_names_it(capsys, tmp_path):
    code, out, err = run_cli(capsys, "generate", tmp_path / "nope", "--prompt", "hi")
    assert (code, out, err) == (2, "", f"error: {tmp_path / 'nope'}: no such model folder or .gguf file\n")


@pytest.mark.parametrize("text", ["héllo wörld ✓ 日本 🙂", "plain ascii only"])
def test_stream_never_prints_a_broken_character(text):
    from tiny_chat_tokenizer import chat_tokenizer

    tokenizer = chat_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = io.StringIO()
    chunks: list[str] = []
    out.write = chunks.append  # type: ignore[method-assign]
    stream = TokenStream(tokenizer, out)
    for token in ids:
        stream(token)
    assert stream.finish() == text
    assert "".join(chunks) == text
    assert not any("\ufffd" in chunk for chunk in chunks)
    if not text.isascii():  # the case that matters: single tokens here are parts of characters
        assert any("\ufffd" in tokenizer.decode([token]) for token in ids)


def test_prompt_dash_reads_standard_input(capsys, monkeypatch, chat_model):
    """``--prompt -``: the prompt is stdin less its final newline (what ``echo ... |`` adds); empty stdin is an
    error before the model loads."""
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT + "\n"))
    code, out, err = run_cli(capsys, "generate", chat_model, "--prompt", "-", "--max-new-tokens", 20, *CPU)
    assert (code, err) == (0, "") and out == reference(chat_model, max_new_tokens=20) + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code, out, err = run_cli(capsys, "generate", tmp := chat_model / "missing", "--prompt", "-")
    assert (code, out) == (2, "") and err.startswith("error: --prompt -: standard input is empty") and not tmp.exists()


def test_cuda_graphs_option(capsys, chat_model):
    """--cuda-graphs false is the eager path (the same text); true on a CPU is refused, naming why."""
    code, out, _ = run_cli(capsys, "generate", chat_model, "--prompt", PROMPT, "--max-new-tokens", 12,
                           "--cuda-graphs", "false", *CPU)
    assert code == 0 and out == reference(chat_model, max_new_tokens=12) + "\n"
    code, out, err = run_cli(capsys, "generate", chat_model, "--prompt", PROMPT, "--cuda-graphs", "true", *CPU)
    assert (code, out) == (2, "")
    assert "cuda_graphs is true, but the decode step cannot replay from a CUDA graph" in err and "cpu" in err
