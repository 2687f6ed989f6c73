"""Vocabularies: which tokenizer the merge writes, and embedding rows lined up by token before merging.

With no ``tokenizer_source`` the output takes the base model's tokenizer and
the inputs' embeddings must have the same number of rows (otherwise the merge
is refused, naming the models and sizes). With ``tokenizer_source`` set, rows
are matched by token string rather than by id:

- ``base`` (or a model's path): the output vocabulary is that model's;
- ``union``: the base's vocabulary plus every token another input has and the
  base lacks (its added tokens, in order), appended with new ids.

An input that lacks a token of the output vocabulary gets, for that row, the
base model's row when the base has the token, else the mean of the rows of the
inputs that have it. So a token one fine-tune added keeps that fine-tune's
embedding (it is the only one that has it), and a merge method sees no change
from the base for models that never had the token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import tokenizers
import torch

from entrenar.errors import ModelError
from entrenar.merge.config import MergeConfig, ModelRef
from entrenar.merge.stream import GGUFInput, Input, underlying


def input_vocabulary(model: Input):
    """(tokenizers.Tokenizer, token -> id) of an input, from its tokenizer.json or GGUF metadata."""
    model = underlying(model)
    if isinstance(model, GGUFInput):
        backend = model.gguf.tokenizer.backend
    else:
        assert model.folder is not None  # a folder input: GGUF handled above, adapters unwrapped
        path = model.folder / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{model.reference}: no tokenizer.json; tokenizer_source needs each input's tokenizer")
        backend = tokenizers.Tokenizer.from_file(str(path))
    return backend, backend.get_vocab(with_added_tokens=True)


@dataclass
class VocabAlignment:
    """The output vocabulary and, per input, the input row of each output row (-1: the input lacks it)."""

    source_ref: str  # whose tokenizer the output starts from
    base_ref: str
    rows: int
    index: dict[str, torch.Tensor]
    added: list[tuple[str, bool]] = field(default_factory=list)  # (token, special) appended for a union
    notes: list[str] = field(default_factory=list)

    def align(self, pt, read: Callable[[str, str], torch.Tensor], cache: dict) -> None:
        """Put each input's row-aligned copy of a vocabulary tensor in ``cache`` (where ``read`` finds it)."""
        refs = [*pt.sources, *([pt.base] if pt.base else [])]
        raw = {key: read(*key) for key in refs}
        aligned, present = {}, {}
        for (ref, name), x in raw.items():
            idx = self.index[ref]
            have = idx >= 0
            aligned[(ref, name)] = x[idx.clamp(min=0)] * have.unsqueeze(-1).to(x.dtype)
            present[(ref, name)] = have
        base_key = next((k for k in refs if k[0] == self.base_ref), None)
        count = cast(torch.Tensor, sum(h.to(torch.float32) for h in present.values())).unsqueeze(-1)  # refs not empty
        mean = sum(aligned.values()) / count.clamp(min=1)
        fill = mean
        if base_key is not None:
            fill = torch.where(present[base_key].unsqueeze(-1), aligned[base_key], mean)
        for key in refs:
            cache[key] = torch.where(present[key].unsqueeze(-1), aligned[key], fill)


def align_vocabularies(cfg: MergeConfig, inputs: dict[str, Input]) -> VocabAlignment | None:
    """The row mapping ``tokenizer_source`` asks for, or None when it is unset."""
    source = cfg.tokenizer_source
    if source is None:
        return None
    base_ref = cfg.base_model.text if cfg.base_model else cfg.references()[0].text
    source_ref = source.text if isinstance(source, ModelRef) else base_ref
    vocabs = {ref: input_vocabulary(model)[1] for ref, model in inputs.items()}
    rows_of = {ref: _embedding_rows(model) for ref, model in inputs.items()}

    out = sorted(vocabs[source_ref].items(), key=lambda kv: kv[1])
    out_tokens = {tok: i for tok, i in out}
    added: list[tuple[str, bool]] = []
    if source == "union":
        next_id = len(out_tokens)
        for ref, vocab in vocabs.items():
            if ref == source_ref:
                continue
            backend = input_vocabulary(inputs[ref])[0]
            specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
            for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
                if tok not in out_tokens:
                    out_tokens[tok] = next_id
                    next_id += 1
                    added.append((tok, tok in specials))
    n_tokens = len(out_tokens)
    rows = max(n_tokens, rows_of[source_ref])
    by_id = {i: tok for tok, i in out_tokens.items()}
    index = {}
    for ref, vocab in vocabs.items():
        idx = torch.full((rows,), -1, dtype=torch.long)
        used = set(vocab.values())
        for row in range(rows):
            tok = by_id.get(row)
            if tok is not None:
                i = vocab.get(tok, -1)
            else:  # a padding row past the vocabulary: the same row where the input has one
                i = row if row < rows_of[ref] and row not in used else -1
            idx[row] = i if i < rows_of[ref] else -1
        index[ref] = idx
    notes = [f"tokenizer_source {source if isinstance(source, str) else source.text}: {n_tokens} tokens, "
             f"{rows} embedding rows" + (f", added {', '.join(t for t, _ in added[:8])}" if added else "")]
    for ref, idx in index.items():
        missing = int((idx[:n_tokens] < 0).sum())
        if missing:
            notes.append(f"{ref} lacks {missing} of the output's tokens: their rows come from the base (or the mean)")
    return VocabAlignment(source_ref, base_ref, rows, index, added, notes)


def _embedding_rows(model: Input) -> int:
    info = model.tensors().get("model.embed_tokens.weight")
    if info is None:
        raise ModelError(f"{model.reference}: no model.embed_tokens.weight")
    return info.shape[0]


__all__ = ["VocabAlignment", "align_vocabularies", "input_vocabulary"]
