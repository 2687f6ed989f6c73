"""examples/smollm2_chat/prepare_data.py: ChatterBot YAML -> chat `messages` JSONL, split by opening prompt.

Runs on small YAML written here; the real corpus and model are used only by the recipe (docs/RECIPES.md).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

from entrenar.data.sources import read_records
from entrenar.data.tokenize import IGNORE_INDEX, tokenize_records
from entrenar.errors import DataError

ROOT = Path(__file__).resolve().parents[1]


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


prep = _load_module(ROOT / "examples/smollm2_chat/prepare_data.py", "smollm2_prepare_data")

# Line numbers matter: errors and `source` name them. Line 4 is the first conversation.
SAMPLE = """\
categories:
- sample
conversations:
- - What is AI?
  - The science of making machines think.
- - Do you like books?
  - Yes.
  - Which one?
- - Hello
  - Hi
  - How are you?
  - |
    Fine,
    thanks.
- - What is AI?
  - The science of making machines think.
- - When was the first Air Jordan released?
  - 1984
- A bare string where a conversation should be
"""

EXPECTED = [
    ({"messages": [{"role": "user", "content": "What is AI?"},
                   {"role": "assistant", "content": "The science of making machines think."}],
      "source": "english/sample.yml:4"}),
    ({"messages": [{"role": "user", "content": "Do you like books?"}, {"role": "assistant", "content": "Yes."}],
      "source": "english/sample.yml:6"}),
    ({"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                   {"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Fine,\nthanks."}],
      "source": "english/sample.yml:9"}),
    ({"messages": [{"role": "user", "content": "When was the first Air Jordan released?"},
                   {"role": "assistant", "content": "1984"}],
      "source": "english/sample.yml:17"}),
]


def _wheel(tmp_path: Path, files: dict[str, str]) -> Path:
    """A zip laid out like the chatterbot-corpus wheel."""
    path = tmp_path / "chatterbot_corpus-0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("chatterbot_corpus/__init__.py", "")
        for name, text in files.items():
            archive.writestr(f"chatterbot_corpus/data/{name}", text)
    return path


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_wheel_conversations_become_alternating_messages_without_duplicates_or_trailing_user_turns(tmp_path, capsys):
    corpus = _wheel(tmp_path, {"english/sample.yml": SAMPLE,
                               "french/other.yml": "conversations:\n- - Salut\n  - Salut\n"})
    code = prep.main(["--corpus", str(corpus), "--out", str(tmp_path / "out"), "--validation-fraction", "0",
                      "--on-error", "skip"])
    assert code == 0
    assert _read_jsonl(tmp_path / "out/train.jsonl") == EXPECTED  # french/ is another language: not read
    assert _read_jsonl(tmp_path / "out/validation.jsonl") == []
    err = capsys.readouterr().err
    assert "english/sample.yml:19: conversation 5 must be a list of turns, got a string" in err


def test_extracted_folder_gives_the_same_files_as_the_wheel(tmp_path):
    folder = tmp_path / "extracted/chatterbot_corpus/data/english"
    folder.mkdir(parents=True)
    (folder / "sample.yml").write_text(SAMPLE, encoding="utf-8")
    corpus = _wheel(tmp_path, {"english/sample.yml": SAMPLE})
    for source, out in ((corpus, "a"), (tmp_path / "extracted", "b")):
        prep.prepare(source, tmp_path / out, validation_fraction=0.3, on_error="skip", log=lambda _: None)
    for name in ("train.jsonl", "validation.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("entry, message", [
    ("- A bare string\n", "english/bad.yml:4: conversation 1 must be a list of turns, got a string"),
    ("- {user: hi}\n", "english/bad.yml:4: conversation 1 must be a list of turns, got a mapping"),
    ("- - hi\n  - [nested, list]\n", "english/bad.yml:4: conversation 1, turn 1 must be text"),
    ("- - hi\n  - ~\n", "english/bad.yml:4: conversation 1, turn 1 is empty"),
    ("- - hi\n  - ''\n", "english/bad.yml:4: conversation 1, turn 1 is empty"),
    ("- - only a question\n", "english/bad.yml:4: conversation 1 has 1 turn(s); it needs a user turn and a reply"),
])
def test_malformed_entry_raises_naming_file_and_line_or_is_skipped(entry, message):
    text = "conversations:\n- - ok\n  - fine\n" + entry
    with pytest.raises(DataError) as error:
        prep.parse_conversations(text, "english/bad.yml")
    assert str(error.value).startswith(message)
    kept, problems = prep.parse_conversations(text, "english/bad.yml", on_error="skip")
    assert [c.turns for c in kept] == [("ok", "fine")]
    assert problems == [str(error.value)]


def test_malformed_entry_stops_the_command_with_a_one_line_error(tmp_path, capsys):
    corpus = _wheel(tmp_path, {"english/sample.yml": SAMPLE})
    assert prep.main(["--corpus", str(corpus), "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip() == (
        "error: english/sample.yml:19: conversation 5 must be a list of turns, got a string")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, message", [
    ("conversations:\n- - a\n  - b\n - c: [\n", "english/broken.yml:4: not valid YAML"),
    ("categories:\n- x\n", "english/broken.yml: no 'conversations' list at the top level"),
    ("conversations: hello\n", "english/broken.yml: no 'conversations' list at the top level"),
])
def test_a_file_that_is_not_a_corpus_always_raises(text, message):
    for on_error in ("raise", "skip"):
        with pytest.raises(DataError, match="^" + message.replace("'", ".")):
            prep.parse_conversations(text, "english/broken.yml", on_error=on_error)


def test_missing_corpus_or_language_is_named(tmp_path):
    with pytest.raises(DataError, match="nope.whl: no such file"):
        prep.read_corpus(tmp_path / "nope.whl")
    corpus = _wheel(tmp_path, {"english/sample.yml": SAMPLE})
    with pytest.raises(DataError, match="no YAML files for language 'klingon'"):
        prep.read_corpus(corpus, "klingon")


def _many_prompts(n_prompts: int = 40) -> str:
    """n_prompts questions, prompt i answered (i % 4) + 1 ways; some asked again in another case/punctuation."""
    lines = ["conversations:"]
    for i in range(n_prompts):
        for j in range(i % 4 + 1):
            question = f"Question number {i}?" if j % 2 == 0 else f"  question NUMBER {i}"
            lines += [f"- - '{question}'", f"  - Answer {j} to {i}."]
    return "\n".join(lines) + "\n"


def test_split_holds_out_whole_prompt_groups_deterministically_per_seed(tmp_path):
    conversations, _ = prep.parse_conversations(_many_prompts(), "english/many.yml")
    assert len(conversations) == 100
    train, validation = prep.split_by_prompt(conversations, 0.2, seed=0)
    assert sorted(train + validation, key=lambda c: c.source) == sorted(conversations, key=lambda c: c.source)
    train_prompts = {prep.prompt_key(c.turns[0]) for c in train}
    validation_prompts = {prep.prompt_key(c.turns[0]) for c in validation}
    assert not train_prompts & validation_prompts  # "Question number 3?" and "question NUMBER 3" stay together
    assert len(train_prompts | validation_prompts) == 40
    assert 20 <= len(validation) < 20 + 4  # reaches the fraction, overshooting by less than one group
    assert prep.split_by_prompt(conversations, 0.2, seed=0) == (train, validation)
    assert prep.split_by_prompt(conversations, 0.2, seed=1)[1] != validation
    assert prep.split_by_prompt(conversations, 0.0, seed=0) == (conversations, [])


def test_too_few_conversations_to_split_is_an_error(tmp_path):
    corpus = _wheel(tmp_path, {"english/one.yml": "conversations:\n- - hi\n  - hello\n"})
    with pytest.raises(DataError, match="1 conversations are too few to hold out 10%"):
        prep.prepare(corpus, tmp_path / "out", log=lambda _: None)


def test_output_trains_only_on_the_assistant_replies(tmp_path):
    """The written records go through entrenar's reader and chat tokenization with loss on replies alone."""
    tiny = _load_module(ROOT / "tests/data/tiny_chat_tokenizer.py", "tiny_chat_tokenizer_for_smollm2")
    tokenizer = tiny.chat_tokenizer()
    prep.prepare(_wheel(tmp_path, {"english/sample.yml": SAMPLE}), tmp_path / "out", validation_fraction=0,
                 on_error="skip", log=lambda _: None)
    records, _ = read_records(str(tmp_path / "out/train.jsonl"))
    examples, _ = tokenize_records(records, tokenizer, seq_len=512, train_on="completion")
    for example, expected in zip(examples, EXPECTED, strict=True):
        trained_ids = [t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX]
        trained = tokenizer.decode(trained_ids, skip_special_tokens=False)
        replies = [m["content"] + "<|im_end|>" for m in expected["messages"] if m["role"] == "assistant"]
        assert trained.replace("\n", "") == "".join(replies).replace("\n", "")
