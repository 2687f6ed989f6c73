"""MoE families against transformers: same logits, loss and gradients; saved back in the same layout."""

from __future__ import annotations

import json

import pytest
import torch
from family_checks import shifted_ce
from safetensors import safe_open

from conftest import MOE_FAMILIES
from entrenar.models.hf import load_hf, save_hf
from entrenar.models.moe import MoeBlock, moe_blocks, set_experts_implementation

NAMES = list(MOE_FAMILIES)


@pytest.mark.parametrize("family", NAMES)
def test_logits_loss_and_gradients_match_transformers(hf_folder, family):
    folder, ref = hf_folder(family)
    model = load_hf(folder).eval()
    assert moe_blocks(model), "the MoE layers were built as dense MLPs"
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 24))
    labels = ids.clone()
    labels[:, :3] = -100
    ref_out = ref(ids, labels=labels)
    logits = model(ids)
    torch.testing.assert_close(logits, ref_out.logits, atol=1e-4, rtol=0)
    loss = shifted_ce(logits, labels)
    torch.testing.assert_close(loss, ref_out.loss, atol=1e-5, rtol=0)
    ref_out.loss.backward()
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    ours = dict(model.named_parameters())
    assert set(ours) == set(ref_grads)  # the same parameter names as transformers' modules
    for name, p in ours.items():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_dense_layers_follow_the_config(hf_folder):
    """Qwen-MoE's mlp_only_layers and decoder_sparse_step keep some layers dense, as transformers builds them."""
    for family, moe_layers in (("qwen2_moe", [1, 2]), ("qwen3_moe", [1])):
        folder, ref = hf_folder(family)
        model = load_hf(folder)
        assert [i for i, _ in moe_blocks(model)] == moe_layers
        assert [i for i, layer in enumerate(ref.model.layers) if "Sparse" in type(layer.mlp).__name__] == moe_layers


@pytest.mark.parametrize("family", NAMES)
def test_save_round_trip_in_the_checkpoint_layout(hf_folder, tmp_path, family):
    import transformers

    folder, ref = hf_folder(family)
    model = load_hf(folder)
    out = save_hf(model, tmp_path / "saved")
    with safe_open(str(folder / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())  # the per-expert names save_pretrained writes
        for key in a.keys():
            torch.testing.assert_close(a.get_tensor(key), b.get_tensor(key), atol=0, rtol=0, msg=key)
    config = json.loads((out / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(ref) and back.config.num_experts_per_tok == ref.config.num_experts_per_tok
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
    assert config["model_type"] == family


def test_missing_expert_is_named(hf_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    from entrenar.errors import ModelError

    folder, _ = hf_folder("qwen3_moe")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelError, match=r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"):
        load_hf(folder)


def test_grouped_products_equal_the_loop_forward_and_backward(hf_folder):
    """The grouped-GEMM path (torch._grouped_mm, also on the CPU here) against the per-expert loop."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this PyTorch has no torch._grouped_mm")
    folder, _ = hf_folder("qwen3_moe")
    ids = torch.randint(0, 128, (2, 16))
    results = []
    for impl in ("loop", "grouped"):
        model = load_hf(folder)
        set_experts_implementation(model, impl)
        model(ids).float().logsumexp(-1).mean().backward()
        results.append((model(ids).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=0)
    for name in results[0][1]:
        torch.testing.assert_close(results[0][1][name], results[1][1][name], atol=1e-6, rtol=1e-5, msg=name)
    assert isinstance(load_hf(folder).model.layers[1].mlp, MoeBlock)
