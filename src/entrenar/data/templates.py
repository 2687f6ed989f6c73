"""Chat templates: render a conversation to text, and find where the assistant spoke.

Chat templates ship with models as Jinja source and are untrusted code, so they
run in jinja2's immutable sandbox with the same environment Hugging Face
transformers gives them (``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``strftime_now``, a non-escaping ``tojson``, loop controls, and the
``{% generation %}`` tag, rendered here as a plain block). Rendering the same
template with the same inputs therefore gives the same text as
``transformers``' ``apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from entrenar.errors import DataError, ModelError

Message = Mapping[str, Any]


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged.

    Some templates mark assistant text with this tag for transformers' assistant
    masks; we find assistant spans by rendering prefixes instead, so the tag only
    has to parse.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ', which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"chat template line {e.lineno}: syntax error: {e.message}") from e


def render_chat(
    template: str,
    messages: Sequence[Message],
    add_generation_prompt: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    where: str = "conversation",
) -> str:
    """Render ``messages`` with the Jinja chat ``template``.

    ``special_tokens`` (``bos_token``, ``eos_token``, ...) are visible to the
    template as variables, as transformers passes them. A template that rejects
    the conversation (``raise_exception``) raises ``DataError`` naming ``where``.
    """
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=list(messages),
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **dict(special_tokens or {}),
        )
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(f"chat template tried something the sandbox forbids: {e}") from e
    except jinja2.TemplateError as e:
        raise DataError(f"{where}: the chat template rejected it: {e}") from e
    except (ArithmeticError, AttributeError, LookupError, TypeError, ValueError, RecursionError) as e:
        # The template's own code failed on this conversation (e.g. `content + '...'` with null content).
        raise DataError(f"{where}: the chat template failed on it: {type(e).__name__}: {e}") from e


def assistant_spans(
    template: str,
    messages: Sequence[Message],
    special_tokens: Mapping[str, str] | None = None,
    where: str = "conversation",
) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and return ``(text, spans)``: character spans of assistant turns.

    A span starts where the template's generation prompt ends (so role headers
    are excluded) and runs through the end-of-turn marker, without trailing
    whitespace. It is found by rendering the conversation prefix by prefix:
    ``render(messages[:i], add_generation_prompt=True)`` ends where turn ``i``
    starts and ``render(messages[:i+1])`` ends where it stops. That needs a
    template whose output for a prefix of the conversation is a prefix of its
    output for the whole; templates that rewrite earlier turns (some drop old
    reasoning) are refused with a ``DataError``.
    """
    text = render_chat(template, messages, False, special_tokens, where)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render_chat(template, messages[:i], True, special_tokens, where)
        after = render_chat(template, messages[: i + 1], False, special_tokens, where)
        if not (after.startswith(before) and text.startswith(after)):
            raise DataError(
                f"{where}: cannot locate assistant message {i}: the chat template does not render "
                "the conversation prefix by prefix; use train_on='all' for this template"
            )
        end = len(after.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans
