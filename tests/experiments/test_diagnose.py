"""entrenar diagnose: fp32 against bf16/fp16 on the loop's first batch, held against direct computations."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import entrenar
from entrenar import tasks
from entrenar.cli.main import main
from entrenar.config import load_recipe
from entrenar.experiments.diagnose import (
    Pass,
    compare,
    compare_gradients,
    diagnose,
    format_report,
    routing_changes,
)
from entrenar.models.config import ModelConfig
from entrenar.models.hf import load_hf, save_hf
from entrenar.models.moe import moe_blocks
from entrenar.models.transformer import Transformer
from entrenar.train.run_data import read_data


def recipe_for(ws, model="model", *overrides):
    path = ws / "recipe.yaml"
    path.write_text(f"""
model: {{path: {ws / model}, device: cpu}}
data: {{train: {ws / 'train.jsonl'}, seq_len: 32, validation_split: 0.2, train_on: completion, packing: false}}
training: {{max_steps: 4, batch_size: 4}}
output: {{dir: {ws / 'run'}}}
""")
    return load_recipe(path, list(overrides))


def fp16_autocast_on_cpu() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            return F.linear(torch.ones(1, 2), torch.ones(2, 2)).dtype == torch.float16
    except RuntimeError:
        return False


def direct_gradients(ws, recipe, precision: str):
    """Loss and gradients of the first training batch by hand: the model read in fp32, run under autocast."""
    torch.manual_seed(recipe.training.seed)
    model, tokenizer = entrenar.load(ws / "model", dtype="float32", device="cpu")
    model.train()
    batch = next(read_data(recipe, tasks.for_recipe(recipe), tokenizer).stream)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(batch["input_ids"], batch["position_ids"], batch.get("document_ids"))
    targets = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=-100, reduction="sum") / (targets != -100).sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_bf16_on_a_tiny_dense_model_is_ok_and_its_numbers_match_a_direct_computation(workspace):
    recipe = recipe_for(workspace)
    report = diagnose(recipe, "bf16")
    assert report.verdict == "ok" and report.reasons == []
    loss32, g32 = direct_gradients(workspace, recipe, "fp32")
    loss16, g16 = direct_gradients(workspace, recipe, "bf16")
    assert report.loss_fp32 == pytest.approx(loss32, rel=1e-6)
    assert report.loss_lp == pytest.approx(loss16, rel=1e-6)
    assert report.loss_lp != report.loss_fp32  # bf16 really ran
    assert {p.name for p in report.params} == set(g32)
    for p in report.params:
        a, b = g32[p.name].double(), g16[p.name].double()
        assert p.norm_fp32 == pytest.approx(float(a.norm()), rel=1e-6)
        assert p.norm_lp == pytest.approx(float(b.norm()), rel=1e-6)
        assert p.ratio == pytest.approx(float(b.norm() / a.norm()), rel=1e-6)
        assert p.rel_diff == pytest.approx(float((b - a).norm() / a.norm()), rel=1e-5)
        assert p.cosine == pytest.approx(float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0)), abs=1e-9)
        assert 0 < p.rel_diff < 0.1 and p.cosine > 0.99
    cosines = [p.cosine for p in report.params]
    assert cosines == sorted(cosines)  # worst first
    text = format_report(report)
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("  ") and "|g|" not in line]
    assert rows == [p.name for p in report.params[:20]]  # the top 20 of 21
    assert "verdict       OK" in text


def plant_fp16_overflow(ws, scale=400.0):
    """The workspace model with layer 0's MLP weights scaled by 400 (each still well inside fp16), so the MLP's
    output, ~400^3 times its usual 0.004, passes fp16's 65504 while fp32 holds it."""
    model = load_hf(ws / "model")
    with torch.no_grad():
        for linear in ("gate_proj", "up_proj", "down_proj"):
            getattr(model.model.layers[0].mlp, linear).weight.mul_(scale)
    save_hf(model, ws / "planted")
    entrenar.load(ws / "model")[1].save(ws / "planted")


@pytest.mark.skipif(not fp16_autocast_on_cpu(), reason="this PyTorch has no fp16 autocast on the CPU")
def test_a_planted_fp16_overflow_is_broken_and_named(workspace):
    plant_fp16_overflow(workspace)
    report = diagnose(recipe_for(workspace, "planted"), "fp16")
    assert report.verdict == "broken"
    assert report.nonfinite["fp32"] == {"loss": False, "logits": False, "first_activation": None, "gradients": []}
    assert report.nonfinite["fp16"]["first_activation"] == "model.layers.0.mlp.down_proj"
    assert "first at model.layers.0.mlp.down_proj" in report.reasons[0]
    text = format_report(report)
    assert "VERDICT" not in text and "verdict       BROKEN" in text
    assert "fp16: " in text and "first activation model.layers.0.mlp.down_proj" in text
    assert report.logit_nonfinite > 0 and "fp16 logits are NaN/inf" in text
    # bf16 has fp32's range: the same model runs finite there.
    bf16 = diagnose(recipe_for(workspace, "planted"), "bf16")
    assert not any(bf16.nonfinite["bf16"].values())


def tiny_moe(ws, tied: bool):
    """A two-layer MoE model (both layers MoE); ``tied``: every router row nearly equal, so bf16 reorders experts."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=entrenar.load(ws / "model")[1].vocab_size, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, model_type="qwen3_moe", num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, qk_norm=True)
    model = Transformer(config)
    model.reset_parameters()
    if tied:
        with torch.no_grad():
            for _, block in moe_blocks(model):
                w = block.gate.weight
                w.copy_(w[:1].expand_as(w) + 1e-4 * torch.randn_like(w))
    name = "moe-tied" if tied else "moe"
    save_hf(model, ws / name)
    entrenar.load(ws / "model")[1].save(ws / name)
    return name


def test_near_tied_routers_are_flagged_routing_divergent(workspace):
    report = diagnose(recipe_for(workspace, tiny_moe(workspace, tied=True)), "bf16")
    assert [r.layer for r in report.routing] == [0, 1]
    tokens = 4 * 32  # the batch's real tokens (batch_size 4, unpacked rows padded to seq_len)
    assert all(0 < r.tokens <= tokens for r in report.routing)
    layer = max(report.routing, key=lambda r: r.fraction)
    assert layer.fraction > 0.05 and layer.divergent
    assert report.verdict in ("suspect", "broken")
    assert any("ROUTING DIVERGENT" in r for r in report.reasons)
    assert "ROUTING DIVERGENT" in format_report(report)
    assert any(p.name == "model.layers.1.mlp.gate.weight" for p in report.params)  # the router trains too
    untied = diagnose(recipe_for(workspace, tiny_moe(workspace, tied=False)), "bf16")
    assert all(r.fraction < layer.fraction and not r.divergent for r in untied.routing)


def test_routing_changes_count_sets_of_experts_of_real_tokens():
    a = torch.tensor([[0, 1], [1, 0], [2, 3], [3, 1]])
    b = torch.tensor([[1, 0], [0, 2], [2, 3], [0, 2]])  # token 0 only reordered; tokens 1 and 3 changed
    (r,) = routing_changes([(3, a)], [(3, b)])
    assert (r.layer, r.tokens, r.changed) == (3, 4, 2) and r.fraction == 0.5 and r.divergent
    (masked,) = routing_changes([(3, a)], [(3, b)], mask=torch.tensor([True, True, True, False]))
    assert (masked.tokens, masked.changed) == (3, 1)


def test_gradient_statistics_follow_their_formulas_on_planted_gradients():
    reference = {"w": torch.tensor([3.0, 4.0]), "zero": torch.zeros(3), "appears": torch.zeros(2)}
    low = {"w": torch.tensor([3.0, 4.4]), "zero": torch.zeros(3), "appears": torch.tensor([1.0, 0.0])}
    w, zero, appears = compare_gradients(reference, low)
    n = math.hypot(3.0, 4.4)
    assert (w.norm_fp32, w.norm_lp) == (5.0, pytest.approx(n))
    assert w.ratio == pytest.approx(n / 5) and w.rel_diff == pytest.approx(0.4 / 5)
    assert w.cosine == pytest.approx((9 + 4 * 4.4) / (5 * n))
    assert (zero.ratio, zero.rel_diff, zero.cosine) == (0.0, 0.0, 1.0)  # no gradient in either pass: identical
    assert (appears.rel_diff, appears.cosine) == (math.inf, 0.0)


def fake_pass(precision, grads, loss=1.0, logits=None, activation=None):
    logits = torch.zeros(1, 2, 3) if logits is None else logits
    return Pass(precision, loss, logits, grads, first_nonfinite_activation=activation,
                nonfinite_grads=[n for n, g in grads.items() if not torch.isfinite(g).all()])


def test_verdicts_follow_the_stated_thresholds():
    base = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.0, 1.0])}

    def verdict(low, **kw):
        return compare(fake_pass("fp32", base), fake_pass("bf16", low, **kw))

    assert verdict(dict(base)).verdict == "ok"
    # cos(10 deg) = 0.985: suspect; cos(30 deg) = 0.866: broken, naming the parameter.
    tilt = lambda deg: torch.tensor([math.cos(math.radians(deg)), math.sin(math.radians(deg))])  # noqa: E731
    assert verdict({**base, "a": tilt(10)}).verdict == "suspect"
    broken = verdict({**base, "a": tilt(30)})
    assert broken.verdict == "broken" and broken.reasons[0].startswith("a: gradient cosine 0.8660")
    assert verdict({**base, "b": torch.tensor([0.0, 1.2])}).verdict == "suspect"  # relative difference 0.2
    nan = verdict({**base, "b": torch.tensor([0.0, math.nan])})
    assert nan.verdict == "broken" and nan.params[0].name == "b" and "first at b" in nan.reasons[0]
    late = verdict(dict(base), activation="model.layers.3.mlp")
    assert late.verdict == "broken" and "model.layers.3.mlp" in late.reasons[0]


def test_the_largest_logit_difference_is_located():
    a = torch.zeros(2, 3, 4)
    b = a.clone()
    b[1, 2, 3] = 0.5
    b[0, 1, 0] = -0.75
    b[1, 0, 2] = 9.0  # a padding position, left out by the mask
    mask = torch.tensor([[True, True, True], [False, True, True]])
    report = compare(fake_pass("fp32", {}, logits=a), fake_pass("bf16", {}, logits=b), mask=mask)
    assert report.logit_max_diff == 0.75
    assert report.logit_where == {"batch": 0, "position": 1, "index": 0}
    assert report.logit_values == {"fp32": 0.0, "low": -0.75}


def test_cli_prints_the_table_or_json_and_exits_0(workspace, capsys):
    recipe_for(workspace)
    path = str(workspace / "recipe.yaml")
    assert main(["diagnose", path, "--top", "3", "--set", "training.batch_size=2"]) == 0
    out = capsys.readouterr().out
    assert "worst first, 3 of 21" in out and "verdict       OK" in out
    assert main(["diagnose", path, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "ok" and len(report["params"]) == 21 and report["batch"]["rows"] == 4
    assert report["thresholds"]["broken_cosine"] == 0.9


@pytest.mark.parametrize("argv, message", [
    (["diagnose", "missing.yaml"], "error: recipe file not found"),
    (["diagnose", "RECIPE", "--set", "training.batch_size=0"], "training.batch_size"),
    (["diagnose", "RECIPE", "--precision", "fp8"], "invalid choice"),
])
def test_cli_user_errors_exit_2(workspace, capsys, argv, message):
    recipe_for(workspace)
    argv = [str(workspace / "recipe.yaml") if a == "RECIPE" else a for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not fp16_autocast_on_cpu(), reason="this PyTorch has no fp16 autocast on the CPU")
def test_fp16_halves_the_loss_scale_while_only_the_gradients_overflow(workspace, monkeypatch):
    import entrenar.experiments.diagnose as diagnose_module

    real = diagnose_module._forward_backward
    scales = []

    def overflowing_above_1024(*args):
        result = real(*args)
        scales.append(result.loss_scale)
        if result.precision == "fp16" and result.loss_scale > 1024:
            result.nonfinite_grads = ["model.embed_tokens.weight"]  # as a scaled backward past fp16's range
        return result

    monkeypatch.setattr(diagnose_module, "_forward_backward", overflowing_above_1024)
    report = diagnose(recipe_for(workspace), "fp16")
    assert scales == [1.0] + [2.0 ** e for e in range(16, 9, -1)]  # fp32, then GradScaler's 2**16 halved to 2**10
    assert report.loss_scale == 1024 and report.verdict == "ok"
    assert "1024 (halved from GradScaler's 65536" in format_report(report)


def test_a_random_init_recipe_is_named_by_what_was_built_and_each_pass_is_told(workspace, capsys):
    """``model.init: random`` has no path: the report says what the model is (from the built model's config,
    as transformers reads the recipe's config.json keys), and stderr tells each pass as it starts."""
    import transformers

    path = workspace / "random.yaml"
    path.write_text(f"""
model:
  init: random
  device: cpu
  config: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
           num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 300}}
data: {{train: {workspace / 'train.jsonl'}, seq_len: 32, train_on: completion, packing: false}}
training: {{max_steps: 4, batch_size: 2}}
output: {{dir: {workspace / 'run'}}}
""")
    hf = transformers.LlamaConfig(**load_recipe(path).model.config)
    assert main(["diagnose", str(path), "--top", "1"]) == 0
    out, err = capsys.readouterr()
    model_line = next(line for line in out.splitlines() if line.startswith("model "))
    assert "None" not in model_line
    assert model_line.split(None, 1)[1] == (
        f"random-init {hf.model_type}, hidden {hf.hidden_size}, "
        f"{hf.num_hidden_layers} layers, vocab {hf.vocab_size} (model.config) on cpu")
    assert err.splitlines() == ["fp32 forward and backward on cpu ...", "bf16 forward and backward on cpu ..."]


def test_fp16_on_a_cpu_says_it_is_slow_before_it_starts(workspace, monkeypatch):
    """fp16 on a CPU is emulated: the first thing said is why it is slow and what to use instead."""
    import entrenar.experiments.diagnose as diagnose_module

    heard: list[str] = []

    def stop(*args):
        raise KeyboardInterrupt  # nothing to compute: what was said before the first pass is the point

    monkeypatch.setattr(diagnose_module, "_autocast_works", lambda device, precision: True)
    monkeypatch.setattr(diagnose_module, "_forward_backward", stop)
    with pytest.raises(KeyboardInterrupt):
        diagnose(recipe_for(workspace), "fp16", say=heard.append)
    assert heard[0].startswith("diagnose: fp16 on a CPU is emulated in software and slow")
    assert "--precision bf16" in heard[0] and heard[1] == "fp32 forward and backward on cpu ..."
