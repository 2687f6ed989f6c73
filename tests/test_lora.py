"""entrenar.adapters.lora: the LoRA layer's arithmetic, injection, freezing and merging."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import conftest
from entrenar.adapters.lora import (
    LoraConfig,
    LoraLinear,
    apply_lora,
    load_lora_state_dict,
    lora_layers,
    lora_parameters,
    lora_state_dict,
    merge_lora,
    unload_lora,
    unmerge_lora,
)
from entrenar.errors import AdapterError

transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 3, 7], [2, 4, 8, 16, 32, 64, 127, 0]])


def tiny_llama() -> nn.Module:
    return conftest.tiny_llama().eval()


@pytest.fixture(scope="module")
def base() -> nn.Module:
    return tiny_llama()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def randomize_b(model: nn.Module, seed: int = 1) -> None:
    """B starts at zero; give it values so the adapter changes the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora_layers(model):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=generator) * 0.1)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("r", {"r": 0}),
        ("r", {"r": -4}),
        ("r", {"r": 2.5}),
        ("alpha", {"alpha": 0}),
        ("alpha", {"alpha": -1.0}),
        ("dropout", {"dropout": 1.0}),
        ("dropout", {"dropout": -0.1}),
        ("target_modules", {"target_modules": []}),
        ("bias", {"bias": "all"}),
    ],
)
def test_config_validation_names_the_field(field, kwargs):
    with pytest.raises(AdapterError, match=field):
        LoraConfig(**kwargs)


def test_layer_formula_and_scaling():
    torch.manual_seed(0)
    base_layer = nn.Linear(16, 12)
    x = torch.randn(3, 16)
    for use_rslora, scaling in ((False, 8.0 / 4), (True, 8.0 / math.sqrt(4))):
        layer = LoraLinear(base_layer, r=4, alpha=8.0, use_rslora=use_rslora)
        assert layer.scaling == pytest.approx(scaling)
        nn.init.normal_(layer.lora_B.weight)
        a, b = layer.lora_A.weight, layer.lora_B.weight
        torch.testing.assert_close(layer(x), base_layer(x) + x @ a.T @ b.T * scaling)


def test_init_matches_nn_linear_default_and_b_is_zero():
    layer = LoraLinear(nn.Linear(256, 64), r=16, alpha=16)
    bound = 1 / math.sqrt(256)  # kaiming_uniform(a=sqrt(5)) on fan_in 256
    a = layer.lora_A.weight
    assert a.abs().max() <= bound and a.abs().max() > 0.95 * bound
    assert torch.count_nonzero(layer.lora_B.weight) == 0


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "all-linear"])
def test_output_unchanged_at_init(base, targets):
    model = copy.deepcopy(base)
    names = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=targets))
    assert all(isinstance(model.get_submodule(n), LoraLinear) for n in names)
    torch.testing.assert_close(logits(model), logits(base), rtol=0, atol=0)


def test_only_adapter_parameters_train(base):
    model = copy.deepcopy(base)
    names = apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    expected = {f"{n}.lora_{ab}.weight" for n in names for ab in "AB"}
    assert trainable == expected
    assert {id(p) for p in lora_parameters(model)} == {id(p) for n, p in model.named_parameters() if n in expected}

    model.train()
    randomize_b(model)
    model(IDS).logits.sum().backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == expected


def test_dropout_only_in_training():
    torch.manual_seed(0)
    layer = LoraLinear(nn.Linear(32, 32), r=4, alpha=4, dropout=0.5)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(4, 32)
    a, b = layer.lora_A.weight, layer.lora_B.weight

    layer.eval()
    torch.testing.assert_close(layer(x), layer.base_layer(x) + x @ a.T @ b.T)

    layer.train()
    torch.manual_seed(123)
    out = layer(x)
    torch.manual_seed(123)
    dropped = nn.functional.dropout(x, p=0.5, training=True)  # same mask, applied to the adapter input only
    torch.testing.assert_close(out, layer.base_layer(x) + dropped @ a.T @ b.T)
    assert not torch.allclose(out, layer.base_layer(x) + x @ a.T @ b.T)


def test_wrapped_layers_follow_the_model_mode(base):
    model = copy.deepcopy(base).eval()
    apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.3, target_modules=["q_proj"]))
    assert all(not layer.training for _, layer in lora_layers(model))
    randomize_b(model)
    torch.testing.assert_close(logits(model), logits(model), rtol=0, atol=0)


def test_merge_and_unmerge_keep_outputs(base):
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(r=4, alpha=16, target_modules="all-linear", use_rslora=True))
    randomize_b(model)
    before = logits(model)
    assert not torch.allclose(before, logits(base), atol=1e-3)  # the adapter does something
    q_name = "model.layers.0.self_attn.q_proj"
    q = model.get_submodule(q_name)
    w0 = q.base_layer.weight.clone()

    assert q_name in merge_lora(model)
    assert merge_lora(model) == []  # already merged
    torch.testing.assert_close(q.base_layer.weight, w0 + q.lora_B.weight @ q.lora_A.weight * q.scaling)
    torch.testing.assert_close(logits(model), before, rtol=1e-5, atol=1e-5)

    assert q_name in unmerge_lora(model)
    torch.testing.assert_close(q.base_layer.weight, w0, rtol=0, atol=1e-6)
    torch.testing.assert_close(logits(model), before, rtol=1e-5, atol=1e-5)


def tiny_tied_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def test_lora_on_a_tied_output_head_is_refused():
    model = tiny_tied_llama()
    with pytest.raises(AdapterError) as err:
        apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["lm_head", "q_proj"]))
    assert str(err.value) == (
        "lm_head.weight is tied to model.embed_tokens.weight; LoRA on it would change the embeddings when merged — "
        "leave lm_head out of target_modules or untie the embeddings"
    )
    assert not list(lora_layers(model))  # refused before any layer was wrapped
    assert all(p.requires_grad for p in model.parameters())


def test_lora_on_other_layers_of_a_tied_model_merges_without_touching_the_embeddings():
    model = tiny_tied_llama()
    embeddings = model.model.embed_tokens.weight.clone()
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    randomize_b(model)
    before = logits(model)
    merge_lora(model)
    torch.testing.assert_close(logits(model), before, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.model.embed_tokens.weight, embeddings)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unload_restores_plain_modules(base):
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "down_proj"]))
    randomize_b(model)
    adapted = logits(model)
    unload_lora(model)
    assert not list(lora_layers(model))
    assert model.state_dict().keys() == base.state_dict().keys()
    torch.testing.assert_close(logits(model), adapted, rtol=1e-5, atol=1e-5)


def test_bf16_base_gets_fp32_adapters():
    torch.manual_seed(0)
    base_layer = nn.Linear(32, 16).to(torch.bfloat16)
    layer = LoraLinear(base_layer, r=4, alpha=8)
    assert layer.lora_A.weight.dtype == layer.lora_B.weight.dtype == torch.float32
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(5, 32).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    a, b = layer.lora_A.weight, layer.lora_B.weight
    expected = base_layer(x).float() + x.float() @ a.T @ b.T * 2.0
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


class _Int8Linear(nn.Module):
    """A stand-in for a quantized base: integer weight plus a scale, not an nn.Linear."""

    linear_like = True

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        scale = linear.weight.abs().amax() / 127
        self.register_buffer("weight", torch.round(linear.weight.detach() / scale).to(torch.int8))
        self.register_buffer("scale", scale.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.float() * self.scale).T


def test_quantized_like_base_trains_but_refuses_to_merge():
    torch.manual_seed(0)
    model = nn.Sequential(_Int8Linear(nn.Linear(16, 16)), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(2, 16)
    reference = model(x)
    assert apply_lora(model, LoraConfig(r=2, alpha=2, target_modules=["0"])) == ["0"]
    assert model[0].lora_A.weight.dtype == torch.float32
    torch.testing.assert_close(model(x), reference, rtol=0, atol=0)
    with pytest.raises(AdapterError, match=r"^0: cannot merge LoRA into a _Int8Linear with torch.int8"):
        merge_lora(model)


def test_second_adapter_is_refused(base):
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(r=2, alpha=2, target_modules=["q_proj"]))
    with pytest.raises(AdapterError, match="already has LoRA layers"):
        apply_lora(model, LoraConfig(r=2, alpha=2, target_modules=["v_proj"]))


def test_helpers_need_lora_layers(base):
    for helper in (merge_lora, unmerge_lora, lora_state_dict, lora_parameters):
        with pytest.raises(AdapterError, match="no LoRA layers"):
            helper(base)


def test_state_dict_round_trip_and_shape_errors(base):
    cfg = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    source = copy.deepcopy(base)
    apply_lora(source, cfg)
    randomize_b(source)
    state = lora_state_dict(source)
    assert sorted(state) == sorted(
        f"model.layers.{i}.self_attn.{p}.lora_{ab}.weight"
        for i in range(2)
        for p in ("q_proj", "v_proj")
        for ab in "AB"
    )
    target = copy.deepcopy(base)
    apply_lora(target, cfg)
    load_lora_state_dict(target, state)
    torch.testing.assert_close(logits(target), logits(source), rtol=0, atol=0)

    bad = dict(state)
    key = "model.layers.1.self_attn.v_proj.lora_B.weight"
    bad[key] = torch.zeros(32, 8)
    with pytest.raises(AdapterError, match=rf"'{key}' has shape \[32, 8\], the model needs \[32, 4\]"):
        load_lora_state_dict(target, bad, "ckpt/step-10")
    del bad[key]
    with pytest.raises(AdapterError, match=rf"ckpt/step-10: missing tensor '{key}'"):
        load_lora_state_dict(target, bad, "ckpt/step-10")


def test_merge_into_an_nf4_base_dequantizes_and_keeps_the_output():
    """Merging into a quantized base must not drop the adapter (its weight is computed on the fly)."""
    from entrenar.quant.nf4.format import NF4Linear

    torch.manual_seed(0)
    layer = LoraLinear(NF4Linear.from_linear(nn.Linear(64, 32)), r=4, alpha=8)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 64)
    before = layer(x)
    layer.merge()
    assert isinstance(layer.base_layer, nn.Linear)
    torch.testing.assert_close(layer(x), before, atol=1e-4, rtol=1e-4)
    layer.unmerge()
    torch.testing.assert_close(layer(x), before, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares the CPU with a GPU")
def test_a_seed_gives_the_same_adapters_on_the_cpu_and_on_a_gpu():
    from entrenar.adapters.lora import LoraLinear

    def drawn(device: str) -> torch.Tensor:
        base = torch.nn.Linear(32, 16, device=device)
        torch.manual_seed(0)
        lora = LoraLinear(base, r=4, alpha=8)
        assert lora.lora_A.weight.device == base.weight.device
        return lora.lora_A.weight.detach().cpu()

    torch.testing.assert_close(drawn("cuda"), drawn("cpu"), atol=0, rtol=0)


def test_a_rank_above_a_layers_smaller_side_is_refused_naming_the_layer():
    """BA has rank at most min(d_in, d_out): r above it only adds parameters. k_proj here is 64 -> 32."""
    model = tiny_llama()
    with pytest.raises(AdapterError, match=r"^model\.layers\.0\.self_attn\.k_proj: r=33 is larger than "
                                           r"min\(in_features, out_features\) = 32 of this 32x64 layer"):
        apply_lora(model, LoraConfig(r=33, alpha=8, target_modules="all-linear"))
    assert not list(lora_layers(model))  # nothing wrapped
    assert len(apply_lora(model, LoraConfig(r=32, alpha=8, target_modules="all-linear"))) == 14


def test_a_recipe_rank_too_large_names_the_key_and_the_layer(workspace):
    from entrenar.config import load_recipe
    from entrenar.tasks import for_recipe
    from entrenar.train.prepare import build_model

    path = workspace / "recipe.yaml"
    path.write_text(f"model: {{path: {workspace / 'model'}, device: cpu}}\n"
                    f"data: {{train: {workspace / 'train.jsonl'}}}\n"
                    "lora: {r: 17, target_modules: [q_proj, v_proj]}\n")
    recipe = load_recipe(path)
    with pytest.raises(AdapterError, match=r"^lora\.r: model\.layers\.0\.self_attn\.v_proj: r=17 is larger than "
                                           r"min\(in_features, out_features\) = 16"):
        build_model(recipe, for_recipe(recipe), "float32", torch.device("cpu"), None)
