"""evaluate_file: held-out loss equals the per-example token sum, whatever the tokenizer pads with."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
from tiny_chat_tokenizer import CHATML, chat_backend, chat_tokenizer

from entrenar.data import tokenize_records
from entrenar.data.tokenizer import Tokenizer
from entrenar.evaluation.loss import evaluate_file
from entrenar.models.config import ModelConfig
from entrenar.models.loss import token_cross_entropy
from entrenar.models.transformer import Transformer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [{"role": "user", "content": "Who jumps?"}, {"role": "assistant", "content": "The quick brown fox."}],
    [{"role": "system", "content": "Answer, then stop."}, {"role": "user", "content": "A dog?"},
     {"role": "assistant", "content": "The lazy dog."}],
]


def test_a_tokenizer_without_pad_or_eos_evaluates(tmp_path):
    tokenizer = Tokenizer(chat_backend(), chat_template=CHATML)  # neither pad nor eos: pad_id is None
    assert tokenizer.pad_id is None
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                    num_layers=2, num_heads=4, num_kv_heads=2)).eval()
    model.reset_parameters()
    path = tmp_path / "valid.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))

    result = evaluate_file(model, tokenizer, path, seq_len=64, batch_size=2, train_on="completion")

    examples, _ = tokenize_records([{"messages": c} for c in CONVERSATIONS], tokenizer, 64, train_on="completion")
    assert sum(len(e) for e in examples) % 64 != 0  # the packed rows end in padding
    total, tokens = 0.0, 0
    with torch.no_grad():
        for e in examples:  # one unpadded example at a time: the reference
            loss_sum, n = token_cross_entropy(model(torch.tensor([e.input_ids])), torch.tensor([e.labels]))
            total, tokens = total + float(loss_sum), tokens + int(n)
    assert result.examples == 3 and result.tokens == tokens
    assert math.isclose(result.loss, total / tokens, rel_tol=1e-5)


def test_add_eos_is_honoured_as_training_honours_it(tmp_path):
    """A run trained with data.add_eos: false is evaluated on the same tokens (no EOS after each text)."""
    tokenizer = chat_tokenizer()
    torch.manual_seed(1)
    model = Transformer(ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                    num_layers=2, num_heads=4, num_kv_heads=2)).eval()
    model.reset_parameters()
    texts = ["The quick brown fox.", "The lazy dog.", "Paris."]
    path = tmp_path / "valid.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    scored = {}
    for add_eos in (True, False):
        examples, _ = tokenize_records([{"text": t} for t in texts], tokenizer, 64, add_eos=add_eos)
        scored[add_eos] = evaluate_file(model, tokenizer, path, seq_len=64, batch_size=2, add_eos=add_eos).tokens
        # every labelled token but each example's first (nothing predicts it)
        assert scored[add_eos] == sum(int((torch.tensor(e.labels[1:]) != -100).sum()) for e in examples)
    assert scored[True] - scored[False] == len(texts)  # one EOS a text
