"""The non-tensor files of a merged model: tokenizer, generation config, and a README model card."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import tokenizers

from entrenar.data.tokenizer import Tokenizer
from entrenar.merge.config import ModelRef
from entrenar.merge.stream import GGUFInput, Input, underlying

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tokenizer_ref(plan, vocab) -> str:
    if vocab is not None:
        return vocab.source_ref
    source = plan.config.tokenizer_source
    return source.text if isinstance(source, ModelRef) else plan.base_ref


def write_tokenizer(plan, inputs: dict[str, Input], vocab, folder: Path) -> None:
    """Copy the tokenizer files of the tokenizer's source (adding a union's tokens), the chat template and the
    generation config."""
    source = underlying(inputs[_tokenizer_ref(plan, vocab)])
    if isinstance(source, GGUFInput):
        source.gguf.tokenizer.save(folder)
    else:
        assert source.folder is not None  # a folder input: GGUF handled above, adapters unwrapped
        for name in TOKENIZER_FILES:
            if (source.folder / name).is_file():
                shutil.copyfile(source.folder / name, folder / name)
    base = inputs[plan.base_ref]
    if base.folder is not None and (base.folder / "generation_config.json").is_file():
        shutil.copyfile(base.folder / "generation_config.json", folder / "generation_config.json")
    if vocab is not None and vocab.added:
        _add_tokens(folder, vocab.added)
    template = plan.config.chat_template
    if template is not None:
        if template == "chatml":
            template = CHATML
        elif template == "auto":
            template = _most_common_template(inputs)
        if template:
            _set_chat_template(folder, template)


def gguf_tokenizer_check(plan, inputs: dict[str, Input], vocab) -> None:
    """The merged model's tokenizer (its source's), checked as the GGUF writer will need it."""
    from entrenar.export.gguf_write import check_gguf_tokenizer

    source = inputs[_tokenizer_ref(plan, vocab)]
    if isinstance(source, GGUFInput):
        check_gguf_tokenizer(source.gguf.tokenizer)
    elif source.folder is not None and (source.folder / "tokenizer.json").is_file():
        check_gguf_tokenizer(Tokenizer.from_folder(source.folder))


def _add_tokens(folder: Path, added: list[tuple[str, bool]]) -> None:
    path = folder / "tokenizer.json"
    backend = tokenizers.Tokenizer.from_file(str(path))
    for token, special in added:
        backend.add_tokens([tokenizers.AddedToken(token, special=special, normalized=not special)])
    backend.save(str(path))
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        if isinstance(config.get("added_tokens_decoder"), dict):
            for token, special in added:
                config["added_tokens_decoder"][str(backend.token_to_id(token))] = {
                    "content": token, "lstrip": False, "normalized": not special, "rstrip": False,
                    "single_word": False, "special": special,
                }
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _template_of(model: Input) -> str | None:
    model = underlying(model)
    if isinstance(model, GGUFInput):
        return model.gguf.chat_template
    assert model.folder is not None  # a folder input: GGUF handled above, adapters unwrapped
    if (model.folder / "chat_template.jinja").is_file():
        return (model.folder / "chat_template.jinja").read_text()
    path = model.folder / "tokenizer_config.json"
    if path.is_file():
        template = json.loads(path.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def _most_common_template(inputs: dict[str, Input]) -> str | None:
    templates = [t for t in (_template_of(m) for m in inputs.values()) if t]
    return Counter(templates).most_common(1)[0][0] if templates else None


def _set_chat_template(folder: Path, template: str) -> None:
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def model_card(plan, name: str) -> str:
    """README.md: what was merged, how, and the config that reproduces it."""
    cfg = plan.config
    refs = cfg.references()
    base = cfg.base_model.text if cfg.base_model else None
    lines = ["---", "library_name: transformers", "tags:", "- merge", "- entrenar", "- mergekit"]
    if base:
        lines.append(f"base_model: {json.dumps(base)}")
    lines += ["---", "", f"# {name}", "",
              f"This model was merged with entrenar (`entrenar merge`) using the "
              f"**{cfg.merge_method}** method (mergekit's configuration format).", "", "## Inputs", ""]
    for ref in refs:
        role = " (base)" if ref.text == base else ""
        adapter = f" with the LoRA adapter `{ref.adapter}` merged in" if ref.adapter else ""
        lines.append(f"- `{ref.path}`{adapter}{role}")
    lines += ["", "## Configuration", "", "```yaml", cfg.text.rstrip("\n"), "```", ""]
    if cfg.spec.random:
        lines += [f"Random masks were drawn with seed {cfg.seed}.", ""]
    return "\n".join(lines)


__all__ = ["model_card", "write_tokenizer"]
