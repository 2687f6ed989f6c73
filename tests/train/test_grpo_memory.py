"""GRPO's memory estimate (issue #39): a step holds ``task.num_generations`` sequences per prompt and samples them
with a KV cache first. The plan reads that from the task's Rollout fact; each phase is checked against what a tiny
random model's GRPO step really holds on this CPU (autograd's saved tensors, the sampler's live tensors)."""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.config import load_recipe
from entrenar.distributed.world import World
from entrenar.errors import ConfigError
from entrenar.generation.batched import SamplingConfig, generate_batch
from entrenar.kernels.token_logprobs import TOKEN_LOGPROBS_CHUNK
from entrenar.models.config import ModelConfig
from entrenar.models.hf import read_config
from entrenar.models.transformer import Transformer
from entrenar.tasks.rl.logprobs import completion_logprobs, plain_head
from entrenar.train.memory import GiB, estimate_training_memory, generation_memory, kv_cache_bytes_per_token
from entrenar.train.plan import plan_for, plan_run

ROOT = Path(__file__).resolve().parents[2]

LLAMA = ModelConfig(vocab_size=2048, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4,
                    num_kv_heads=2, model_type="llama")


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensors created under it and still referenced (storages counted once; what existed
    before, such as the weights, left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.now = self.peak = 0

    def _gone(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            self.now -= self.bytes.pop(ptr)
            del self.refs[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (ptr := t.untyped_storage().data_ptr()) not in self.old:
                if ptr not in self.refs:
                    self.refs[ptr], self.bytes[ptr] = 0, t.untyped_storage().nbytes()
                    self.now += self.bytes[ptr]
                    self.peak = max(self.peak, self.now)
                self.refs[ptr] += 1
                weakref.finalize(t, self._gone, ptr)
        return out

    def watch(self, model: torch.nn.Module) -> LiveBytes:
        self.old = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return self


def _model(dtype: torch.dtype = torch.float32) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(LLAMA).to(dtype)
    model.reset_parameters()
    apply_lora(model, LoraConfig(r=4, alpha=8.0))
    return model


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampling_phase_estimate_within_15_percent_of_the_live_tensors(filtered, dtype):
    """4 prompts x 8 completions of 24 tokens after 16-token prompts: the KV cache and the decode step's
    [rows, vocab] buffers (measured: the peak of the tensors the sampler holds at once)."""
    model = _model(dtype)
    prompts = [list(range(1, 17))] * 4
    cfg = SamplingConfig(max_new_tokens=24, top_p=0.9 if filtered else 1.0, top_k=50 if filtered else 0)
    with LiveBytes().watch(model) as live:
        out = generate_batch(model, prompts, cfg, 8, (), torch.Generator().manual_seed(0))
    assert out.completion_ids.shape == (32, 24)  # no stop token: every row ran the whole length
    est = generation_memory(LLAMA, 32, 16, 24, dtype.itemsize, filtered=filtered)
    assert abs(est - live.peak) / live.peak < 0.15, (est, live.peak)
    cache = 32 * (16 + 24 - 1) * kv_cache_bytes_per_token(LLAMA, dtype.itemsize)
    assert live.peak > cache  # the cache is part of what was measured, not all of it


def test_scoring_pass_estimate_within_15_percent_of_the_live_tensors():
    """The reference's log-probabilities (kl_beta > 0): a no-grad forward over every sequence, its head chunked."""
    model = _model()
    rows, prompt, new = 32, 16, 24
    ids = torch.randint(0, LLAMA.vocab_size, (rows, prompt + new))
    with torch.no_grad(), LiveBytes().watch(model) as live:
        completion_logprobs(model, ids, torch.ones_like(ids), new, plain_head(model))
    est = generation_memory(LLAMA, rows, prompt, new, 4, scoring_passes=1, head_chunk=TOKEN_LOGPROBS_CHUNK)
    # the sampling phase of these rows is smaller here, so the estimate is the scoring pass's
    assert est > generation_memory(LLAMA, rows, prompt, new, 4)
    # logsumexp makes x - max and its exp inside the op, below the dispatch mode: two fp32 [768, vocab] more
    measured = live.peak + 2 * rows * new * LLAMA.vocab_size * 4
    assert abs(est - measured) / measured < 0.15, (est, measured)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_phase_counts_every_completion_within_10_percent_of_saved_tensors(dtype):
    """The loss's forward over 4 prompts x 8 completions (GRPO's one forward a micro-batch; full fine-tuning, as
    the estimate's own tests measure it): what autograd keeps for backward is the estimate's activations for 32
    rows plus the completions' hidden states the chunked head keeps; for 4 rows (one sequence a prompt, as the
    plan counted before) it is far below."""
    torch.manual_seed(0)
    model = Transformer(LLAMA).to(dtype)
    model.reset_parameters()
    rows, prompt, new = 32, 16, 24
    ids = torch.randint(0, LLAMA.vocab_size, (rows, prompt + new))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (ptr := t.untyped_storage().data_ptr()) not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logprobs(model, ids, torch.ones_like(ids), new, plain_head(model))
    measured = sum(saved.values())

    def estimate(n: int) -> float:
        e = estimate_training_memory(LLAMA, "full", n, prompt + new, dtype_bytes=dtype.itemsize,
                                     fused_loss_chunk=TOKEN_LOGPROBS_CHUNK)
        # the head keeps the completions' hidden states (the estimate's logits count the whole rows')
        return e.activations + n * new * LLAMA.hidden_size * dtype.itemsize

    assert abs(estimate(rows) - measured) / measured < 0.10, (estimate(rows), measured)
    assert estimate(4) < 0.2 * measured


def _grpo_recipe(ws, *overrides):
    path = ws / "grpo.yaml"
    path.write_text(f"""
model: {{path: {ws / 'model'}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
task: {{type: grpo, num_generations: 4, max_new_tokens: 8}}
reward: {{functions: [exact_answer], answer_field: completion}}
training: {{max_steps: 2, batch_size: 2}}
output: {{dir: {ws / 'run'}}}
""")
    return load_recipe(path, list(overrides))


def test_the_plan_counts_every_completion_and_the_sampling_phase(workspace):
    """Through the task's Rollout fact: rows = prompts x task.num_generations, and the sampling phase (its KV
    cache, the prefill, the decode step's buffers, every row's) is weighed against the step, the larger counted."""
    config = read_config(workspace / "model")

    def memory(*overrides):
        recipe = _grpo_recipe(workspace, *overrides)
        return plan_run(recipe, torch.device("cpu"), World(), config, available=(64 * 2**30, "tests")).memory

    four, eight = memory(), memory("task.num_generations=8")
    assert eight.activations == pytest.approx(2 * four.activations)
    assert eight.logits > four.logits
    assert eight.generation == pytest.approx(2 * four.generation) and four.generation > 0
    assert memory("task.kl_beta=0.04").generation > four.generation  # the reference's no-grad pass
    assert four.total == pytest.approx(four.weights + four.gradients + four.optimizer + four.runtime
                                       + max(four.step, four.generation))


def test_the_planned_gpu_step_is_within_10_percent_of_the_measured_peak(tmp_path):
    """bench/bench_grpo.py's Llama-3.2-1B case on an H100 (bench/results/h100-2026-11-27-s5-grpo-lora1b.json:
    torch.cuda.max_memory_allocated 23.10 GiB, 8 prompts of 128 tokens x 8 completions of exactly 256, LoRA, bf16),
    its recorded recipe planned for CUDA with data.seq_len the run's 384 tokens a row (one sequence a prompt, as the
    plan counted before, came to 6.1 GiB)."""
    result = json.loads((ROOT / "bench/results/h100-2026-11-27-s5-grpo-lora1b.json").read_text())["results"][0]
    assert result["row"] == "entrenar" and result["mean_prompt_tokens"] == pytest.approx(128, abs=0.1)
    config = ModelConfig(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                         vocab_size=49152, tie_word_embeddings=True, rope_theta=500000.0, model_type="llama",
                         max_position_embeddings=4096)  # bench_train's llama-1b shape, the bench tokenizer's vocab
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(dict(config.to_hf())))
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    recipe = result["recipe"]
    recipe["model"]["path"], recipe["data"]["train"] = str(tmp_path / "model"), str(tmp_path / "prompts.jsonl")
    recipe["data"]["seq_len"] = 128 + result["recipe_completion"]
    recipe["reward"]["functions"] = ["length"]  # the bench's own reward module is not importable here
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    plan, _ = plan_for(load_recipe(tmp_path / "recipe.yaml", []), "cuda")
    assert abs(plan.memory.total / GiB - result["peak_gib"]) / result["peak_gib"] < 0.10, plan.memory


def test_a_grpo_run_that_does_not_fit_names_its_sampling_levers(workspace):
    """The refusal's advice includes what only a sampling task has: fewer or shorter completions."""
    recipe = _grpo_recipe(workspace)
    with pytest.raises(ConfigError, match=r"fewer completions of a prompt \(task\.num_generations, now 4\) or "
                                          r"shorter ones \(task\.max_new_tokens, now 8\)"):
        plan_run(recipe, torch.device("cpu"), World(), read_config(workspace / "model"), available=(2**20, "tests"))
