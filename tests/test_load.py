"""entrenar.load: the tokenizer must fit the model's embedding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "data"))
from tiny_chat_tokenizer import chat_tokenizer

import entrenar
from entrenar.errors import ModelError


def test_a_tokenizer_larger_than_the_vocabulary_is_a_model_error(hf_folder):
    tokenizer = chat_tokenizer()
    folder, _ = hf_folder("llama", vocab_size=tokenizer.vocab_size - 5)
    tokenizer.save(folder)
    with pytest.raises(ModelError) as err:
        entrenar.load(folder, device="cpu")
    message = str(err.value)
    assert message.startswith(f"{folder}: ")
    assert (f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{tokenizer.vocab_size - 5}") in message


def test_a_padded_vocabulary_loads_and_every_token_embeds(hf_folder):
    """Embeddings padded past the tokenizer (to a multiple of 64) are normal."""
    tokenizer = chat_tokenizer()
    padded = -(-tokenizer.vocab_size // 64) * 64
    assert padded > tokenizer.vocab_size
    folder, _ = hf_folder("llama", vocab_size=padded)
    tokenizer.save(folder)
    model, loaded = entrenar.load(folder, device="cpu")
    assert model.config.vocab_size == padded and loaded.vocab_size == tokenizer.vocab_size
    with torch.no_grad():
        assert model(torch.arange(tokenizer.vocab_size)[None]).shape == (1, tokenizer.vocab_size, padded)
