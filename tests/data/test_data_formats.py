"""Record formats by name (data.format): alpaca, sharegpt, messages, prompt_completion, text."""

from __future__ import annotations

import json
import re

import pytest
from tiny_chat_tokenizer import BOS, CHATML, EOS, chat_backend, chat_tokenizer

from entrenar.config import Recipe
from entrenar.data.sources import read_records
from entrenar.data.tokenize import IGNORE_INDEX, tokenize_record, tokenize_records
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ConfigError, DataError

SHAREGPT = {"conversations": [
    {"from": "system", "value": "Answer the question."},
    {"from": "human", "value": "What is the capital of France?"},
    {"from": "gpt", "value": "Paris."},
    {"from": "user", "value": "And the quick fox?"},
    {"from": "assistant", "value": "It jumps over the lazy dog."},
]}
ALPACA = {"instruction": "What is the capital of France?", "input": "Answer in one word.", "output": "Paris."}
# Stanford Alpaca's prompts, as written in github.com/tatsu-lab/stanford_alpaca train.py (PROMPT_DICT).
STANFORD_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
STANFORD_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


@pytest.fixture
def tokenizer():
    return chat_tokenizer()


def reference_chat(messages):
    """transformers' rendering and assistant mask of a conversation: the reference for ours."""
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_object=chat_backend(), bos_token=BOS, eos_token=EOS,
                                        chat_template=CHATML)
    out = reference.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return out["input_ids"], [bool(m) for m in out["assistant_masks"]]


@pytest.mark.parametrize("format", ["sharegpt", "auto"])
def test_sharegpt_masks_exactly_what_transformers_masks_for_the_same_conversation(tokenizer, format):
    roles = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
    messages = [{"role": roles[t["from"]], "content": t["value"]} for t in SHAREGPT["conversations"]]
    ids, mask = reference_chat(messages)
    example = tokenize_record(SHAREGPT, tokenizer, kind=format, train_on="completion")
    assert example.input_ids == ids
    assert [label != IGNORE_INDEX for label in example.labels] == mask
    assert tokenize_record({"messages": messages}, tokenizer, train_on="completion") == example


@pytest.mark.parametrize("record", [ALPACA, {**ALPACA, "input": ""}, {**ALPACA, "system": "Be brief."}])
def test_alpaca_with_a_chat_template_is_the_conversation_transformers_masks(tokenizer, record):
    user = record["instruction"] + (f"\n{record['input']}" if record["input"] else "")
    messages = ([{"role": "system", "content": record["system"]}] if "system" in record else []) + [
        {"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
    ids, mask = reference_chat(messages)
    for kind in ("alpaca", "auto"):
        example = tokenize_record(record, tokenizer, kind=kind, train_on="completion")
        assert example.input_ids == ids
        assert [label != IGNORE_INDEX for label in example.labels] == mask


def test_alpaca_without_a_chat_template_is_stanford_alpacas_prompt_masked_exactly():
    backend = chat_backend()
    plain = Tokenizer(chat_backend(), bos_token=BOS, eos_token=EOS, chat_template=None)
    for record, template in ((ALPACA, STANFORD_INPUT), ({**ALPACA, "input": ""}, STANFORD_NO_INPUT),
                             ({k: v for k, v in ALPACA.items() if k != "input"}, STANFORD_NO_INPUT)):
        prompt = backend.encode(template.format(**{"input": "", **record})).ids  # with BOS, as inference
        completion = backend.encode(record["output"], add_special_tokens=False).ids + [plain.eos_id]
        example = tokenize_record(record, plain, kind="alpaca", train_on="completion")
        assert example.input_ids == prompt + completion
        assert example.labels == [IGNORE_INDEX] * len(prompt) + completion


def test_a_record_missing_a_key_names_the_key_the_format_and_the_format_that_fits(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (ALPACA, ALPACA, SHAREGPT)) + "\n")
    records, _ = read_records(path)
    with pytest.raises(DataError, match=re.escape(
            f"{path} line 3: no 'instruction' key for data.format: alpaca; the record's keys (conversations) fit "
            "data.format: sharegpt")):
        tokenize_records(records, tokenizer, seq_len=256, kind="alpaca")
    with pytest.raises(DataError, match=re.escape(
            f"{path} line 1: no 'conversations' key for data.format: sharegpt; the record's keys (input, "
            "instruction, output) fit data.format: alpaca")):
        tokenize_records(records, tokenizer, seq_len=256, kind="sharegpt")
    with pytest.raises(DataError, match=re.escape("no 'output' key for data.format: alpaca; the record's keys "
                                                  "(instruction) fit no data.format (messages: messages;")):
        tokenize_record({"instruction": "x"}, tokenizer, kind="alpaca")


def test_an_unknown_sharegpt_role_names_the_line_and_the_value(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    bad = {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]}
    path.write_text(json.dumps(SHAREGPT) + "\n" + json.dumps(bad) + "\n")
    records, _ = read_records(path)
    with pytest.raises(DataError, match=re.escape(f"{path} line 2: conversations[1].from is 'bot', not a role of "
                                                  "data.format: sharegpt")):
        tokenize_records(records, tokenizer, seq_len=256, kind="sharegpt")


def test_train_on_completion_over_plain_text_is_refused_naming_the_key_and_the_file(tmp_path, tokenizer):
    path = tmp_path / "notes.jsonl"
    path.write_text('{"text": "The quick brown fox."}\n{"text": "jumps over the lazy dog."}\n')
    records, _ = read_records(path)
    for kind in ("auto", "text"):
        with pytest.raises(ConfigError, match=re.escape(f"data.train_on: completion masks prompts, and the records "
                                                        f"of {path} are plain text")):
            tokenize_records(records, tokenizer, seq_len=64, kind=kind, train_on="completion")
    assert tokenize_records(records, tokenizer, seq_len=64, train_on="all")[1].examples == 2
    # Mixed with records that have a prompt: taken, and counted among the likely mistakes.
    mixed = [*records, {"prompt": "What is the capital of France?", "completion": " Paris."}]
    _, stats = tokenize_records(mixed, tokenizer, seq_len=64, train_on="completion")
    assert stats.suspicious["plain text under train_on: completion (no prompt to mask: every token trained)"][0] == 2


def test_the_recipe_names_record_formats_and_file_formats():
    for name in ("alpaca", "sharegpt", "messages", "prompt_completion", "text", "auto", "jsonl", "csv"):
        assert Recipe.from_dict({"data": {"format": name}}).data.format == name
    with pytest.raises(ConfigError, match="did you mean 'sharegpt'"):
        Recipe.from_dict({"data": {"format": "sharegtp"}})


def test_the_recipe_and_the_data_layer_name_the_same_formats():
    from entrenar.config.rules import DATA_FORMATS as RECIPE_NAMES
    from entrenar.data.formats import DATA_FORMATS

    assert RECIPE_NAMES == DATA_FORMATS
