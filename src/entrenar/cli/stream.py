"""Print generated text as it comes, one token at a time, without breaking characters.

A byte-level tokenizer may split one character (é, 日, 🙂) over several
tokens, so decoding each token alone prints replacement characters. Instead we
decode all new ids so far and print only the part not yet printed, holding it
back while it ends in an incomplete character.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.transformer import Transformer

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence


class TokenStream:
    """Collects token ids and writes the newly decoded text to ``out`` after each."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = ""

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith(REPLACEMENT):
            self._write(text)

    def finish(self) -> str:
        """Print whatever is left (even an incomplete character) and return the whole text."""
        text = self.tokenizer.decode(self.ids)
        self._write(text)
        return text

    def _write(self, text: str) -> None:
        # Printed text cannot be taken back; should decoding ever change it, go on from its length.
        new = text[len(self.printed):]
        if new:
            self.out.write(new)
            self.out.flush()
        self.printed = text


def stream_generate(
    model: Transformer, tokenizer: Tokenizer, prompt_ids: list[int], args: argparse.Namespace, out: TextIO
) -> str:
    """Generate from ``prompt_ids`` with the sampling arguments, printing as it goes; returns the text."""
    from entrenar.generation.sampling import generate

    stream = TokenStream(tokenizer, out)
    generate(
        model,
        prompt_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        stop_ids=tokenizer.eos_ids,
        seed=args.seed,
        on_token=stream,
        cuda_graphs={"true": True, "false": False}.get(args.cuda_graphs, "auto"),
    )
    return stream.finish()
