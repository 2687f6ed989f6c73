"""``entrenar chat``: each reply is greedy generation over the whole conversation rendered with the template."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from cli_helpers import build_chat_model, run_cli, without_chat_template

import entrenar
from entrenar.generation.sampling import generate

CPU = ("--device", "cpu")


@pytest.fixture
def chat_model(hf_folder) -> Path:
    return build_chat_model(hf_folder)


def reply(folder, messages: list[dict[str, str]], max_new_tokens: int) -> str:
    model, tokenizer = entrenar.load(folder, device="cpu")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(generate(model, ids, max_new_tokens, stop_ids=tokenizer.eos_ids))


def chat(capsys, monkeypatch, folder, stdin: str, *argv) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    return run_cli(capsys, "chat", folder, "--max-new-tokens", 10, *CPU, *argv)


def test_each_turn_sees_the_whole_conversation(capsys, monkeypatch, chat_model):
    system = "Answer briefly."
    code, out, err = chat(capsys, monkeypatch, chat_model, "What is the capital?\nAnd of France?\n/exit\nignored\n",
                          "--system", system)
    assert (code, err) == (0, "")
    history = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital?"}]
    first = reply(chat_model, history, 10)
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And of France?"}]
    second = reply(chat_model, history, 10)
    assert out == f"{first}\n{second}\n"
    assert second != reply(chat_model, [{"role": "system", "content": system}, history[-1]], 10)  # history mattered


def test_reset_forgets_and_end_of_input_quits(capsys, monkeypatch, chat_model):
    code, out, _ = chat(capsys, monkeypatch, chat_model, "the lazy dog\n\n/reset\nthe lazy dog\n")
    assert code == 0
    alone = reply(chat_model, [{"role": "user", "content": "the lazy dog"}], 10)
    assert out == f"{alone}\n{alone}\n"  # the blank line is skipped; after /reset the turn starts afresh


def test_no_chat_template_fails_before_reading_input(capsys, monkeypatch, chat_model):
    without_chat_template(chat_model)
    code, out, err = chat(capsys, monkeypatch, chat_model, "hello\n")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {chat_model}: the tokenizer has no chat template")


def test_ctrl_c_stops_a_reply_and_drops_its_turn(capsys, monkeypatch, chat_model):
    """Ctrl-C while a reply streams ends that reply; the chat goes on without the interrupted turn."""
    from entrenar.cli import chat as chat_command

    real = chat_command.stream_generate
    calls = []

    def interrupted_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(chat_command, "stream_generate", interrupted_once)
    code, out, err = chat(capsys, monkeypatch, chat_model, "What is the capital?\nthe lazy dog\n")
    assert code == 0 and "reply stopped" in err
    alone = reply(chat_model, [{"role": "user", "content": "the lazy dog"}], 10)
    assert out == f"\n{alone}\n"  # the second turn does not see the first


def test_slash_commands_never_reach_the_model(capsys, monkeypatch, chat_model):
    """/help answers itself, an unknown /word is named (with the close command), /quit quits; // sends a message
    that begins with a slash."""
    code, out, err = chat(capsys, monkeypatch, chat_model, "/help\n/rest\n//etc\n/quit\nignored\n")
    assert code == 0
    assert out == reply(chat_model, [{"role": "user", "content": "/etc"}], 10) + "\n"  # one turn only
    help_line, unknown = err.splitlines()
    assert "/reset clears the conversation" in help_line and "/quit" in help_line
    assert unknown.startswith("unknown command /rest; did you mean /reset?")
