"""Chat-template rendering: the sandbox, the helpers templates use, and where assistant turns are."""

from __future__ import annotations

import datetime

import pytest

from entrenar.data.templates import assistant_spans, render_chat
from entrenar.errors import DataError, ModelError

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao  "}]
PLAIN = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_assistant_spans_cover_content_and_end_of_turn():
    text, spans = assistant_spans(PLAIN, CHAT)
    assert text == "<user>hi</s>\n<assistant>hello</s>\n<user>bye</s>\n<assistant>ciao  </s>\n"
    # From after the generation prompt through the end-of-turn marker; the newline after it is not trained.
    assert [text[a:b] for a, b in spans] == ["hello</s>", "ciao  </s>"]


def test_syntax_error_names_the_template_line():
    with pytest.raises(ModelError, match="chat template line 2: syntax error"):
        render_chat("{% for m in messages %}\n{% endfor", CHAT)


def test_sandbox_refuses_python_internals():
    with pytest.raises(ModelError, match="sandbox forbids"):
        render_chat("{{ raise_exception.__globals__['__builtins__'] }}", CHAT)


def test_special_tokens_and_strftime_now_are_available():
    out = render_chat("{{ bos_token }}{{ strftime_now('%Y') }}", CHAT, special_tokens={"bos_token": "<s>"})
    assert out == "<s>" + datetime.datetime.now().strftime("%Y")


def test_rejection_by_the_template_names_the_record():
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('need a system message') }}{% endif %}"
    with pytest.raises(DataError, match="train.jsonl line 4: the chat template rejected it: need a system message"):
        render_chat(template, CHAT, where="train.jsonl line 4")
