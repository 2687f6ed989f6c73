"""Turn records into training examples: token ids and labels, with -100 where no loss is taken.

Three kinds of record:

- ``{"text": ...}``: language modelling on the whole text.
- ``{"prompt": ..., "completion": ...}``: the prompt and the completion are
  tokenized apart and joined, so the boundary is where it is at inference time
  (the prompt alone, then generated tokens). ``train_on="completion"`` masks the
  prompt.
- ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the
  tokenizer's chat template. ``train_on="completion"`` keeps loss only on
  assistant turns, from the end of the generation prompt through the
  end-of-turn token: the character spans come from rendering the conversation
  prefix by prefix (``templates.assistant_spans``), and tokens whose text
  starts inside a span are trained.

Alpaca and ShareGPT records (``kind``, the recipe's ``data.format``) are first converted to one of these
(:mod:`entrenar.data.formats`), so they are masked exactly as ``messages`` or prompt/completion records are.

Labels are aligned with ``input_ids`` (the loss shifts them). ``add_eos``
appends EOS to text and completion examples; chat templates write their own
end-of-turn tokens.

Records that are legal but likely mistakes (empty text or completion, an
unknown chat role, null content, two assistant turns in a row, a NUL character,
fields of two kinds in one record) are taken as written and counted by kind in
``TokenizeStats.suspicious``. Text a tokenizer would get with a lone surrogate or
a byte-order mark inside is refused (:func:`check_text`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from entrenar.data import formats
from entrenar.data.formats import RecordError
from entrenar.data.sources import Record, Skip
from entrenar.data.templates import assistant_spans, render_chat
from entrenar.errors import ConfigError, DataError

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer

IGNORE_INDEX = -100
KINDS = ("auto", *formats.RECORD_FORMATS)  # formats by name (:mod:`entrenar.data.formats`)
TRAIN_ON = ("all", "completion")
_MAX_REPORTED = 10
# A plain-text record has no prompt to mask: under train_on completion every token of it is trained.
PLAIN_UNDER_COMPLETION = "plain text under train_on: completion (no prompt to mask: every token trained)"
# Roles the common chat templates know (OpenAI's, Llama 3's ipython, the older function); others are likely typos.
KNOWN_ROLES = frozenset({"system", "user", "assistant", "tool", "developer", "function", "ipython"})


@dataclass(frozen=True)
class Example:
    """One tokenized example; ``origin`` names the record it came from."""

    input_ids: list[int]
    labels: list[int]
    origin: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        """Tokens that carry loss once labels are shifted (the first label is never predicted)."""
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


@dataclass
class TokenizeStats:
    """Counts from tokenization: what was kept, skipped, cut or dropped."""

    examples: int = 0
    tokens: int = 0
    target_tokens: int = 0
    skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)
    truncated_examples: int = 0
    truncated_tokens: int = 0
    dropped_no_targets: int = 0
    skipped_records: list[Skip] = field(default_factory=list)  # every skipped record
    suspicious: dict[str, tuple[int, str]] = field(default_factory=dict)  # kind -> (count, first where)

    def suspect(self, kind: str, where: str) -> None:
        count, first = self.suspicious.get(kind, (0, where))
        self.suspicious[kind] = (count + 1, first)


def tokenize_record(
    record: Record | Mapping[str, Any],
    tokenizer: Tokenizer,
    *,
    kind: str = "auto",
    train_on: str = "all",
    add_eos: bool = True,
    columns: Mapping[str, str] | None = None,
) -> Example:
    """Tokenize one record (untruncated). ``columns`` maps ``text``/``prompt``/``completion``/``messages``
    to the record's own field names, e.g. ``{"prompt": "instruction", "completion": "output"}``.

    ``train_on`` defaults to ``"all"``, as the recipe's ``data.train_on`` does;
    ``"completion"`` masks prompts and non-assistant turns."""
    if kind not in KINDS:
        raise ConfigError(f"data kind {kind!r} is not one of {', '.join(KINDS)}")
    if train_on not in TRAIN_ON:
        raise ConfigError(f"train_on {train_on!r} is not one of {', '.join(TRAIN_ON)}")
    if isinstance(record, Record):
        fields, where = record.fields, record.where
    else:
        fields, where = dict(record), "record"
    names = _columns(columns)
    return _tokenize(fields, where, tokenizer, kind, train_on, add_eos, names)[0]


def _tokenize(fields: Mapping[str, Any], where: str, tokenizer: Tokenizer, kind: str, train_on: str, add_eos: bool,
              names: Mapping[str, str]) -> tuple[Example, list[str]]:
    """The example of one record, and the likely mistakes it holds (kinds of ``TokenizeStats.suspicious``)."""
    suspicions = []
    if kind == "auto":
        kind = _detect_kind(fields, names, where)
        shown = {"messages": f"'{names['messages']}'", "text": f"'{names['text']}'",
                 "prompt_completion": f"'{names['prompt']}'/'{names['completion']}'"}
        present = [shown[k] for k, fs in (("messages", ["messages"]), ("prompt_completion", ["prompt", "completion"]),
                                          ("text", ["text"])) if any(names[f] in fields for f in fs)]
        if len(present) > 1:
            suspicions.append(f"both {' and '.join(present)} ({shown.get(kind, kind)} used)")
    else:
        formats.check_keys(fields, kind, names, where)
    kind, fields = formats.standardize(fields, kind, names, where, tokenizer.chat_template is not None)
    if kind == "text":
        text = _string_field(fields, names["text"], where)
        if not text.strip():
            suspicions.append("empty text")
        suspicions += _nul(text)
        if train_on == "completion":
            suspicions.append(PLAIN_UNDER_COMPLETION)
        ids = _encode(tokenizer, text, True, where, names["text"])
        ids = _with_eos(ids, tokenizer, add_eos, where)
        return Example(ids, list(ids), where), suspicions
    if kind == "prompt_completion":
        prompt = _encode(tokenizer, _string_field(fields, names["prompt"], where), True, where, names["prompt"])
        completion_text = _string_field(fields, names["completion"], where)
        if not completion_text.strip():
            suspicions.append("empty completion")
        suspicions += _nul(fields[names["prompt"]] + completion_text)
        completion = _encode(tokenizer, completion_text, False, where, names["completion"])
        completion = _with_eos(completion, tokenizer, add_eos, where)
        prompt_labels = [IGNORE_INDEX] * len(prompt) if train_on == "completion" else list(prompt)
        return Example(prompt + completion, prompt_labels + completion, where), suspicions
    messages = _messages_field(fields, names["messages"], where)
    for role in sorted({m["role"] for m in messages} - KNOWN_ROLES):
        # Templates compare roles as written: 'USER' is not 'user'.
        hint = f" (roles are case-sensitive: {role.lower()!r}?)" if role.lower() in KNOWN_ROLES else ""
        suspicions.append(f"unknown chat role {role[:40]!r}{hint}")
    if any(m.get("content") is None for m in messages):
        suspicions.append("null message content")
    if any(a["role"] == b["role"] == "assistant" for a, b in zip(messages, messages[1:], strict=False)):
        suspicions.append("two assistant turns in a row")
    suspicions += _nul("".join(m["content"] for m in messages if isinstance(m.get("content"), str)))
    return _tokenize_chat(messages, tokenizer, train_on, where), suspicions


def tokenize_records(
    records: Iterable[Record | Mapping[str, Any]],
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    kind: str = "auto",
    train_on: str = "all",
    add_eos: bool = True,
    columns: Mapping[str, str] | None = None,
    on_error: str = "raise",
) -> tuple[list[Example], TokenizeStats]:
    """Tokenize records and truncate each to ``seq_len`` tokens (the start is kept).

    Examples left with no token that carries loss (e.g. a prompt longer than
    ``seq_len``) are dropped and counted: they would cost compute and teach
    nothing. Bad records raise ``DataError`` or, with ``on_error="skip"``, are
    skipped and counted.
    """
    if seq_len < 2:
        raise ConfigError(f"seq_len must be at least 2 (one input and one target), got {seq_len}")
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error {on_error!r} must be 'raise' or 'skip'")
    stats = TokenizeStats()
    examples: list[Example] = []
    names = _columns(columns)
    if kind not in KINDS:
        raise ConfigError(f"data kind {kind!r} is not one of {', '.join(KINDS)}")
    if train_on not in TRAIN_ON:
        raise ConfigError(f"train_on {train_on!r} is not one of {', '.join(TRAIN_ON)}")
    plain_file: str | None = None  # the first file with a plain-text record under train_on completion
    for index, record in enumerate(records):
        if not isinstance(record, Record):
            record = Record(dict(record), "records", f"item {index}")
        try:
            example, suspicions = _tokenize(record.fields, record.where, tokenizer, kind, train_on, add_eos, names)
        except DataError as e:
            if on_error == "raise":
                raise
            stats.skipped += 1
            stats.skipped_records.append(Skip(record.file, record.location, getattr(e, "reason", "bad record"), str(e)))
            if len(stats.skip_reasons) < _MAX_REPORTED:
                stats.skip_reasons.append(str(e))
            continue
        for suspicion in suspicions:
            stats.suspect(suspicion, record.where)
        plain_file = plain_file or (record.file if PLAIN_UNDER_COMPLETION in suspicions else None)
        if len(example) > seq_len:
            stats.truncated_examples += 1
            stats.truncated_tokens += len(example) - seq_len
            example = Example(example.input_ids[:seq_len], example.labels[:seq_len], example.origin)
        if example.num_targets == 0:
            stats.dropped_no_targets += 1
            continue
        examples.append(example)
        stats.tokens += len(example)
        stats.target_tokens += example.num_targets
    stats.examples = len(examples)
    plain = stats.suspicious.get(PLAIN_UNDER_COMPLETION, (0, ""))[0]
    if plain and plain == stats.examples + stats.dropped_no_targets:
        raise ConfigError(f"data.train_on: completion masks prompts, and the records of {plain_file} "
                          "are plain text (data.format: text) with no prompt to mask, so every token would be "
                          "trained; set data.train_on: all, or give records with a prompt (prompt_completion, "
                          "alpaca, messages, sharegpt)")
    if not examples:
        raise DataError(
            f"no training examples left after tokenization ({stats.skipped} skipped, "
            f"{stats.dropped_no_targets} with no tokens to train on within seq_len={seq_len})"
            + (f"; first skipped: {stats.skip_reasons[0]}" if stats.skip_reasons else "")
        )
    return examples, stats


def _columns(columns: Mapping[str, str] | None) -> dict[str, str]:
    names = {name: name for name in ("text", "prompt", "completion", "messages")}
    unknown = sorted(set(columns or {}) - set(names))
    if unknown:
        raise ConfigError(f"columns {unknown} are not among {sorted(names)} (map these names to your fields)")
    names.update(columns or {})
    return names


def _encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool, where: str, name: str) -> list[int]:
    return tokenizer.encode(check_text(text, where, name), add_special_tokens=add_special_tokens)


def check_text(text: str, where: str, name: str) -> str:
    """``text`` if a tokenizer may take it as written, else a ``RecordError`` naming ``where`` and field ``name``.

    A lone surrogate (JSON's ``"\\ud800"`` read alone) is not Unicode a tokenizer can take; a byte-order mark
    (U+FEFF) inside text is almost always two files joined together (a BOM belongs only at a file's very start,
    where readers strip it) and would be trained on as a token."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RecordError("invalid text", f"{where}: field '{name}' is not valid Unicode text: "
                                          f"{ascii(text[e.start])[1:-1]} at character {e.start} is a lone "
                                          "surrogate") from None
    bom = text.find("\ufeff")
    if bom >= 0:
        raise RecordError("byte-order mark", f"{where}: field '{name}' holds a byte-order mark (U+FEFF) at "
                                             f"character {bom}, which belongs only at the start of a file: "
                                             "files joined together?")
    return text


def _nul(text: str) -> list[str]:
    """The likely mistake of a NUL character in text (legal, but a sign of binary data or a broken export)."""
    return ["NUL character (U+0000) in text"] if "\x00" in text else []


def _detect_kind(fields: Mapping[str, Any], names: Mapping[str, str], where: str) -> str:
    found = formats.detect(fields, names)
    if found is not None:
        return found
    wanted = (f"'{names['text']}', '{names['prompt']}'+'{names['completion']}' or '{names['messages']}' (nor "
              "'conversations' of sharegpt, 'instruction'+'output' of alpaca)")
    raise RecordError("no known fields",
                      f"{where}: record has none of the fields {wanted} (it has {sorted(fields)[:10]})")


def _string_field(fields: Mapping[str, Any], name: str, where: str) -> str:
    if name not in fields:
        raise RecordError("missing field", f"{where}: missing field '{name}' (the record has {sorted(fields)[:10]})")
    value = fields[name]
    if not isinstance(value, str):
        raise RecordError("field not a string", f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    return value


def _messages_field(fields: Mapping[str, Any], name: str, where: str) -> list[dict[str, Any]]:
    if name not in fields:
        raise RecordError("missing field", f"{where}: missing field '{name}' (the record has {sorted(fields)[:10]})")
    messages = fields[name]
    if not isinstance(messages, list) or not messages:
        raise RecordError("bad messages",
                          f"{where}: field '{name}' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RecordError("bad messages", f"{where}: {name}[{i}] must be an object with a string 'role'")
        if not isinstance(message.get("content"), (str, type(None))):
            raise RecordError("bad messages", f"{where}: {name}[{i}].content must be a string, "
                                              f"got {type(message['content']).__name__}")
    return [dict(m) for m in messages]


def _null_content(messages: Sequence[Mapping[str, Any]]) -> str:
    """Where a conversation has null content, said after a template's error (the usual cause of it)."""
    nulls = [i for i, m in enumerate(messages) if m.get("content") is None]
    return f" (content of message {', '.join(map(str, nulls))} is null)" if nulls else ""


def _with_eos(ids: list[int], tokenizer: Tokenizer, add_eos: bool, where: str) -> list[int]:
    if not add_eos:
        return ids
    eos = tokenizer.eos_id
    if eos is None:
        raise DataError(f"{where}: add_eos is set but the tokenizer has no EOS token")
    return ids if ids and ids[-1] == eos else ids + [eos]


def _tokenize_chat(messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, train_on: str, where: str) -> Example:
    template = tokenizer.chat_template
    if template is None:
        raise RecordError("no chat template",
                          f"{where}: a 'messages' record needs a chat template, and the tokenizer has none")
    if train_on == "all":
        try:
            text = render_chat(template, messages, False, tokenizer.special_tokens, where)
        except DataError as e:
            raise RecordError("chat template rejected it", str(e) + _null_content(messages)) from None
        # The template writes BOS itself where the model wants one, as in transformers.
        ids = _encode(tokenizer, text, False, where, "messages")
        return Example(ids, list(ids), where)
    if not any(m["role"] == "assistant" for m in messages):
        raise RecordError("no assistant message",
                          f"{where}: train_on='completion' but the conversation has no assistant message")
    try:
        text, spans = assistant_spans(template, messages, tokenizer.special_tokens, where)
    except RecordError:
        raise
    except DataError as e:
        raise RecordError("chat template rejected it", str(e) + _null_content(messages)) from None
    ids, offsets = tokenizer.encode_with_offsets(check_text(text, where, "messages"), add_special_tokens=False)
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for i, (start, _end) in enumerate(offsets):
        # Offsets increase along the text, so one pass over the sorted spans suffices.
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span < len(spans) and spans[span][0] <= start:
            labels[i] = ids[i]
    return Example(ids, labels, where)
