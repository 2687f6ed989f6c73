"""Reward functions: the TRL contract, built-ins, weights, and a clear error naming a function that misbehaves."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from entrenar.errors import ConfigError
from entrenar.tasks.rl.rewards import Reward, resolve, score

PROMPTS = ["1+2=", "3+4="]
COMPLETIONS = ["3", " 8 "]
COLUMNS = {"answer": ["3", "7"]}


def _user_module(monkeypatch, **fns):
    module = types.ModuleType("my_rewards")
    for name, fn in fns.items():
        setattr(module, name, fn)
    monkeypatch.setitem(sys.modules, "my_rewards", module)


def test_builtins_and_weights(monkeypatch):
    seen = {}

    def mine(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, answer=answer)  # TRL's keyword call: prompts, completions, columns
        return [len(c) for c in completions]

    _user_module(monkeypatch, mine=mine)
    rewards = [Reward("exact_answer", resolve("exact_answer", answer_marker="="), 2.0),
               Reward("my_rewards:mine", resolve("my_rewards:mine"), 0.5),
               Reward("format", resolve("format", format_regex=r"\s*\d+\s*"), 1.0),
               Reward("length", resolve("length", target_length=2), 1.0)]
    total, per = score(rewards, PROMPTS, COMPLETIONS, COLUMNS)
    assert per.tolist() == [[1.0, 1.0, 1.0, -0.5], [0.0, 3.0, 1.0, 0.5 - 0.5 * 2]]
    torch.testing.assert_close(total, torch.tensor([2.0 + 0.5 + 1.0 - 0.5, 1.5 + 1.0 - 0.5]))
    assert seen == {"prompts": PROMPTS, "answer": ["3", "7"]}


def test_exact_answer_takes_text_after_last_marker():
    fn = resolve("exact_answer", answer_marker="####")
    assert fn(prompts=["q"] * 3, completions=["think #### 12", "#### 1 #### 12", "12"],
              answer=[12, 12, 12]) == [1.0, 1.0, 1.0]
    assert fn(prompts=["q"], completions=["#### 13"], answer=[12]) == [0.0]


@pytest.mark.parametrize(("body", "message"), [
    (lambda prompts, completions, **kw: 1 / 0, "raised ZeroDivisionError"),
    (lambda prompts, completions, **kw: ["high"] * len(completions), "returned 'high' for completion 0"),
    (lambda prompts, completions, **kw: [None] * len(completions), "returned None"),
    (lambda prompts, completions, **kw: [math.nan] * len(completions), "returned nan"),
    (lambda prompts, completions, **kw: [1.0], "returned 1 values for 2 completions"),
    (lambda prompts, completions, **kw: 1.0, "returned float"),
])
def test_bad_reward_function_is_named(monkeypatch, body, message):
    _user_module(monkeypatch, bad=body)
    with pytest.raises(ConfigError, match=rf"'my_rewards:bad'.*{message}"):
        score([Reward("my_rewards:bad", resolve("my_rewards:bad"))], PROMPTS, COMPLETIONS, COLUMNS)


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("nowhere_module_xyz:f", {}, "cannot import module 'nowhere_module_xyz'"),
    ("math:no_such", {}, "has no callable 'no_such'"),
    ("exactanswer", {}, "neither module:function nor a built-in"),
    ("format", {}, "needs reward.format_regex"),
    ("format", {"format_regex": "("}, "is not a regular expression"),
    ("length", {}, "needs reward.target_length"),
])
def test_bad_names(name, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        resolve(name, **kwargs)


def test_exact_answer_needs_answer_column():
    with pytest.raises(ConfigError, match="needs a dataset column 'answer'"):
        score([Reward("exact_answer", resolve("exact_answer"))], PROMPTS, COMPLETIONS, {"label": ["3", "7"]})
