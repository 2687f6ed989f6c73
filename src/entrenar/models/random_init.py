"""A model from a config instead of a checkpoint: ``model: {init: random, config: {...}}``.

``model.config`` is written as a Hugging Face ``config.json`` (``model_type``, ``hidden_size``,
``num_hidden_layers``, ``num_experts``, ...): the same keys the saved model folder gets, checked by
:meth:`ModelConfig.from_hf` key by key. The weights are drawn on the CPU in fp32 from ``training.seed``
(so the same seed gives the same model on any machine and device), then cast and moved.

The tokenizer is ``model.tokenizer`` (a ``tokenizer.json``), or a byte-level one: the 256 byte values as ids
0..255, then ``<s>``, ``</s>``, ``<pad>`` (259 tokens); any UTF-8 text encodes without an unknown token.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from entrenar.data.tokenizer import Tokenizer
from entrenar.device import resolve_device, resolve_dtype
from entrenar.errors import ConfigError, ModelError
from entrenar.io import hub
from entrenar.models.config import SUPPORTED_FAMILIES, ModelConfig, rope_inv_freq
from entrenar.models.transformer import Transformer

BYTE_SPECIALS = ("<s>", "</s>", "<pad>")
# config.json keys that do not change the model entrenar builds (transformers' runtime and training options).
IGNORED_KEYS = ("transformers_version", "torch_dtype", "dtype", "use_cache", "attention_dropout", "pretraining_tp",
                "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "router_z_loss_coef",
                "_name_or_path", "layer_types", "chunk_size_feed_forward", "id2label", "label2id", "is_encoder_decoder",
                "output_attentions", "output_hidden_states", "problem_type", "return_dict", "tokenizer_class",
                "torchscript", "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
                "max_window_layers")


def is_random(recipe: Any) -> bool:
    """True when the recipe builds its model from ``model.config`` instead of loading ``model.path``."""
    return getattr(recipe.model, "init", "pretrained") == "random"


def byte_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: byte b is id b, then ``<s>`` 256, ``</s>`` 257, ``<pad>`` 258."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's printable stand-in of byte b, in byte order, so that ids are the byte values.
    stand_in = _bytes_to_unicode()
    assert sorted(stand_in.values()) == sorted(alphabet)
    vocab = {stand_in[b]: b for b in range(256)}
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(BYTE_SPECIALS))
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which ``tokenizers``' ByteLevel uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_tokenizer(recipe: Any) -> Tokenizer:
    """``model.tokenizer`` (a tokenizer.json file, a folder holding one, or a Hub id: its cached snapshot), or
    the byte-level fallback."""
    path = recipe.model.tokenizer
    if path is None:
        return byte_tokenizer()
    try:
        path = hub.resolve(path)
    except ModelError as e:
        raise ConfigError(f"model.tokenizer: {e}") from None
    if path.is_dir():
        return Tokenizer.from_folder(path)
    if not path.is_file():
        raise ConfigError(f"model.tokenizer: {path}: no such tokenizer.json file or folder")
    try:
        backend = Backend.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ConfigError(f"model.tokenizer: {path}: cannot be read as a tokenizer.json: {e}") from None
    specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
    pick = lambda *names: next((n for n in names if n in specials), None)  # noqa: E731
    return Tokenizer(backend, bos_token=pick("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>"),
                     eos_token=pick("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>"),
                     pad_token=pick("<pad>", "<|pad|>"), unk_token=pick("<unk>"))


def model_config(recipe: Any, tokenizer: Tokenizer | None = None) -> ModelConfig:
    """The ModelConfig of ``model.config``; ``vocab_size`` and the special ids default to the tokenizer's."""
    hf = dict(recipe.model.config)
    if "model_type" not in hf:
        raise ConfigError(f"model.config: missing key 'model_type' (one of: {', '.join(SUPPORTED_FAMILIES)})")
    tokenizer = tokenizer or load_tokenizer(recipe)
    hf.setdefault("vocab_size", tokenizer.vocab_size)
    for key, value in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id),
                       ("pad_token_id", tokenizer.pad_id)):
        if value is not None:
            hf.setdefault(key, value)
    try:
        config = ModelConfig.from_hf(hf, source="model.config")
    except ModelError as e:
        raise ConfigError(str(e)) from None
    unread = sorted(set(config.extra) - set(IGNORED_KEYS))
    if unread:  # a typo, or an option no supported family reads from config.json: refused, never built wrong
        raise ConfigError(f"model.config: unknown key '{unread[0]}' for model_type {config.model_type} (a config.json "
                          "key that entrenar does not read; see docs/EXPERIMENTS.md)")
    if tokenizer.vocab_size > config.vocab_size:
        raise ConfigError(f"model.config: 'vocab_size' is {config.vocab_size} but the tokenizer "
                          f"({recipe.model.tokenizer or 'byte-level'}) has {tokenizer.vocab_size} tokens; "
                          f"set vocab_size to {tokenizer.vocab_size} or more")
    return config


def build(recipe: Any, dtype: str | torch.dtype | None, device: str | torch.device) -> tuple[Transformer, Tokenizer]:
    """A randomly initialised model (drawn from ``training.seed`` on the CPU in fp32) and its tokenizer."""
    tokenizer = load_tokenizer(recipe)
    config = model_config(recipe, tokenizer)
    device = resolve_device(device)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(recipe.training.seed)
        model = Transformer(config)
        model.reset_parameters()
    finally:
        torch.random.set_rng_state(generator_state)  # the run's own seeding is left as it was
    model = model.to(dtype=resolve_dtype(dtype, device), device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config).to(device)  # kept in fp32 whatever the weights' dtype
    return model.eval(), tokenizer


__all__ = ["BYTE_SPECIALS", "build", "byte_tokenizer", "is_random", "load_tokenizer", "model_config"]
