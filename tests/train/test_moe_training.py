"""Router losses against transformers and formulas; MoE training runs: diagnostics, balancing, exact resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import crash_after_step
from entrenar.config import MoeSection, load_recipe
from entrenar.errors import ConfigError
from entrenar.models.config import ModelConfig
from entrenar.models.hf import load_hf, save_hf
from entrenar.models.moe import moe_blocks
from entrenar.models.transformer import Transformer
from entrenar.train.loop import train
from entrenar.train.metrics import read_metrics
from entrenar.train.moe import MoeTraining, load_balancing_loss, router_z_loss


def test_load_balancing_loss_equals_transformers_with_padding_masked():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    e, k, b, t = 6, 2, 3, 7
    layers = [torch.randn(b * t, e) * 2 for _ in range(3)]
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, :2] = 0
    routing = [(logits, logits.softmax(-1).topk(k, dim=-1).indices) for logits in layers]
    for attention in (None, mask):
        ref = load_balancing_loss_func(tuple(layers), e, k, attention)
        ours = load_balancing_loss(routing, e, None if attention is None else attention.reshape(-1))
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    # Padding counts for nothing: changing padded logits changes nothing.
    poked = [x.clone() for x in layers]
    poked[1][5] += 100.0  # row 5 is token (0, 5): padding
    poked_routing = [(x, x.softmax(-1).topk(k, dim=-1).indices) for x in poked]
    torch.testing.assert_close(load_balancing_loss(poked_routing, e, mask.reshape(-1)),
                               load_balancing_loss(routing, e, mask.reshape(-1)))


def test_z_loss_is_the_mean_squared_logsumexp_of_real_tokens():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0], [5.0, -1.0, 2.0]])
    by_hand = [math.log(math.exp(1) + math.exp(2) + math.exp(3)) ** 2, math.log(3) ** 2]
    assert router_z_loss(logits, torch.tensor([1, 1, 0])).item() == pytest.approx(sum(by_hand) / 2, rel=1e-6)


def tiny_moe_model(folder, **kw):
    from entrenar import quickstart

    tokenizer = quickstart.build_tokenizer()
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, qk_norm=True, **kw)
    model = Transformer(config)
    model.reset_parameters()
    save_hf(model, folder)
    tokenizer.save(folder)


def recipe_for(ws, *overrides):
    tiny_moe_model(ws / "moe")
    text = f"""
model: {{path: {ws / 'moe'}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32, validation_split: 0.2, train_on: completion, packing: false}}
optimizer: {{lr: 1.0e-2}}
training: {{max_steps: 6, batch_size: 2, grad_accum: 2, save_every: 2, log_every: 1}}
moe: {{aux_loss: 0.01, z_loss: 0.001, bias_update_rate: 0.01, router_lr_scale: 0.1, dead_after: 3}}
output: {{dir: {ws / 'run'}}}
"""
    path = ws / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path, list(overrides))


def test_moe_run_logs_diagnostics_balances_and_resumes_exactly(workspace, monkeypatch):
    straight = train(recipe_for(workspace, f"output.dir={workspace / 'straight'}"), progress=False)
    records = [r for r in read_metrics(straight.run_dir / "metrics.jsonl") if "loss" in r]
    assert len(records) == 6
    first = records[0]["moe"]
    assert set(first["layers"]) == {"0", "1"}
    layer = first["layers"]["0"]
    assert sum(layer["load"]) == pytest.approx(1.0)
    assert layer["imbalance"] == pytest.approx(max(layer["load"]) * 4, abs=1e-5)
    assert 0 < layer["entropy_norm"] <= 1 and layer["entropy"] == pytest.approx(layer["entropy_norm"] * math.log(4))
    assert 1.9 < first["aux_loss"] < 8 and first["z_loss"] > 0  # balanced routing gives k = 2
    assert (straight.run_dir / "expert_load.png").stat().st_size > 1000

    # The selection bias moved by rate * sign(mean load - load) each step: after one step it is exactly that.
    one = train(recipe_for(workspace, "training.max_steps=1", f"output.dir={workspace / 'one'}"), progress=False)
    load = [r for r in read_metrics(one.run_dir / "metrics.jsonl") if "loss" in r][0]["moe"]["layers"]["1"]["load"]
    state = json.loads((one.checkpoint / "trainer.json").read_text())["moe"]
    expected = [0.01 * (0.0 if abs(x - 0.25) < 1e-9 else math.copysign(1.0, 0.25 - x)) for x in load]
    assert state["bias"][1] == pytest.approx(expected, abs=1e-9)

    # Killed after step 5 (last checkpoint at 4), resumed: the same losses and the same diagnostics, bit for bit.
    recipe = recipe_for(workspace)
    crash_after_step(monkeypatch, recipe, 5)
    resumed = train(recipe, resume=True, progress=False)
    again = [r for r in read_metrics(resumed.run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["loss"] for r in again] == [r["loss"] for r in records]
    assert [r["moe"] for r in again] == [r["moe"] for r in records]
    biases = [json.loads((run.checkpoint / "trainer.json").read_text())["moe"]["bias"] for run in (straight, resumed)]
    assert biases[0] == biases[1]


def test_router_lr_scale_and_freezing(workspace):
    tiny_moe_model(workspace / "moe")
    model = load_hf(workspace / "moe")
    moe = MoeTraining(model, MoeSection(router_lr_scale=0.1))
    assert moe.lr_scale({}) == {r"mlp\.gate$": 0.1}
    from entrenar.train.optim import build_param_groups

    groups = build_param_groups(model, 0.0, moe.lr_scale({}))
    scaled = [n for g in groups if g["lr_scale"] == 0.1 for n in g["names"]]
    assert sorted(scaled) == [f"model.layers.{i}.mlp.gate.weight" for i in range(2)]
    MoeTraining(model, MoeSection(freeze_router=True, router_lr_scale=0.1))
    assert not any(block.gate.weight.requires_grad for _, block in moe_blocks(model))


def test_moe_section_on_a_dense_model_is_refused(workspace):
    text = f"""
model: {{path: {workspace / 'model'}, device: cpu}}
data: {{train: {workspace / 'train.jsonl'}, seq_len: 32}}
training: {{max_steps: 1}}
moe: {{aux_loss: 0.01}}
output: {{dir: {workspace / 'run'}}}
"""
    (workspace / "r.yaml").write_text(text)
    with pytest.raises(ConfigError, match="no mixture-of-experts layers"):
        train(load_recipe(workspace / "r.yaml"), progress=False)


def test_collapse_warnings_fire_once_per_episode(workspace):
    tiny_moe_model(workspace / "moe")
    model = load_hf(workspace / "moe")
    moe = MoeTraining(model, MoeSection(collapse_entropy=0.3))
    routers = [block.gate.weight for _, block in moe_blocks(model)]
    calm = [w.detach().clone() for w in routers]
    ids = torch.randint(0, 10, (2, 8))
    notes = []
    for step, scale in enumerate((1000.0, 1000.0, 1.0, 1000.0), 1):
        with torch.no_grad():
            for w, c in zip(routers, calm):
                w.copy_(c * scale)  # large logits: each token's router distribution is nearly one-hot
        model(ids).sum().backward()
        moe.router_loss({})
        record, warned = moe.after_step(step)
        notes.append([n for n in warned if "router entropy" in n])
        assert (record["layers"]["0"]["entropy_norm"] < 0.3) == (scale > 1)
    assert [len(n) for n in notes] == [2, 0, 0, 2]  # both layers, once per episode


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_lora_on_experts_trains_saves_a_peft_adapter_and_dry_runs(workspace, quantize):
    from safetensors import safe_open

    overrides = ["lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj], target_parameters: "
                 "[mlp.experts.gate_up_proj, mlp.experts.down_proj]}", "training.max_steps=3"]
    if quantize:
        overrides.append(f"lora.quantize_base={quantize}")
    dry = train(recipe_for(workspace, *overrides), dry_run=True, progress=False)
    assert "memory estimate" in dry.summary
    result = train(recipe_for(workspace, *overrides), progress=False)
    with safe_open(str(result.output / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight" in keys
    assert "base_model.model.model.layers.1.mlp.experts.lora_A.weight" in keys
    with safe_open(str(result.output / "adapter_model.safetensors"), "pt") as f:
        assert f.get_tensor("base_model.model.model.layers.1.mlp.experts.lora_B.weight").abs().sum() > 0  # trained


def test_checkpointed_blocks_give_the_same_router_loss_gradients_and_counts(workspace):
    tiny_moe_model(workspace / "moe")
    ids = torch.randint(0, 10, (2, 8))
    results = []
    for checkpointing in (False, True):
        model = load_hf(workspace / "moe")
        model.set_activation_checkpointing(checkpointing)
        moe = MoeTraining(model, MoeSection(aux_loss=0.5, z_loss=0.1))
        loss = model(ids).float().logsumexp(-1).mean() + moe.router_loss({})
        loss.backward()  # a checkpointed block's rerun must not record its routing a second time
        record, _ = moe.after_step(1)
        results.append((record, {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert results[0][0] == results[1][0]
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=1e-6, rtol=0, msg=name)
    assert any(g.abs().sum() > 0 for n, g in results[0][1].items() if n.endswith("mlp.gate.weight"))


def test_router_losses_follow_the_derived_accumulation(workspace):
    """training.global_batch_size derives the accumulation; the router losses are divided by that, not by
    training.grad_accum (same run written both ways: same losses, same router losses)."""
    from entrenar.train.metrics import read_metrics

    a = train(recipe_for(workspace, "training.max_steps=2", f"output.dir={workspace / 'a'}"), progress=False)
    b = train(recipe_for(workspace, "training.max_steps=2", "training.grad_accum=1", "training.global_batch_size=4",
                         f"output.dir={workspace / 'b'}"), progress=False)
    rows = [[r for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r] for run in (a, b)]
    for x, y in zip(*rows):
        assert (x["loss"], x["grad_norm"], x["moe"]["aux_loss"]) == (y["loss"], y["grad_norm"], y["moe"]["aux_loss"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_moe_layers_with_the_eager_losses_and_diagnostics(workspace, monkeypatch):
    """LoRA on attention and every expert, packed rows, bf16: micro-steps replayed from a CUDA graph give the
    eager run's losses, router losses and expert loads (the in-place routing counters fill on replay too)."""
    from entrenar.models.moe import grouped_mm_available

    if not grouped_mm_available():
        pytest.skip("needs torch._grouped_mm")
    replays = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay",
                        lambda self, original=torch.cuda.CUDAGraph.replay: (replays.append(1), original(self))[1])
    common = ["model.device=cuda", "training.precision=bf16", "data.packing=true", "training.max_steps=8",
              "lora={r: 8, alpha: 16, dropout: 0, target_modules: [q_proj, v_proj], target_parameters: "
              "[mlp.experts.gate_up_proj, mlp.experts.down_proj]}"]
    runs = {}
    for graphs in ("false", "true"):
        result = train(recipe_for(workspace, *common, f"training.cuda_graphs={graphs}",
                                  f"output.dir={workspace / graphs}"), progress=False)
        runs[graphs] = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]
    assert len(replays) >= 8  # 16 micro-steps, 3 eager warm-ups, the rest replayed
    eager, graphed = runs["false"], runs["true"]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in graphed]), torch.tensor([r["loss"] for r in eager]),
                               atol=2e-2, rtol=0)
    for a, b in zip(eager, graphed):
        assert b["moe"]["aux_loss"] == pytest.approx(a["moe"]["aux_loss"], abs=2e-2)
        for layer in ("0", "1"):
            assert sum(b["moe"]["layers"][layer]["load"]) == pytest.approx(1.0, abs=1e-5)  # shares rounded to 1e-6
            torch.testing.assert_close(torch.tensor(b["moe"]["layers"][layer]["load"]),
                                       torch.tensor(a["moe"]["layers"][layer]["load"]), atol=0.05, rtol=0)


def test_cuda_graphs_refuse_moe_experts_that_loop(workspace):
    """The per-expert loop reads token counts back in every layer, which no graph can replay: said, not hung."""
    recipe = recipe_for(workspace, "moe.experts=loop")
    model = load_hf(workspace / "moe")
    moe = MoeTraining(model, recipe.moe)
    assert not moe.replayable(torch.device("cpu"), torch.bfloat16)
    if torch.cuda.is_available():
        assert not moe.replayable(torch.device("cuda"), torch.bfloat16)
        moe.blocks[0].experts.implementation = "grouped"
        assert not moe.replayable(torch.device("cuda"), torch.bfloat16)  # one layer that loops is enough
        for block in moe.blocks:
            block.experts.implementation = "auto"
        assert moe.replayable(torch.device("cuda"), torch.bfloat16)
        assert not moe.replayable(torch.device("cuda"), torch.float32)  # fp32 grouped products loop inside
        with pytest.raises(ConfigError, match=r"training\.cuda_graphs: .*grouped"):
            train(recipe_for(workspace, "model.device=cuda", "moe.experts=loop", "training.cuda_graphs=true"),
                  progress=False)


def test_overlapped_steps_give_the_same_router_diagnostics_and_biases(workspace):
    """Steps read after the next one's micro-steps (training.overlap_steps): the routing counters, the biases'
    nudges and the diagnostics are those of the run that reads each step at once, bit for bit."""
    runs = {}
    for overlap in ("false", "true"):
        result = train(recipe_for(workspace, "optimizer.fused=true", f"training.overlap_steps={overlap}",
                                  "training.save_every=3", f"output.dir={workspace / overlap}"), progress=False)
        records = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "loss" in r]
        bias = json.loads((result.checkpoint / "trainer.json").read_text())["moe"]["bias"]
        runs[overlap] = ([(r["loss"], r["moe"]) for r in records], bias)
    assert runs["true"] == runs["false"]
    assert "bias_abs_max" in runs["true"][0][0][1]


def test_a_distributed_step_sums_the_routing_counters_in_one_all_reduce(workspace, monkeypatch):
    """close_step on 2 ranks: the counters, entropies, token counts and router losses travel in one all-reduce
    (a step used to issue four) and each sum lands in its own counter (two ranks that routed alike: every count
    doubled, the router losses' mean unchanged)."""
    import torch.distributed as dist

    from entrenar.distributed.world import World

    tiny_moe_model(workspace / "moe")
    model = load_hf(workspace / "moe")
    moe = MoeTraining(model, MoeSection(aux_loss=0.5, z_loss=0.1))
    ids = torch.randint(0, 10, (2, 8))
    calls: list[int] = []

    def all_reduce(tensor, op=None):  # the other rank holds the same values: the sum is twice this rank's
        calls.append(tensor.numel())
        tensor.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    (model(ids).float().mean() + moe.router_loss({})).backward()
    alone = moe.close_step().tolist()  # one process
    moe.world = World(rank=0, size=2, backend="gloo")
    (model(ids).float().mean() + moe.router_loss({})).backward()
    both = moe.close_step().tolist()
    layers, experts = moe._counts.shape
    counters = layers * experts + 2 * layers  # expert counts, entropies, tokens; then the 2 router losses
    assert calls == [counters + 2]
    assert both[:counters] == [2 * x for x in alone[:counters]] and sum(alone[:counters]) > 0
    assert both[counters:counters + 2] == pytest.approx(alone[counters:counters + 2])
