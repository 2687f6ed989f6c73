"""Record formats by name (``data.format``): what fields a record has and how they become a training example.

Five formats, the names Axolotl, LLaMA-Factory and TRL users know:

- ``text``: ``{"text": ...}``, language modelling on every token.
- ``prompt_completion``: ``{"prompt": ..., "completion": ...}``.
- ``messages`` (OpenAI): ``{"messages": [{"role": ..., "content": ...}, ...]}``, rendered by the chat template.
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}``; roles
  ``system``, ``human``/``user``, ``gpt``/``assistant`` and ``tool``; any other is an error naming it.
  Converted to ``messages``.
- ``alpaca``: ``{"instruction": ..., "input": ..., "output": ...}`` (``input`` and ``system`` optional). With a
  chat template (the tokenizer has one) it is a conversation, as ``messages`` records are: an optional system
  turn, the user turn ``instruction`` (then a newline and ``input`` when it is not empty, as LLaMA-Factory joins
  them) and the assistant turn ``output``. Without one it is ``prompt_completion`` with Stanford Alpaca's prompt
  (:data:`ALPACA_PROMPT`; a ``system`` field replaces its first sentence) and ``output`` as the completion.

``auto`` (the default) reads each record by its keys, the first that fits in the order of :data:`RECORD_FORMATS`.
A named format takes every record as that format; a record missing one of its keys is an error naming the key, the
format, and the format the record's keys fit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from entrenar.errors import DataError

# In the order auto tries them: the most specific keys first.
RECORD_FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")
FILE_FORMATS = ("jsonl", "json", "csv", "parquet")
DATA_FORMATS = ("auto", "alpaca", "sharegpt", "messages", "prompt_completion", "text", *FILE_FORMATS)
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool"}
ALPACA_PREAMBLE = "Below is an instruction that describes a task{}. Write a response that appropriately completes " \
                  "the request."
# Stanford Alpaca's two prompts (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT).
ALPACA_PROMPT = ("{preamble}\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                 "{preamble}\n\n### Instruction:\n{instruction}\n\n### Response:\n")


class RecordError(DataError):
    """A record that cannot become an example; ``reason`` is the short kind skip reports count by."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def split_format(format: str) -> tuple[str, str]:
    """``data.format`` as ``(file format, record format)``: a file format (jsonl, json, csv, parquet) forces the
    reader and leaves records to ``auto``; a record format leaves the reader to the file's extension."""
    if format in FILE_FORMATS:
        return format, "auto"
    return "auto", format


def required_keys(format: str, names: Mapping[str, str]) -> tuple[str, ...]:
    """The keys a record of ``format`` must have (``names`` maps text/prompt/completion/messages to the recipe's
    field names)."""
    return {"messages": (names["messages"],), "sharegpt": ("conversations",), "alpaca": ("instruction", "output"),
            "prompt_completion": (names["prompt"], names["completion"]), "text": (names["text"],)}[format]


def fitting_format(fields: Mapping[str, Any], names: Mapping[str, str]) -> str | None:
    """The first record format whose keys the record has, or None: in :data:`RECORD_FORMATS` order, those whose
    field names the recipe renamed (``data.prompt_field: instruction``) first."""
    renamed = {"messages": "messages", "prompt_completion": "prompt", "text": "text"}
    for format in sorted(RECORD_FORMATS, key=lambda f: f not in renamed or names[renamed[f]] == renamed[f]):
        if all(key in fields for key in required_keys(format, names)):
            return format
    return None


def detect(fields: Mapping[str, Any], names: Mapping[str, str]) -> str | None:
    """``auto``: the format of a record by its keys. A record with a prompt or a completion but not both is
    ``prompt_completion`` (and then names the one it lacks), as before formats had names."""
    found = fitting_format(fields, names)
    if found is None and (names["prompt"] in fields or names["completion"] in fields):
        return "prompt_completion"
    return found


def check_keys(fields: Mapping[str, Any], format: str, names: Mapping[str, str], where: str) -> None:
    """A record of a named ``format`` has its keys; else one error naming the key and the format that fits."""
    for key in required_keys(format, names):
        if key not in fields:
            fit = fitting_format(fields, names)
            keys = ", ".join(sorted(map(str, fields))[:10]) or "none"
            hint = f"fit data.format: {fit}" if fit else "fit no data.format (" + "; ".join(
                f"{f}: {'+'.join(required_keys(f, names))}" for f in RECORD_FORMATS) + ")"
            raise RecordError("missing field", f"{where}: no '{key}' key for data.format: {format}; the record's "
                                               f"keys ({keys}) {hint}")


def standardize(fields: Mapping[str, Any], format: str, names: Mapping[str, str], where: str,
                chat: bool) -> tuple[str, Mapping[str, Any]]:
    """An ``alpaca`` or ``sharegpt`` record as ``(kind, fields)`` of the kinds tokenization knows (``messages``,
    ``prompt_completion``); ``chat``: the tokenizer has a chat template. Other formats pass unchanged."""
    if format == "sharegpt":
        return "messages", {names["messages"]: _sharegpt_messages(fields["conversations"], where)}
    if format != "alpaca":
        return format, fields
    instruction, output = _text(fields, "instruction", where), _text(fields, "output", where)
    extra = _text(fields, "input", where, optional=True)
    system = _text(fields, "system", where, optional=True)
    if chat:
        user = f"{instruction}\n{extra}" if extra else instruction
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return "messages", {names["messages"]: messages}
    preamble = system or ALPACA_PREAMBLE.format(", paired with an input that provides further context" if extra
                                                else "")
    prompt = (ALPACA_PROMPT[0] if extra else ALPACA_PROMPT[1]).format(preamble=preamble, instruction=instruction,
                                                                      input=extra)
    return "prompt_completion", {names["prompt"]: prompt, names["completion"]: output}


def _text(fields: Mapping[str, Any], key: str, where: str, optional: bool = False) -> str:
    value = fields.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise RecordError("field not a string", f"{where}: field '{key}' must be a string, got "
                                                f"{type(value).__name__}")
    return value


def _sharegpt_messages(conversations: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(conversations, list) or not conversations:
        raise RecordError("bad messages", f"{where}: field 'conversations' must be a non-empty list of "
                                          "{from, value} objects")
    messages = []
    for i, turn in enumerate(conversations):
        if not isinstance(turn, Mapping) or not isinstance(turn.get("from"), str):
            raise RecordError("bad messages", f"{where}: conversations[{i}] must be an object with a string 'from'")
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise RecordError("unknown sharegpt role",
                              f"{where}: conversations[{i}].from is {turn['from'][:40]!r}, not a role of "
                              f"data.format: sharegpt ({', '.join(SHAREGPT_ROLES)})")
        messages.append({"role": role, "content": turn.get("value")})
    return messages


__all__ = ["ALPACA_PROMPT", "DATA_FORMATS", "FILE_FORMATS", "RECORD_FORMATS", "SHAREGPT_ROLES", "RecordError",
           "check_keys", "detect", "fitting_format", "required_keys", "split_format", "standardize"]
