"""entrenar.Tokenizer against transformers' AutoTokenizer on tokenizers built here (no downloads)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from entrenar.data.tokenizer import Tokenizer
from entrenar.errors import DataError, ModelError

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Fine-tuning small language models on a laptop, quickly!",
    "Hello there, how are you today? I am fine, thank you.",
    "Numbers like 12345 and symbols like {} [] <> are tokens too.",
]
TEXTS = [
    "The quick brown fox.",
    "  leading spaces and trailing  ",
    "unseen wörds: ñandú, 東京, emoji 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]

# ChatML in the SmolLM2/Qwen style, written over several lines so that
# trim_blocks/lstrip_blocks decide the output's whitespace.
CHATML = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}
    {% endif %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' -}}
{% endif %}"""

# Llama 3 style: the template writes BOS itself and uses tojson on a value with <>&.
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.meta is defined %}{{ m.meta | tojson }}\n{% endif %}"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "  What is 2+2? "},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?", "meta": {"tag": "<b>&"}},
]


def train_backend(bos_processor: bool = True) -> Backend:
    """A tiny byte-level BPE; with ``bos_processor`` it adds BOS like Llama 3's tokenizer.json."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS * 3, trainer)
    if bos_processor:
        bos = "<|begin_of_text|>"
        backend.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, backend.token_to_id(bos))]),
        ])
    return backend


def write_folder(folder, backend: Backend, config: dict, generation: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


@pytest.fixture(scope="module")
def llama3_folder(tmp_path_factory):
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        # A serialized AddedToken, as some configs write special tokens.
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "chat_template": CHATML,
        "clean_up_tokenization_spaces": False,
    }
    folder = tmp_path_factory.mktemp("llama3")
    backend = train_backend()
    end = backend.token_to_id("<|end_of_text|>")
    return write_folder(folder, backend, config, {"eos_token_id": [end, backend.token_to_id("<|im_end|>")]})


def test_encode_decode_match_transformers(llama3_folder):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(llama3_folder)
    theirs = AutoTokenizer.from_pretrained(llama3_folder)
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.encode("The fox")[0] == ours.bos_id == theirs.bos_token_id
    assert ours.vocab_size == len(theirs)


def test_special_ids_from_config_and_generation_config(llama3_folder):
    tok = Tokenizer.from_folder(llama3_folder)
    backend = tok.backend
    im_end, end = backend.token_to_id("<|im_end|>"), backend.token_to_id("<|end_of_text|>")
    assert tok.bos_id == backend.token_to_id("<|begin_of_text|>")
    # tokenizer_config's EOS comes first; generation_config adds the rest without repeats.
    assert tok.eos_ids == [im_end, end]
    assert tok.eos_id == im_end
    assert tok.pad_id == im_end  # no pad token: pad with EOS


def test_single_int_eos_in_generation_config_and_pad_token(tmp_path):
    backend = train_backend()
    end = backend.token_to_id("<|end_of_text|>")
    folder = write_folder(tmp_path, backend, {"pad_token": "<|pad|>"}, {"eos_token_id": end})
    tok = Tokenizer.from_folder(folder)
    assert tok.eos_ids == [end]
    assert tok.pad_id == backend.token_to_id("<|pad|>")
    assert tok.bos_id is None and tok.chat_template is None


def test_chat_template_matches_transformers(llama3_folder):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_folder(llama3_folder)
    theirs = AutoTokenizer.from_pretrained(llama3_folder)
    for generation_prompt in (False, True):
        expected = theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=generation_prompt) == expected
    rendered = ours.apply_chat_template(CONVERSATION[:2])
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
    )


def test_template_with_bos_token_and_tojson_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>", "chat_template": LLAMA3_STYLE}
    folder = write_folder(tmp_path, train_backend(), config)
    ours, theirs = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=True) == expected
    assert '{"tag": "<b>&"}' in expected  # tojson does not HTML-escape


def test_template_raise_exception_is_a_data_error(llama3_folder):
    tok = Tokenizer.from_folder(llama3_folder)
    with pytest.raises(DataError, match="unknown role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_named_templates_list_and_jinja_file(tmp_path):
    config = {"eos_token": "<|im_end|>",
              "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": CHATML}]}
    folder = write_folder(tmp_path / "list", train_backend(), config)
    tok = Tokenizer.from_folder(folder)
    assert tok.chat_template == CHATML and tok.chat_templates["tool_use"] == "T"

    # As in transformers, chat_template.jinja takes priority over the config entry.
    (folder / "chat_template.jinja").write_text(LLAMA3_STYLE)
    assert Tokenizer.from_folder(folder).chat_template == LLAMA3_STYLE


def test_save_round_trips_and_loads_in_transformers(llama3_folder, tmp_path):
    from transformers import AutoTokenizer

    tok = Tokenizer.from_folder(llama3_folder)
    tok.save(tmp_path / "saved")
    again = Tokenizer.from_folder(tmp_path / "saved")
    theirs = AutoTokenizer.from_pretrained(tmp_path / "saved")
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text) == theirs(text)["input_ids"]
    assert again.chat_template == tok.chat_template
    assert (again.bos_id, again.eos_id) == (tok.bos_id, tok.eos_id)
    assert theirs.apply_chat_template(CONVERSATION, tokenize=False) == again.apply_chat_template(CONVERSATION)


def test_add_bos_token_without_post_processor_adds_bos(tmp_path):
    # Llama-style config that asks for BOS while tokenizer.json has no post-processor:
    # the model was trained with BOS, so encode adds it (transformers 4's Llama tokenizer did).
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True}
    tok = Tokenizer.from_folder(write_folder(tmp_path, train_backend(bos_processor=False), config))
    ids = tok.encode("The fox")
    assert ids[0] == tok.bos_id and ids[1:] == tok.encode("The fox", add_special_tokens=False)
    assert tok.bos_id not in ids[1:]


def test_post_processor_wins_over_add_bos_token_false(tmp_path):
    from transformers import AutoTokenizer

    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": False}
    folder = write_folder(tmp_path, train_backend(bos_processor=True), config)
    ids = Tokenizer.from_folder(folder).encode("The fox")
    assert ids == AutoTokenizer.from_pretrained(folder)("The fox")["input_ids"]
    assert ids[0] == Tokenizer.from_folder(folder).bos_id


def test_missing_tokenizer_json_names_the_folder(tmp_path):
    with pytest.raises(ModelError, match=f"{tmp_path}: no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_special_token_outside_vocabulary_is_refused(tmp_path):
    folder = write_folder(tmp_path, train_backend(), {"eos_token": "</s>"})
    with pytest.raises(ModelError, match="eos_token '</s>' is not in the tokenizer's vocabulary"):
        Tokenizer.from_folder(folder)


def test_ids_as_special_tokens():
    backend = train_backend()
    end = backend.token_to_id("<|end_of_text|>")
    tok = Tokenizer(backend, bos_token=backend.token_to_id("<|begin_of_text|>"), eos_token=end)
    assert tok.eos_ids == [end] and tok.special_tokens["eos_token"] == "<|end_of_text|>"
    with pytest.raises(ModelError, match="bos_token id 99999 is outside the vocabulary"):
        Tokenizer(backend, bos_token=99999)
