"""GRPO on a CUDA device: completions are drawn on the GPU (a host draw every token ran the step at a third of
TRL's speed) and a resumed run still samples the same completions (the sampler is seeded per generation batch)."""

from __future__ import annotations

import json

import pytest
import torch
from tests.tasks.test_grpo_train import recipe_for

from conftest import crash_after_step
from entrenar.train.loop import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from conftest import make_workspace

    return make_workspace(tmp_path_factory.mktemp("grpo_gpu"))


def test_gpu_sampling_resumes_with_the_same_completions(ws, monkeypatch):
    draws: list[str] = []
    real = torch.multinomial

    def spy(probs, *args, **kwargs):
        draws.append(probs.device.type)
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", spy)
    straight = train(recipe_for(ws, "straight", "model.device=cuda"), progress=False)
    assert draws and set(draws) == {"cuda"}
    samples = [json.loads(line) for line in (straight.run_dir / "samples.jsonl").read_text().splitlines()]

    recipe = recipe_for(ws, "resumed", "model.device=cuda")
    crash_after_step(monkeypatch, recipe, 3)
    (ws / "resumed" / "samples.jsonl").unlink()
    train(recipe, resume=True, progress=False)
    again = [json.loads(line) for line in (ws / "resumed" / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["completion"]) for s in again] == [(s["step"], s["completion"]) for s in samples
                                                             if s["step"] > 2]
