"""The tokenizer: a Hugging Face fast tokenizer plus the special tokens and chat template around it.

``tokenizer.json`` holds the whole text -> ids pipeline (normalizer,
pre-tokenizer, model, post-processor that adds BOS); ``tokenizer_config.json``
names the special tokens and carries the chat template; ``generation_config.json``
may list more end-of-sequence ids (Llama 3 Instruct stops on several). This class
reads those three files the way transformers does, so ids and decoded text are
the same as ``AutoTokenizer.from_pretrained(folder)``'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import processors

from entrenar.data.templates import Message, render_chat
from entrenar.errors import ModelError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Text <-> token ids, special-token ids and the chat template of one model.

    ``backend`` is a ``tokenizers.Tokenizer``. Special tokens are given as token
    strings (as in ``tokenizer_config.json``) or ids (as in GGUF metadata).
    ``extra_eos_ids`` are further ids that end generation, after ``eos_token``.
    ``chat_template`` is a Jinja source, or a dict of named templates whose
    ``"default"`` entry is the one used.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | int | None = None,
        eos_token: str | int | None = None,
        pad_token: str | int | None = None,
        unk_token: str | int | None = None,
        extra_eos_ids: Iterable[int] = (),
        chat_template: str | Mapping[str, str] | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.backend = backend
        self._tokens: dict[str, str | None] = {}
        for name, token in zip(_SPECIAL_NAMES, (bos_token, eos_token, unk_token, pad_token), strict=True):
            self._tokens[name] = self._token_string(name, token)
        self._extra_eos_ids = [int(i) for i in extra_eos_ids]
        for i in self._extra_eos_ids:
            if not 0 <= i < self.vocab_size:
                raise ModelError(f"end-of-sequence id {i} is outside the vocabulary (size {self.vocab_size})")
        if isinstance(chat_template, Mapping):
            self.chat_templates = dict(chat_template)
        else:
            self.chat_templates = {"default": chat_template} if chat_template else {}
        # Keys of tokenizer_config.json we don't interpret, written back by save().
        self._config = dict(config or {})

    def _token_string(self, name: str, token: str | int | None) -> str | None:
        if token is None:
            return None
        if isinstance(token, int):
            text = self.backend.id_to_token(token)
            if text is None:
                raise ModelError(f"{name} id {token} is outside the vocabulary (size {self.vocab_size})")
            return text
        if self.backend.token_to_id(token) is None:
            raise ModelError(f"{name} {token!r} is not in the tokenizer's vocabulary")
        return token

    # -- loading and saving -------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and, when present, ``tokenizer_config.json``,
        ``chat_template.jinja`` and ``generation_config.json`` from a model folder."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelError(f"{folder}: no tokenizer.json (entrenar needs a Hugging Face fast tokenizer)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelError(f"{tokenizer_file}: cannot be read as a tokenizer: {e}") from e

        config = _read_json(folder / "tokenizer_config.json") or {}
        tokens = {name: _token_content(config.get(name)) for name in _SPECIAL_NAMES}
        _apply_add_special_flags(backend, config, tokens["bos_token"], tokens["eos_token"])

        generation = _read_json(folder / "generation_config.json") or {}
        eos_from_generation = generation.get("eos_token_id")
        if isinstance(eos_from_generation, int):
            eos_from_generation = [eos_from_generation]
        extra_eos = list(eos_from_generation or [])
        if tokens["eos_token"] is None and extra_eos:
            tokens["eos_token"] = extra_eos.pop(0)

        return cls(
            backend,
            **tokens,
            extra_eos_ids=extra_eos,
            chat_template=_read_chat_templates(folder, config),
            config={k: v for k, v in config.items() if k not in _SPECIAL_NAMES and k != "chat_template"},
        )

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) to ``folder``.

        Extra end-of-sequence ids belong in ``generation_config.json``, which
        the model's saver writes; they are not written here.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        config.update(self._config)
        config.update({name: token for name, token in self._tokens.items() if token is not None})
        if set(self.chat_templates) == {"default"}:
            config["chat_template"] = self.chat_templates["default"]
        elif self.chat_templates:
            config["chat_template"] = [{"name": n, "template": t} for n, t in self.chat_templates.items()]
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    # -- special tokens -----------------------------------------------------

    def _id(self, name: str) -> int | None:
        token = self._tokens[name]
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_ids(self) -> list[int]:
        """All ids that end a sequence: the EOS token first, then generation_config's others."""
        first = self._id("eos_token")
        ids = [] if first is None else [first]
        return ids + [i for i in dict.fromkeys(self._extra_eos_ids) if i != first]

    @property
    def eos_id(self) -> int | None:
        ids = self.eos_ids
        return ids[0] if ids else None

    @property
    def pad_id(self) -> int | None:
        """The pad token's id; models without one pad with EOS (pads never carry loss)."""
        pad = self._id("pad_token")
        return self.eos_id if pad is None else pad

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens as strings, as chat templates see them."""
        return {name: token for name, token in self._tokens.items() if token is not None}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    # -- text <-> ids -------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs the post-processor (adds BOS where the model does)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids with the ``(start, end)`` character span of ``text`` each one came from."""
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # transformers' clean_up_tokenization_spaces is not applied: it is skipped for BPE
        # tokenizers (all of this model family) because it corrupts their text.
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """Render a conversation with the model's chat template (as transformers does, ``tokenize=False``)."""
        if self.chat_template is None:
            raise ModelError("this tokenizer has no chat template (tokenizer_config.json has no 'chat_template')")
        return render_chat(self.chat_template, messages, add_generation_prompt, self.special_tokens)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids}, "
                f"pad_id={self.pad_id}, chat_template={'yes' if self.chat_template else 'no'})")


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a huge integer, absurd nesting
        raise ModelError(f"{path}: invalid JSON: {e or 'nested too deeply'}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or a serialized AddedToken."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def _read_chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Chat templates by name. As in transformers, ``chat_template.jinja`` and
    ``additional_chat_templates/*.jinja`` take priority over tokenizer_config.json."""
    templates: dict[str, str] = {}
    files = {"default": folder / "chat_template.jinja"}
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        files.update({f.name.removesuffix(".jinja"): f for f in sorted(extra_dir.glob("*.jinja"))})
    for name, file in files.items():
        if file.is_file():
            templates[name] = file.read_text(encoding="utf-8")
    if templates:
        return templates
    value = config.get("chat_template")
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        for i, entry in enumerate(value):
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ModelError(f"tokenizer_config.json: chat_template[{i}] must be {{'name': str, 'template': str}}")
            templates[entry["name"]] = entry["template"]
        return templates
    if value is not None:
        raise ModelError(f"tokenizer_config.json: chat_template must be a string or a list, got {type(value).__name__}")
    return templates


def _apply_add_special_flags(backend: tokenizers.Tokenizer, config: Mapping[str, Any],
                             bos: str | None, eos: str | None) -> None:
    """Honour ``add_bos_token``/``add_eos_token`` when tokenizer.json has no post-processor.

    A post-processor in tokenizer.json is authoritative (transformers 5 ignores
    the flags then too). Without one, transformers 5 adds nothing, but Llama-style
    configs that set ``add_bos_token`` mean the model was trained with BOS, so we
    add it as transformers 4's Llama tokenizer did.
    """
    if backend.post_processor is not None:
        return
    add_bos = bool(config.get("add_bos_token")) and bos is not None
    add_eos = bool(config.get("add_eos_token")) and eos is not None
    if not (add_bos or add_eos):
        return
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = single + " " + " ".join([f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    special = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
    for token, token_id in special:
        if token_id is None:
            raise ModelError(f"tokenizer_config.json: special token {token!r} is not in tokenizer.json's vocabulary")
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def require_tokenizer(tokenizer: Tokenizer | None, model_path: str | Path | None) -> Tokenizer:
    """``tokenizer``, or a ModelError naming the model folder when it has none (for what needs text)."""
    if tokenizer is None:
        raise ModelError(f"{model_path}: the model has no tokenizer (no tokenizer.json in the folder); copy the "
                         "tokenizer files of the model it came from into it")
    return tokenizer
