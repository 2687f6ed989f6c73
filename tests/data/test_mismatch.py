"""entrenar.data.mismatch: pairs of a prompt's own answer against another record's, for DPO from unlabelled text."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from entrenar.data.mismatch import continuation_pairs, mismatched_answers
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import DataError


def test_rejected_answer_is_another_prompts_of_the_same_topic_never_the_same_text():
    answers = ["Paris", "Rome", "paris ", "Berlin", "4", "5", "four"]
    keys = ["capital of france", "capital of italy", "capital of france", "capital of germany", "2+2", "2+3",
            "2+2"]
    topics = ["geo", "geo", "geo", "geo", "math", "math", "math"]
    for seed in range(20):
        others = mismatched_answers(answers, keys=keys, topics=topics, seed=seed)
        for i, j in enumerate(others):
            assert j is not None and keys[j] != keys[i] and topics[j] == topics[i]
            assert answers[j].strip().casefold() != answers[i].strip().casefold()
    assert mismatched_answers(answers, keys=keys, topics=topics, seed=3) == \
        mismatched_answers(answers, keys=keys, topics=topics, seed=3)
    assert len({tuple(mismatched_answers(answers, keys=keys, topics=topics, seed=s)) for s in range(20)}) > 1


def test_a_topic_with_no_other_prompt_borrows_from_another_topic_and_nothing_qualifying_gives_none():
    others = mismatched_answers(["a", "b", "c"], keys=["x", "y", "z"], topics=["t", "u", "u"], seed=0)
    assert others[0] in (1, 2) and others[1] == 2 and others[2] == 1
    assert mismatched_answers(["same", "Same"], seed=0) == [None, None]  # equal texts are no preference
    with pytest.raises(ValueError, match="3 answers but 2 keys"):
        mismatched_answers(["a", "b", "c"], keys=["x", "y"])


def _word_tokenizer() -> Tokenizer:
    vocab = {f"w{i}": i for i in range(100)} | {"[UNK]": 100}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend)


def test_continuation_pairs_cut_each_document_and_take_another_documents_continuation():
    tokenizer = _word_tokenizer()
    texts = [" ".join(f"w{10 * d + k}" for k in range(length)) for d, length in enumerate([8, 9, 3, 10])]
    pairs = continuation_pairs(texts, tokenizer, prompt_tokens=4, completion_tokens=3, seed=0)
    assert len(pairs) == 3  # the 3-token document is too short
    long_docs = [0, 1, 3]
    for pair, d in zip(pairs, long_docs, strict=True):
        assert pair["prompt"].split() == [f"w{10 * d + k}" for k in range(4)]
        assert pair["chosen"].split() == [f"w{10 * d + k}" for k in range(4, 7)]
        other = {int(w[1:]) // 10 for w in pair["rejected"].split()}
        assert len(other) == 1 and other.pop() in set(long_docs) - {d}
        assert [int(w[1:]) % 10 for w in pair["rejected"].split()] == [4, 5, 6]  # the same place in its document
    with pytest.raises(DataError, match="1 of 2 documents have 7 tokens"):
        continuation_pairs(texts[:3:2], tokenizer, prompt_tokens=4, completion_tokens=3)
