"""The MoE block's routing variants against transformers' routers, and the block against a formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from entrenar.errors import ModelError
from entrenar.models.config import ModelConfig
from entrenar.models.moe import MoeBlock, route
from entrenar.models.transformer import MLP, Transformer


def moe_config(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    return ModelConfig(**{**base, **kw})


def sorted_by_index(weights, indices):
    order = indices.argsort(dim=-1)
    return weights.gather(1, order), indices.gather(1, order)


def test_sigmoid_grouped_routing_equals_deepseek_v3():
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    ref = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        ref.weight.normal_()
        ref.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(40, 32)
    _, ref_w, ref_i = ref(x)
    logits = F.linear(x, ref.weight)
    w, i = route(logits, 4, "sigmoid", True, ref.e_score_correction_bias, 4, 2, 2.5)
    ref_w, ref_i = sorted_by_index(ref_w, ref_i)
    w, i = sorted_by_index(w, i)
    assert torch.equal(i, ref_i)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)
    # The bias selects but does not weigh: the weights are the plain sigmoid scores of the chosen experts.
    chosen = torch.sigmoid(logits).gather(1, i)
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True) * 2.5)


def test_softmax_over_topk_logits_equals_gpt_oss():
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    config = transformers.GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=3)
    ref = GptOssTopKRouter(config)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    x = torch.randn(20, 32)
    _, ref_w, ref_i = ref(x)
    w, i = route(F.linear(x, ref.weight, ref.bias), 3, "softmax_topk")
    assert torch.equal(i, ref_i)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_with_and_without_renormalising(norm):
    logits = torch.randn(10, 8)
    w, i = route(logits, 2, "softmax", norm)
    probs = logits.softmax(-1)
    top = probs.topk(2, dim=-1)
    expected = top.values / top.values.sum(-1, keepdim=True) if norm else top.values
    assert torch.equal(i, top.indices)
    torch.testing.assert_close(w, expected)


def test_block_equals_the_sum_over_chosen_experts_plus_an_ungated_shared_expert():
    """The block against a per-token formula: DeepSeek-style sigmoid routing with an ungated shared expert."""
    config = moe_config(router_scoring="sigmoid", n_group=2, topk_group=1, shared_expert_intermediate_size=24,
                        router_bias=True)
    torch.manual_seed(0)
    model = Transformer(config)
    model.reset_parameters()
    block = model.model.layers[0].mlp
    assert isinstance(block, MoeBlock) and block.shared_expert_gate is None
    with torch.no_grad():
        block.gate.bias.normal_()
        block.gate.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(2, 5, 32)
    out = block(x)
    flat = x.reshape(-1, 32)
    logits = flat @ block.gate.weight.T + block.gate.bias
    w, idx = route(logits, 2, "sigmoid", True, block.gate.e_score_correction_bias, 2, 1)
    expected = torch.zeros_like(flat)
    e = block.experts
    for n in range(flat.shape[0]):
        for slot in range(2):
            k = int(idx[n, slot])
            gate, up = (e.gate_up_proj[k] @ flat[n]).chunk(2)
            expected[n] += w[n, slot] * (e.down_proj[k] @ (F.silu(gate) * up))
    expected += block.shared_expert(flat)
    torch.testing.assert_close(out.reshape(-1, 32), expected, atol=1e-6, rtol=1e-5)


def test_dense_layer_placement_flags():
    assert moe_config(first_k_dense=1).moe_layers == [1, 2]
    assert moe_config(decoder_sparse_step=2).moe_layers == [1]
    assert moe_config(mlp_only_layers=[0, 2]).moe_layers == [1]
    model = Transformer(moe_config(first_k_dense=1))
    assert isinstance(model.model.layers[0].mlp, MLP) and isinstance(model.model.layers[1].mlp, MoeBlock)


def test_total_and_active_parameters_count_the_modules():
    config = moe_config(shared_expert_intermediate_size=24, shared_expert_gate=True, first_k_dense=1)
    model = Transformer(config)
    assert config.num_parameters == sum(p.numel() for p in model.parameters())
    per_expert = 3 * 32 * 16
    assert config.num_parameters - config.num_active_parameters == 2 * (8 - 2) * per_expert  # two MoE layers


def test_bad_moe_configs_are_refused():
    with pytest.raises(ModelError, match="num_experts_per_tok"):
        moe_config(num_experts_per_tok=9)
    with pytest.raises(ModelError, match="router scoring"):
        moe_config(router_scoring="relu")
    with pytest.raises(ModelError, match="groups"):
        moe_config(n_group=3)


def test_token_dispatch_combine_and_permutation_backwards_equal_indexing():
    """The experts' gather-only dispatch, combine and permutation give indexing's own values and gradients."""
    from entrenar.models.moe import _Combine, _Dispatch, _Permute, gather_sum_reference

    torch.manual_seed(0)
    n, k, h = 7, 3, 5
    order = torch.argsort(torch.randint(0, 4, (n * k,)), stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n * k))
    tokens = order // k
    x = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _Dispatch.apply(t, tokens, inverse, k, gather_sum_reference), (x,))
    ys = torch.randn(n * k, h, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _Permute.apply(t, inverse, order), (ys,))
    assert torch.autograd.gradcheck(lambda t: _Combine.apply(t, tokens, inverse, k, gather_sum_reference), (ys,))
    grad = torch.randn(n * k, h, dtype=torch.float64)
    mine = torch.autograd.grad(_Dispatch.apply(x, tokens, inverse, k, gather_sum_reference), x, grad)[0]
    torch.testing.assert_close(mine, torch.autograd.grad(x[tokens], x, grad)[0], atol=1e-12, rtol=0)
    # Combine sums each token's k rows, wherever the sort put them.
    combined = _Combine.apply(ys, tokens, inverse, k, gather_sum_reference)
    torch.testing.assert_close(combined, ys[inverse].view(n, k, h).sum(dim=1), atol=1e-12, rtol=0)
    by_hand = torch.zeros(n, h, dtype=torch.float64).index_add_(0, tokens, ys.detach())
    torch.testing.assert_close(combined.detach(), by_hand, atol=1e-12, rtol=0)


def test_routed_swiglu_reference_folds_the_routing_weight_in():
    """silu(gate) * up * w per row, with gradients for gate_up and for each row's weight (gradcheck)."""
    from entrenar.models.moe import routed_swiglu_reference

    torch.manual_seed(0)
    gate_up = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(6, dtype=torch.float64, requires_grad=True)
    gate, up = gate_up.detach()[:, :4], gate_up.detach()[:, 4:]
    expected = gate * torch.sigmoid(gate) * up * scale.detach()[:, None]
    torch.testing.assert_close(routed_swiglu_reference(gate_up, scale).detach(), expected, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(routed_swiglu_reference, (gate_up, scale))


# DeepSeek-V3's routing keys in a config.json / model.config of any MoE family.
ROUTED = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, norm_topk_prob=True)


def test_deepseek_routing_keys_are_read_and_written_back():
    hf = {**ROUTED, "scoring_func": "sigmoid", "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
          "n_shared_experts": 2}
    config = ModelConfig.from_hf(hf)
    assert (config.router_scoring, config.n_group, config.topk_group, config.routed_scaling_factor) == \
        ("sigmoid", 2, 1, 2.5)
    assert (config.shared_expert_intermediate_size, config.shared_expert_gate) == (32, False)  # 2 experts of 16
    written = config.to_hf()
    assert {k: written[k] for k in ("scoring_func", "n_group", "topk_group", "routed_scaling_factor",
                                    "n_shared_experts")} == {k: hf[k] for k in written if k in hf and k in (
                                        "scoring_func", "n_group", "topk_group", "routed_scaling_factor",
                                        "n_shared_experts")}
    assert ModelConfig.from_hf(written) == config
    plain = ModelConfig.from_hf(ROUTED).to_hf()  # the family's own routing: none of DeepSeek's keys written
    assert not {"scoring_func", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts"} & set(plain)


@pytest.mark.parametrize("change, message", [
    ({"scoring_func": "relu"}, "'scoring_func' must be one of softmax, softmax_topk, sigmoid"),
    ({"n_group": 3}, "4 experts cannot form 3 groups"),
    ({"n_group": 0}, "'n_group' must be a positive integer"),
    ({"routed_scaling_factor": -1}, "'routed_scaling_factor' must be a positive finite number"),
    ({"model_type": "qwen2_moe", "n_shared_experts": 1}, "'n_shared_experts' is DeepSeek's"),
])
def test_bad_deepseek_routing_keys_name_the_key(change, message):
    with pytest.raises(ModelError, match=message):
        ModelConfig.from_hf({**ROUTED, **change}, source="model.config")


def test_sigmoid_grouped_router_from_config_matches_a_hand_computed_route():
    """Sigmoid scores, a selection-only bias and grouped top-k, worked out by hand for one token."""
    import math

    from entrenar.models.moe import Router

    config = ModelConfig.from_hf({**ROUTED, "scoring_func": "sigmoid", "n_group": 2, "topk_group": 1,
                                  "routed_scaling_factor": 2.0})
    router = Router(config)
    router.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.6, 0.0]))
    logits = torch.tensor([[3.0, 0.5, 0.5, 1.0]])
    _, weights, indices = router.route_logits(logits, torch.float32)
    s = [1 / (1 + math.exp(-v)) for v in (3.0, 0.5, 0.5, 1.0)]  # 0.953 0.622 0.622 0.731
    # With the bias, group {2, 3} scores 0.622+0.6 + 0.731 = 1.953 > group {0, 1}'s 0.953 + 0.622 = 1.575: it alone
    # is kept, so experts 2 and 3 are chosen although expert 0 has the highest score; the weights are the plain
    # sigmoid scores (no bias) renormalised, times routed_scaling_factor.
    assert sorted(indices[0].tolist()) == [2, 3]
    order = indices[0].argsort()
    expected = torch.tensor([s[2], s[3]]) / (s[2] + s[3]) * 2.0
    torch.testing.assert_close(weights[0][order], expected, atol=1e-6, rtol=0)
    # Without the bias group {0, 1} wins (1.575 > 0.622 + 0.731 = 1.353) and its two experts are taken.
    router.e_score_correction_bias.zero_()
    _, weights, indices = router.route_logits(logits, torch.float32)
    assert sorted(indices[0].tolist()) == [0, 1]
    torch.testing.assert_close(weights[0][indices[0].argsort()],
                               torch.tensor([s[0], s[1]]) / (s[0] + s[1]) * 2.0, atol=1e-6, rtol=0)


def test_a_sigmoid_model_from_scratch_saves_and_loads_back_with_its_selection_bias(tmp_path):
    import entrenar
    from entrenar.config import Recipe
    from entrenar.export import save_merged
    from entrenar.models import random_init as scratch

    hf = {**ROUTED, "vocab_size": 259, "scoring_func": "sigmoid", "n_group": 2, "topk_group": 2,
          "n_shared_experts": 1}
    recipe = Recipe.from_dict({"model": {"init": "random", "device": "cpu", "config": hf},
                               "data": {"train": "synth:mixture:8"}})
    model, tok = scratch.build(recipe, "float32", "cpu")
    block = model.model.layers[0].mlp
    assert block.gate.scoring == "sigmoid" and block.shared_expert is not None and block.shared_expert_gate is None
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(std=0.5)
    save_merged(model, tok, tmp_path / "m")
    loaded, _ = entrenar.load(tmp_path / "m", dtype="float32", device="cpu")
    assert torch.equal(loaded.model.layers[1].mlp.gate.e_score_correction_bias,
                       model.model.layers[1].mlp.gate.e_score_correction_bias)
    ids = torch.tensor([tok.encode("abc~cba")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)


def test_expert_offsets_are_the_running_token_counts_of_sorted_experts():
    from entrenar.models.moe import expert_offsets

    flat = torch.tensor([3, 0, 3, 5, 0, 3, 1])  # experts 2 and 4 get nothing, 5 is the last
    sorted_experts = flat.sort().values
    offsets = expert_offsets(sorted_experts, 6)
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == torch.bincount(flat, minlength=6).cumsum(0).tolist() == [2, 3, 3, 6, 6, 7]
    assert expert_offsets(torch.zeros(0, dtype=torch.long), 3).tolist() == [0, 0, 0]
