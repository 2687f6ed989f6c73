"""GRPO on two gloo processes: each rank samples its own completions (the sampler is seeded per micro-batch, not
per run), and a job restarted from a checkpoint samples the completions the uninterrupted job sampled."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from workers import grpo_recording_worker, launch  # noqa: E402 - found through sys.path above

from conftest import make_workspace  # noqa: E402  (tests/conftest.py)

pytestmark = pytest.mark.timeout(240)


def read(record: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in Path(f"{record}-{rank}.jsonl").read_text().splitlines()]


def test_ranks_sample_different_completions_and_a_restart_samples_the_same(tmp_path):
    ws = make_workspace(tmp_path)
    (ws / "same.jsonl").write_text("".join(json.dumps({"prompt": "3+4=", "completion": "7"}) + "\n"
                                           for _ in range(16)))  # one prompt: only the sampler tells ranks apart
    recipe = ws / "grpo.yaml"
    recipe.write_text(f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'same.jsonl'}, seq_len: 16}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
task: {{type: grpo, num_generations: 4, max_new_tokens: 3, samples_every: 1}}
reward: {{functions: [exact_answer], answer_field: completion}}
optimizer: {{lr: 1.0e-2}}
schedule: {{warmup_steps: 0}}
training: {{max_steps: 4, batch_size: 2, global_batch_size: 4, eval_every: 0, log_every: 1, save_every: 2,
           dist_timeout_s: 30, replica_check_every: 1}}
""")
    straight, restarted = ws / "straight", ws / "restarted"
    launch(grpo_recording_worker, str(recipe), [f"output.dir={straight}"], str(ws / "straight-rollouts"))
    rank0, rank1 = read(ws / "straight-rollouts", 0), read(ws / "straight-rollouts", 1)
    assert len(rank0) == len(rank1) == 4  # one rollout a step on each rank
    for a, b in zip(rank0, rank1, strict=True):
        assert a["completions"] != b["completions"]  # same prompts, different samples

    # rank 1 dies after step 3; the job restarts from the checkpoint of step 2 and redoes steps 3 and 4
    launch(grpo_recording_worker, str(recipe), [f"output.dir={restarted}"], str(ws / "restarted-rollouts"), 3,
           max_restarts=1)
    for rank, straight_rollouts in ((0, rank0), (1, rank1)):
        again = [r["completions"] for r in read(ws / "restarted-rollouts", rank) if r["attempt"] == 1]
        assert again == [r["completions"] for r in straight_rollouts[2:]]
    samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [1, 2, 3, 4]  # rank 0 writes each step's table
    assert [s["completion"] for s in samples if s["step"] == 1] == rank0[0]["completions"]
