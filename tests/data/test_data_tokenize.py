"""Records -> Example(input_ids, labels): which tokens carry loss, for each kind of record."""

from __future__ import annotations

import re

import pytest
from tiny_chat_tokenizer import CHATML, chat_backend, chat_tokenizer

from entrenar.data.sources import read_records
from entrenar.data.tokenize import IGNORE_INDEX, Example, tokenize_record, tokenize_records
from entrenar.errors import ConfigError, DataError

CHAT = [
    {"role": "system", "content": "Answer the question."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And the quick fox?"},
    {"role": "assistant", "content": "It jumps over the lazy dog."},
]


@pytest.fixture
def tokenizer():
    return chat_tokenizer()


@pytest.fixture
def backend():
    return chat_backend()


def trained_text(example: Example, tokenizer) -> list[str]:
    """The text of each maximal run of tokens that carry loss."""
    runs, run = [], []
    for token, label in zip(example.input_ids, example.labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token  # labels are the tokens themselves, unshifted
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return [tokenizer.decode(r, skip_special_tokens=False) for r in runs]


def test_text_record_trains_on_every_token_and_ends_with_eos(tokenizer):
    example = tokenize_record({"text": "The quick brown fox."}, tokenizer)
    assert example.input_ids == tokenizer.encode("The quick brown fox.") + [tokenizer.eos_id]
    assert example.input_ids[0] == tokenizer.bos_id
    assert example.labels == example.input_ids
    no_eos = tokenize_record({"text": "The quick brown fox."}, tokenizer, add_eos=False)
    assert no_eos.input_ids == example.input_ids[:-1]


def test_prompt_completion_masks_the_prompt(tokenizer):
    record = {"prompt": "What is the capital of France?", "completion": " Paris."}
    example = tokenize_record(record, tokenizer, train_on="completion")
    prompt = tokenizer.encode(record["prompt"])  # with BOS, as at inference
    completion = tokenizer.encode(record["completion"], add_special_tokens=False) + [tokenizer.eos_id]
    assert example.input_ids == prompt + completion
    assert example.labels == [IGNORE_INDEX] * len(prompt) + completion
    assert trained_text(example, tokenizer) == [" Paris.<|end_of_text|>"]

    everything = tokenize_record(record, tokenizer, train_on="all")
    assert everything.labels == everything.input_ids == example.input_ids


def test_columns_map_field_names(tokenizer):
    record = {"instruction": "What is the capital of France?", "output": " Paris."}
    mapped = tokenize_record(record, tokenizer, columns={"prompt": "instruction", "completion": "output"})
    plain = tokenize_record({"prompt": record["instruction"], "completion": record["output"]}, tokenizer)
    assert mapped == plain


def test_a_plain_call_trains_on_everything_as_the_recipe_default_does(tokenizer):
    from entrenar.config import Recipe

    assert Recipe().data.train_on == "all"
    for record in ({"prompt": "What is the capital of France?", "completion": " Paris."}, {"messages": CHAT}):
        example = tokenize_record(record, tokenizer)
        assert example.labels == example.input_ids
        examples, _ = tokenize_records([record], tokenizer, seq_len=256)
        assert [(e.input_ids, e.labels) for e in examples] == [(example.input_ids, example.labels)]


def test_chat_trains_only_on_assistant_turns_through_end_of_turn(tokenizer):
    example = tokenize_record({"messages": CHAT}, tokenizer, train_on="completion")
    assert tokenizer.decode(example.input_ids, skip_special_tokens=False) == tokenizer.apply_chat_template(CHAT)
    assert trained_text(example, tokenizer) == ["Paris.<|im_end|>", "It jumps over the lazy dog.<|im_end|>"]

    everything = tokenize_record({"messages": CHAT}, tokenizer, train_on="all")
    assert everything.input_ids == example.input_ids and everything.labels == everything.input_ids


def test_chat_mask_equals_transformers_assistant_mask(backend, tokenizer):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                        eos_token="<|end_of_text|>", chat_template=CHATML)
    for conversation in (CHAT, CHAT[1:3], [{"role": "assistant", "content": "The capital."}] + CHAT[1:]):
        out = reference.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        example = tokenize_record({"messages": conversation}, tokenizer, train_on="completion")
        assert example.input_ids == out["input_ids"]
        assert [label != IGNORE_INDEX for label in example.labels] == [bool(m) for m in out["assistant_masks"]]


def test_chat_template_that_rewrites_earlier_turns_is_refused(backend):
    from entrenar.data.tokenizer import Tokenizer

    # Shows only the last assistant message in full: a prefix render is no prefix of the whole.
    template = ("{% for m in messages %}{{ m['role'] }}: "
                "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}\n"
                "{% endfor %}")
    tok = Tokenizer(backend, eos_token="<|end_of_text|>", chat_template=template)
    with pytest.raises(DataError, match="cannot locate assistant message 2.*train_on='all'"):
        tokenize_record({"messages": CHAT}, tok, train_on="completion")
    assert tokenize_record({"messages": CHAT}, tok, train_on="all").labels  # still usable with train_on='all'


def test_missing_field_names_field_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "only a prompt"}\n')
    records, _ = read_records(path)
    with pytest.raises(DataError, match=re.escape(f"{path} line 2: missing field 'completion'")):
        tokenize_records(records, tokenizer, seq_len=64)


def test_bad_field_types_and_unknown_records_are_named(tokenizer):
    with pytest.raises(DataError, match="field 'text' must be a string, got int"):
        tokenize_record({"text": 3}, tokenizer)
    with pytest.raises(DataError, match=r"messages\[1\] must be an object with a string 'role'"):
        tokenize_record({"messages": [{"role": "user", "content": "x"}, {"content": "y"}]}, tokenizer)
    with pytest.raises(DataError, match="record has none of the fields 'text', 'prompt'\\+'completion' or 'messages'"):
        tokenize_record({"body": "x"}, tokenizer)
    with pytest.raises(DataError, match="no assistant message"):
        tokenize_record({"messages": CHAT[:2]}, tokenizer, train_on="completion")


def test_truncation_is_counted_and_untrainable_examples_dropped(tokenizer):
    records = [
        {"text": "The quick brown fox jumps over the lazy dog."},  # longer than 8 tokens: cut
        {"text": "fox"},  # fits
        {"prompt": "What is the capital of France? The capital of", "completion": " Paris."},  # prompt fills 8
    ]
    full = [len(tokenize_record(r, tokenizer)) for r in records]
    assert full[0] > 8 and full[1] <= 8 and len(tokenizer.encode(records[2]["prompt"])) >= 8
    examples, stats = tokenize_records(records, tokenizer, seq_len=8, train_on="completion")
    assert [len(e) for e in examples] == [8, full[1]]
    assert examples[0].input_ids == tokenize_record(records[0], tokenizer).input_ids[:8]
    assert stats.truncated_examples == 2 and stats.truncated_tokens == (full[0] - 8) + (full[2] - 8)
    assert stats.dropped_no_targets == 1 and stats.examples == 2
    assert stats.target_tokens == sum(e.num_targets for e in examples) == 7 + full[1] - 1


def test_skip_mode_counts_bad_records(tokenizer):
    records = [{"text": "fox"}, {"prompt": "no completion"}, {"text": 5}]
    examples, stats = tokenize_records(records, tokenizer, seq_len=32, on_error="skip")
    assert len(examples) == 1 and stats.skipped == 2
    assert "missing field 'completion'" in stats.skip_reasons[0]
    with pytest.raises(DataError, match="no training examples left after tokenization \\(2 skipped"):
        tokenize_records(records[1:], tokenizer, seq_len=32, on_error="skip")


def test_unknown_column_names_are_refused(tokenizer):
    with pytest.raises(ConfigError, match=r"columns \['promt'\] are not among"):
        tokenize_record({"text": "x"}, tokenizer, columns={"promt": "instruction"})
