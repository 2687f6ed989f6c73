"""A written GGUF file run through llama.cpp itself (llama-cpp-python), against the model as trained.

    comparison = llama_cpp_comparison(Path("model-q4_k_m.gguf"), reference, tokenizer, batches, max_tokens=256)

The gguf package's reader checks the bytes entrenar wrote; llama.cpp checks what users run: its own tensor
layout, RoPE, tokenizer and end-of-generation rules. The held-out batches are fed as token ids (not text), so the
numbers measure the model alone, with :func:`entrenar.evaluation.compare.compare_logits`, the same formula as
every other comparison. llama.cpp's tokenizer is checked separately: each special token of the trained model's
tokenizer must tokenize (with ``special=True``) to the same id and detokenize back; the ids llama.cpp ends a
generation on (its end-of-generation set) must hold the trained model's stop ids; greedy continuations of the
prompts come from llama.cpp's own decode loop. llama-cpp-python is an optional extra (``entrenar[llama-cpp]``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from entrenar.data.batching import Batch
from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import ModelError
from entrenar.evaluation.compare import (
    MAX_KL,
    MIN_TOP1,
    PROMPTS,
    Comparison,
    Continuation,
    chat_prompt,
    check_eos,
    check_special_tokens,
    compare_logits,
)
from entrenar.generation.sampling import generate

NOT_INSTALLED = "not installed (pip install llama-cpp-python)"


def llama_cpp_version() -> str | None:
    """llama-cpp-python's version, or None when it is not installed or does not import (a wheel without its
    shared library): the report then says llama.cpp did not run, rather than the export failing."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        import llama_cpp
    except (ImportError, OSError):
        return None
    return str(getattr(llama_cpp, "__version__", "unknown version"))


def open_gguf(path: Path, n_ctx: int, n_threads: int = 2) -> Any:
    """``llama_cpp.Llama`` on ``path`` with logits for every position, context ``n_ctx``, quiet."""
    import llama_cpp

    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                               n_threads=n_threads, n_threads_batch=n_threads, verbose=False)
    except (ValueError, RuntimeError) as exc:  # llama.cpp refused the file: that is the finding
        raise ModelError(f"{path}: llama.cpp cannot load it ({exc})") from exc


class LlamaCppModel(torch.nn.Module):
    """llama.cpp's logits, called as entrenar's model is: ``(input_ids, position_ids, document_ids) -> [B, T, V]``.
    Each document of a packed row runs on its own from an empty KV cache (as the trained model's attention mask
    lets it see only itself); padding runs are not evaluated (their labels are ignored)."""

    def __init__(self, llm: Any) -> None:
        super().__init__()
        self.llm = llm

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        rows, length = input_ids.shape
        out = torch.zeros(rows, length, self.llm.n_vocab())
        docs = torch.zeros_like(input_ids) if document_ids is None else document_ids
        for r in range(rows):
            starts = [0] + [t for t in range(1, length) if docs[r, t] != docs[r, t - 1]] + [length]
            for start, end in zip(starts[:-1], starts[1:], strict=True):
                if docs[r, start] < 0:
                    continue
                self.llm.reset()
                self.llm.eval(input_ids[r, start:end].tolist())
                out[r, start:end] = torch.from_numpy(np.array(self.llm.scores[: end - start], dtype=np.float32))
        return out


class LlamaCppTokenizer:
    """The tokenizer llama.cpp built from the GGUF file, with the methods the checks of
    :mod:`entrenar.evaluation.compare` call (``encode``, ``decode``, ``eos_ids``, ``chat_template``)."""

    def __init__(self, llm: Any) -> None:
        import llama_cpp

        self.llm = llm
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self.eos_ids = [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
        self.chat_template: str | None = llm.metadata.get("tokenizer.chat_template")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=add_special_tokens, special=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(self.llm.detokenize(list(ids), special=not skip_special_tokens)).decode("utf-8", "replace")


def greedy(llm: Any, prompt_ids: list[int], max_new_tokens: int, stop_ids: Iterable[int]) -> list[int]:
    """llama.cpp's greedy continuation of ``prompt_ids`` (ids; the stop token that ends it is not returned)."""
    stop = set(stop_ids)
    llm.reset()
    llm.eval(prompt_ids)
    new: list[int] = []
    for _ in range(max_new_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if token in stop:
            break
        new.append(token)
        llm.eval([token])
    return new


def special_and_stop_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """The tokenizer's named special tokens, and the text of each other id that ends its generations (the chat
    template's end of turn): llama.cpp must parse each back to its one id."""
    tokens = dict(tokenizer.special_tokens)
    for i in tokenizer.eos_ids:
        text = tokenizer.decode([i], skip_special_tokens=False)
        if text not in tokens.values():
            tokens[f"stop id {i}"] = text
    return tokens


def llama_cpp_comparison(
    path: Path,
    reference: torch.nn.Module,
    reference_tokenizer: Tokenizer,
    batches: list[Batch],
    max_tokens: int | None = None,
    prompts: Sequence[str] = PROMPTS,
    max_new_tokens: int = 16,
    max_kl: float = MAX_KL,
    min_top1: float | None = MIN_TOP1,
    n_threads: int = 2,
) -> Comparison:
    """The GGUF at ``path`` run by llama.cpp and scored against ``reference`` on ``batches`` (see the module
    docstring): a :class:`Comparison` whose ``problems()`` use the same thresholds as every other reader's."""
    prompt_ids = [chat_prompt(reference_tokenizer, p) for p in prompts]
    longest = max([b["input_ids"].shape[1] for b in batches] + [len(p) + max_new_tokens for p in prompt_ids])
    llm = open_gguf(path, n_ctx=max(longest, 64), n_threads=n_threads)
    try:
        tokens, ref_loss, cand_loss, kl, top1 = compare_logits(reference, LlamaCppModel(llm), batches, max_tokens)
        cpp_tok = LlamaCppTokenizer(llm)
        template = reference_tokenizer.chat_template
        continuations = []
        for prompt, ids in zip(prompts, prompt_ids, strict=True):
            ref_new = generate(reference, ids, max_new_tokens,  # type: ignore[arg-type]
                               stop_ids=reference_tokenizer.eos_ids)
            cand_new = greedy(llm, ids, max_new_tokens, cpp_tok.eos_ids)
            ref_text, cand_text = reference_tokenizer.decode(ref_new), cpp_tok.decode(cand_new)
            continuations.append(Continuation(prompt, ref_text, cand_text, ref_new == cand_new,
                                              len(ref_new) < max_new_tokens, len(cand_new) < max_new_tokens))
        return Comparison(
            tokens=tokens, reference_loss=ref_loss, candidate_loss=cand_loss, kl=kl, top1_agreement=top1,
            max_kl=max_kl, min_top1=min_top1,
            chat_template_same=None if template is None else cpp_tok.chat_template == template,
            special_tokens=check_special_tokens(reference_tokenizer, cpp_tok,  # type: ignore[arg-type]
                                                special_and_stop_tokens(reference_tokenizer)),
            eos=check_eos(reference_tokenizer, cpp_tok),  # type: ignore[arg-type]
            continuations=continuations)
    finally:
        llm.close()


__all__ = ["NOT_INSTALLED", "LlamaCppModel", "LlamaCppTokenizer", "llama_cpp_comparison", "llama_cpp_version"]
