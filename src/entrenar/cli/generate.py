"""``entrenar generate``: continue a prompt, streaming the new text to stdout."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from entrenar.cli.options import add_model_args, add_sampling_args, load_model
from entrenar.cli.stream import stream_generate

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer


def add_parser(commands: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "generate", parents=parents, help="generate text from a prompt",
        description="Continue a prompt (greedy at temperature 0), printing tokens as they come. "
                    "Stops at the tokenizer's end-of-sequence tokens.",
    )
    add_model_args(parser)
    parser.add_argument("--prompt", required=True, metavar="TEXT",
                        help="the text to continue; - reads it from standard input (its final newline dropped)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template")
    add_sampling_args(parser, max_new_tokens=64)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.prompt == "-":  # before the model loads: a pipe's text, or the user's typing up to Ctrl-D
        args.prompt = read_stdin_prompt()
    model, tokenizer = load_model(args)
    if args.chat:
        prompt_ids = chat_ids(tokenizer, [{"role": "user", "content": args.prompt}], args.model)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    stream_generate(model, tokenizer, prompt_ids, args, sys.stdout)
    print()
    return 0


def read_stdin_prompt() -> str:
    """``--prompt -``: the prompt is standard input, less the one newline that ends a file or ``echo``."""
    from entrenar.errors import ConfigError

    text = sys.stdin.read()
    text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not text:
        raise ConfigError("--prompt -: standard input is empty; pipe the prompt in, or give it as --prompt TEXT")
    return text


def require_chat_template(tokenizer: Tokenizer, model_path: str) -> None:
    """Raise ModelError naming the model when its tokenizer cannot render a conversation."""
    from entrenar.errors import ModelError

    if tokenizer.chat_template is None:
        raise ModelError(f"{model_path}: the tokenizer has no chat template (no 'chat_template' in "
                         "tokenizer_config.json and no chat_template.jinja); chat needs one")


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, str]], model_path: str) -> list[int]:
    """A conversation rendered with the chat template and an open assistant turn, as token ids.

    The template writes any BOS itself, so the tokenizer adds no special tokens.
    """
    require_chat_template(tokenizer, model_path)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
