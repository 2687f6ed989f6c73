"""A tiny byte-level BPE tokenizer with a ChatML chat template, trained here (no downloads).

A plain module, not a conftest: tests/conftest.py is imported by name elsewhere,
and a second conftest.py would shadow it.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from entrenar.data.tokenizer import Tokenizer

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "user assistant system: answer the question, then stop.",
]
# ChatML (SmolLM2/Qwen style). The {% generation %} tags let transformers compute
# its own assistant mask, the reference for ours (which does not read the tags).
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@functools.cache
def chat_backend() -> Backend:
    """Byte-level BPE whose post-processor adds BOS, as Llama 3's does."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[BOS, EOS, "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS * 3, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, backend.token_to_id(BOS))]
    )
    return backend


@functools.cache
def chat_tokenizer() -> Tokenizer:
    return Tokenizer(chat_backend(), bos_token=BOS, eos_token=EOS, chat_template=CHATML)
