"""GRPO through ``entrenar train`` (task.type: grpo): metrics, samples, the held-out reward, an exact resume (the
sampler's RNG rides the checkpoint), and recipe errors naming the key."""

from __future__ import annotations

import json

import pytest

from conftest import crash_after_step
from entrenar.config import load_recipe
from entrenar.errors import ConfigError
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    from conftest import make_workspace

    return make_workspace(tmp_path_factory.mktemp("grpo"))


def recipe_for(ws, name, *overrides):
    path = ws / f"{name}.yaml"
    path.write_text(f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32, validation_split: 0.2}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
task: {{type: grpo, num_generations: 4, max_new_tokens: 4, kl_beta: 0.04, samples_every: 1}}
reward: {{functions: [exact_answer, length], answer_field: completion, target_length: 2}}
optimizer: {{lr: 2.0e-2}}
schedule: {{warmup_steps: 0}}
training: {{max_steps: 4, batch_size: 2, eval_every: 2, eval_batches: 2, log_every: 1, save_every: 2}}
output: {{dir: {ws / name}}}
""")
    return load_recipe(path, list(overrides))


def test_grpo_run_logs_rewards_samples_and_resumes_with_the_same_completions(ws, monkeypatch):
    straight = train(recipe_for(ws, "straight"), progress=False)
    steps = [r for r in read_metrics(straight.run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert {"reward", "reward_std", "rewards/exact_answer/mean", "rewards/length/mean", "kl",
            "completions/mean_length", "clip_ratio/region_mean"} <= set(steps[0])
    evals = [r for r in read_metrics(straight.run_dir / "metrics.jsonl") if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert (straight.run_dir / "adapter" / "adapter_config.json").is_file()
    samples = [json.loads(line) for line in (straight.run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [1, 2, 3, 4]

    recipe = recipe_for(ws, "resumed")
    crash_after_step(monkeypatch, recipe, 3)  # the checkpoint of step 2 is the latest
    (recipe_dir := ws / "resumed").joinpath("samples.jsonl").unlink()
    train(recipe, resume=True, progress=False)
    again = [json.loads(line) for line in (recipe_dir / "samples.jsonl").read_text().splitlines()]
    # steps 3 and 4 sample the same completions as the uninterrupted run: the sampler's RNG was restored
    assert [(s["step"], s["completion"]) for s in again] == [(s["step"], s["completion"]) for s in samples
                                                             if s["step"] > 2]
    resumed = [r for r in read_metrics(recipe_dir / "metrics.jsonl") if "loss" in r]
    assert [r["reward"] for r in resumed] == [r["reward"] for r in steps]


@pytest.mark.parametrize(("overrides", "key"), [
    (["task.type=causal_lm", "reward.functions=[]"], "task.num_generations"),
    (["reward.functions=[]"], "reward.functions"),
    (["reward.weights=[1.0]"], "reward.weights"),
    (["task.loss_type=ppo"], "task.loss_type"),
    (["task.beta=0.2"], "task.beta"),
    (["task.decode_cuda_graphs=maybe"], "task.decode_cuda_graphs"),
])
def test_bad_grpo_recipes_name_the_key(ws, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        recipe_for(ws, "bad", *overrides)


def test_decode_cuda_graphs_is_planned_and_reaches_the_sampler(ws):
    """The plan says whether the sampler's decode step replays from a CUDA graph (a CUDA device this machine may
    lack is planned as one); true on a CPU is refused naming the key; the setting reaches the sampler."""
    from entrenar.tasks.rl.grpo_task import settings_of
    from entrenar.train.plan import plan_for

    def line(*overrides, device="cpu"):
        plan, _ = plan_for(recipe_for(ws, "plan", *overrides), device)
        return dict(plan.reasons)["task.decode_cuda_graphs"]

    assert line() == "off (auto: on only on a CUDA device)"
    assert line(device="cuda").startswith("on (auto: a CUDA device")
    assert line("task.decode_cuda_graphs=false", device="cuda") == "off (as set)"
    with pytest.raises(ConfigError, match=r"task\.decode_cuda_graphs: the decode step replays from a CUDA graph"):
        line("task.decode_cuda_graphs=true")
    assert settings_of(recipe_for(ws, "plan", "task.decode_cuda_graphs=false")).sampling.cuda_graphs is False
    assert settings_of(recipe_for(ws, "plan")).sampling.cuda_graphs == "auto"


def test_kl_needs_lora_and_unknown_rewards_are_refused(ws):
    with pytest.raises(ConfigError, match=r"task\.kl_beta"):
        recipe_for(ws, "nolora", "lora=null")
    with pytest.raises(ConfigError, match="no_such_module"):
        train(recipe_for(ws, "badfn", "reward.functions=[no_such_module:fn, length]"), progress=False)


def test_bundled_grpo_addition_recipe_shortened_raises_the_reward(ws):
    """The bundled recipe's settings (LoRA, 8 generations, exact_answer on the completion column) on the tiny
    random model, shortened to one-token answers (every sum is 9) so that a few steps show the reward rising."""
    from entrenar.config.catalog import bundled_recipes, find_recipe

    assert "grpo-addition" in [r.name for r in bundled_recipes()]
    with open(ws / "nines.jsonl", "w") as f:
        for a in range(10):
            f.write(json.dumps({"prompt": f"{a}+{9 - a}=", "completion": "9"}) + "\n")
    recipe = load_recipe(find_recipe("grpo-addition").path, [
        f"model.path={ws / 'model'}", f"data.train={ws / 'nines.jsonl'}", "data.validation=null", "data.seq_len=16",
        "task.max_new_tokens=1", "optimizer.lr=5.0e-2", "training.max_steps=16", "training.batch_size=4",
        "lora.target_modules=[q_proj, v_proj, gate_proj, down_proj, lm_head]",
        "training.eval_every=0", "training.save_every=0", "training.log_every=1", f"output.dir={ws / 'nines'}"])
    result = train(recipe, progress=False)
    rewards = [r["reward"] for r in read_metrics(result.run_dir / "metrics.jsonl") if "reward" in r]
    assert len(rewards) == 16
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards


def test_early_stopping_on_the_held_out_reward_maximises_it(ws):
    recipe = recipe_for(ws, "early", "training.early_stopping={metric: eval_reward}")
    assert recipe.training.early_stopping is not None and recipe.training.early_stopping["mode"] == "max"


def test_full_fine_tuning_saves_the_model_folder(ws):
    result = train(recipe_for(ws, "full", "lora=null", "task.kl_beta=0", "training.max_steps=2",
                              "training.eval_every=0", "training.save_every=0"), progress=False)
    assert result.output == ws / "full" / "model" and (result.output / "config.json").is_file()
    assert len([r for r in read_metrics(result.run_dir / "metrics.jsonl") if "reward" in r]) == 2


def test_a_record_without_a_prompt_is_refused_naming_the_file_and_line(ws):
    from entrenar.errors import DataError

    (ws / "noprompt.jsonl").write_text('{"prompt": "1+2=", "completion": "3"}\n{"text": "1+2=3"}\n')
    with pytest.raises(DataError, match=r"noprompt\.jsonl line 2.*'prompt'"):
        train(recipe_for(ws, "noprompt", f"data.train={ws / 'noprompt.jsonl'}", "data.validation_split=0"),
              progress=False)


def test_several_optimizer_steps_per_generation_batch_through_the_recipe(ws, monkeypatch):
    """task.num_iterations 2 (TRL's num_iterations): each generation batch is trained on for two optimizer steps:
    the same prompts and completions at steps 1-2 and at 3-4; the ratio is 1 on a batch's first step (nothing
    clipped) and moves on its second (with epsilon 0.001 tokens clip); a resume from step 2's checkpoint repeats
    steps 3-4; checkpoints amid a batch's steps are refused."""
    overrides = ("task.num_iterations=2", "task.epsilon=0.001", "task.kl_beta=0", "training.eval_every=0")
    straight = train(recipe_for(ws, "iters", *overrides), progress=False)
    samples = [json.loads(line) for line in (straight.run_dir / "samples.jsonl").read_text().splitlines()]
    by_step = {step: [(s["prompt"], s["completion"]) for s in samples if s["step"] == step] for step in (1, 2, 3, 4)}
    assert by_step[1] == by_step[2] and by_step[3] == by_step[4]
    assert {p for p, _ in by_step[1]} != {p for p, _ in by_step[3]}  # the next batch: new prompts
    steps = [r for r in read_metrics(straight.run_dir / "metrics.jsonl") if "loss" in r]
    assert steps[0]["reward"] == steps[1]["reward"] and steps[2]["reward"] == steps[3]["reward"]
    assert steps[0]["clip_ratio/region_mean"] == 0 and steps[2]["clip_ratio/region_mean"] == 0
    assert steps[1]["clip_ratio/region_mean"] > 0 and steps[3]["clip_ratio/region_mean"] > 0

    recipe = recipe_for(ws, "iters-resumed", *overrides)
    crash_after_step(monkeypatch, recipe, 3)  # the checkpoint of step 2 is the latest
    train(recipe, resume=True, progress=False)
    resumed = [r for r in read_metrics(ws / "iters-resumed" / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in steps]
    with pytest.raises(ConfigError, match=r"training\.save_every \(2\) must be a multiple of task\.num_iterations"):
        train(recipe_for(ws, "iters-bad", "task.num_iterations=3", "training.eval_every=0"), progress=False)


def test_recipes_grpo_addition_weak_shortened_raises_the_reward(ws):
    """recipes/grpo-addition-weak.yaml (docs/RL.md's worked example: full fine-tuning, 4 answers a sum at
    temperature 0.7, exact_answer) on the tiny random model, shortened to one-token answers that are all `9` and
    a higher lr: the sampled reward of the last 4 steps must exceed the first 4's, and the held-out reward is
    logged before and after."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "recipes" / "grpo-addition-weak.yaml"
    with open(ws / "nines.jsonl", "w") as f:
        for a in range(10):
            f.write(json.dumps({"prompt": f"{a}+{9 - a}=", "completion": "9"}) + "\n")
    recipe = load_recipe(path, [f"model.path={ws / 'model'}", f"data.train={ws / 'nines.jsonl'}",
                                f"data.validation={ws / 'nines.jsonl'}", "data.seq_len=16", "task.max_new_tokens=1",
                                "optimizer.lr=1.0e-2", "training.max_steps=16", "training.batch_size=4",
                                "training.eval_every=16", "training.eval_batches=1", "training.log_every=1",
                                f"output.dir={ws / 'weak'}"])
    assert recipe.task.type == "grpo" and recipe.reward.functions == ("exact_answer",) and recipe.lora is None
    result = train(recipe, progress=False)
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records if "eval_reward" in r] == [0, 16]
    rewards = [r["reward"] for r in records if "reward" in r]
    assert len(rewards) == 16
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards
