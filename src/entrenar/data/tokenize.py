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

Labels are aligned with ``input_ids`` (the loss shifts them). ``add_eos``
appends EOS to text and completion examples; chat templates write their own
end-of-turn tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from entrenar.data.sources import Record
from entrenar.data.templates import assistant_spans, render_chat
from entrenar.errors import ConfigError, DataError

if TYPE_CHECKING:
    from entrenar.tokenizer import Tokenizer

IGNORE_INDEX = -100
KINDS = ("auto", "text", "prompt_completion", "messages")
TRAIN_ON = ("all", "completion")
_MAX_REPORTED = 10


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
    names = {name: name for name in ("text", "prompt", "completion", "messages")}
    unknown = sorted(set(columns or {}) - set(names))
    if unknown:
        raise ConfigError(f"columns {unknown} are not among {sorted(names)} (map these names to your fields)")
    names.update(columns or {})

    if kind == "auto":
        kind = _detect_kind(fields, names, where)
    if kind == "text":
        text = _string_field(fields, names["text"], where)
        ids = tokenizer.encode(text, add_special_tokens=True)
        ids = _with_eos(ids, tokenizer, add_eos, where)
        return Example(ids, list(ids), where)
    if kind == "prompt_completion":
        prompt = tokenizer.encode(_string_field(fields, names["prompt"], where), add_special_tokens=True)
        completion = tokenizer.encode(_string_field(fields, names["completion"], where), add_special_tokens=False)
        completion = _with_eos(completion, tokenizer, add_eos, where)
        prompt_labels = [IGNORE_INDEX] * len(prompt) if train_on == "completion" else list(prompt)
        return Example(prompt + completion, prompt_labels + completion, where)
    messages = _messages_field(fields, names["messages"], where)
    return _tokenize_chat(messages, tokenizer, train_on, where)


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
    for index, record in enumerate(records):
        if not isinstance(record, Record):
            record = Record(dict(record), "records", f"item {index}")
        try:
            example = tokenize_record(record, tokenizer, kind=kind, train_on=train_on, add_eos=add_eos, columns=columns)
        except DataError as e:
            if on_error == "raise":
                raise
            stats.skipped += 1
            if len(stats.skip_reasons) < _MAX_REPORTED:
                stats.skip_reasons.append(str(e))
            continue
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
    if not examples:
        raise DataError(
            f"no training examples left after tokenization ({stats.skipped} skipped, "
            f"{stats.dropped_no_targets} with no tokens to train on within seq_len={seq_len})"
            + (f"; first skipped: {stats.skip_reasons[0]}" if stats.skip_reasons else "")
        )
    return examples, stats


def _detect_kind(fields: Mapping[str, Any], names: Mapping[str, str], where: str) -> str:
    if names["messages"] in fields:
        return "messages"
    if names["prompt"] in fields or names["completion"] in fields:
        return "prompt_completion"
    if names["text"] in fields:
        return "text"
    wanted = f"'{names['text']}', '{names['prompt']}'+'{names['completion']}' or '{names['messages']}'"
    raise DataError(f"{where}: record has none of the fields {wanted} (it has {sorted(fields)[:10]})")


def _string_field(fields: Mapping[str, Any], name: str, where: str) -> str:
    if name not in fields:
        raise DataError(f"{where}: missing field '{name}' (the record has {sorted(fields)[:10]})")
    value = fields[name]
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    return value


def _messages_field(fields: Mapping[str, Any], name: str, where: str) -> list[dict[str, Any]]:
    if name not in fields:
        raise DataError(f"{where}: missing field '{name}' (the record has {sorted(fields)[:10]})")
    messages = fields[name]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field '{name}' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise DataError(f"{where}: {name}[{i}] must be an object with a string 'role'")
        if not isinstance(message.get("content"), (str, type(None))):
            raise DataError(f"{where}: {name}[{i}].content must be a string, got {type(message['content']).__name__}")
    return [dict(m) for m in messages]


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
        raise DataError(f"{where}: a 'messages' record needs a chat template, and the tokenizer has none")
    if train_on == "all":
        text = render_chat(template, messages, False, tokenizer.special_tokens, where)
        # The template writes BOS itself where the model wants one, as in transformers.
        ids = tokenizer.encode(text, add_special_tokens=False)
        return Example(ids, list(ids), where)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: train_on='completion' but the conversation has no assistant message")
    text, spans = assistant_spans(template, messages, tokenizer.special_tokens, where)
    ids, offsets = tokenizer.encode_with_offsets(text, add_special_tokens=False)
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for i, (start, _end) in enumerate(offsets):
        # Offsets increase along the text, so one pass over the sorted spans suffices.
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span < len(spans) and spans[span][0] <= start:
            labels[i] = ids[i]
    return Example(ids, labels, where)
