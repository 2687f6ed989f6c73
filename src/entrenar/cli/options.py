"""Arguments several commands share: which model to load and how to sample from it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from entrenar.config import DEVICE_NAMES, is_device_name
from entrenar.device import DTYPES

if TYPE_CHECKING:
    from entrenar.data.tokenizer import Tokenizer
    from entrenar.models.transformer import Transformer

DTYPE_CHOICES = ("auto", *DTYPES)  # the names entrenar.load accepts


MODEL_HELP = ("Hugging Face model folder, .gguf file, a training run: its folder, RUN/best or "
              "RUN/checkpoints/step-N (a LoRA run brings its base model and adapter), or a Hub id "
              "org/name[@revision] (from the Hugging Face cache, downloaded once)")
ADAPTER_HELP = ("LoRA adapter folder (PEFT format) or Hub id, or a LoRA run's folder, RUN/best or "
                "RUN/checkpoints/step-N")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """MODEL, --adapter, --device, --dtype: the arguments of ``entrenar.load``."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--adapter", metavar="DIR", help=ADAPTER_HELP)
    parser.add_argument("--device", type=device, default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="weight dtype (auto: bf16 on CUDA, else fp32)")


def add_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The arguments of ``entrenar.generation.sampling.generate``."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                        help=f"most tokens to generate (default {max_new_tokens})")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 is greedy (default); higher samples more freely")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for sampling")
    parser.add_argument("--cuda-graphs", default="auto", choices=("auto", "true", "false"),
                        help="replay the decode step from a CUDA graph (auto: on a GPU where the model allows)")


def load_model(args: argparse.Namespace, quantize: str | None = None) -> tuple[Transformer, Tokenizer]:
    """(model, tokenizer) as the model arguments say; a model without a tokenizer is a ModelError
    (every command that loads through here reads or writes text)."""
    from entrenar.loading import load, require_tokenizer
    from entrenar.loading.runs import resolve_model_and_adapter

    base = resolve_model_and_adapter(args.model, args.adapter).model
    if base.is_dir() and not (base / "tokenizer.json").is_file():
        require_tokenizer(None, base)  # before minutes of loading weights
    model, tokenizer = load(args.model, adapter=args.adapter, dtype=args.dtype, device=args.device,
                            quantize=quantize)
    return model, require_tokenizer(tokenizer, base)


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0 (argparse turns the ValueError into a usage error)."""
    value = int(text)
    if value <= 0:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive integer"  # argparse names the type in its message


def device(text: str) -> str:
    """An argparse type: the device names a recipe's model.device accepts."""
    if not is_device_name(text):
        raise ValueError(text)
    return text


device.__name__ = f"device ({DEVICE_NAMES})"
