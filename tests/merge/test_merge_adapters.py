"""Merging LoRA adapters into one adapter: the merged update against the formula, and PEFT loading the result."""

from __future__ import annotations

import pytest
import torch

from entrenar.merge import merge
from entrenar.merge import methods as M
from entrenar.merge.adapters import svd_factors


@pytest.fixture
def adapters(tmp_path):
    """A tiny Llama and two PEFT adapters on it (different ranks, targets and scales); returns (base, [a, b])."""
    import peft

    from conftest import make_hf_model

    base = make_hf_model("llama")
    base.save_pretrained(tmp_path / "base")
    folders = []
    for i, (r, alpha, targets) in enumerate([(4, 8, ["q_proj", "v_proj"]), (2, 6, ["q_proj", "down_proj"])]):
        torch.manual_seed(10 + i)
        model = peft.get_peft_model(make_hf_model("llama"), peft.LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False))
        model.save_pretrained(tmp_path / f"ad{i}")
        folders.append(tmp_path / f"ad{i}")
    return tmp_path / "base", folders


def deltas(folder):
    """Each module's ΔW = (alpha/r) B A, as PEFT computes it."""
    import json

    from safetensors.torch import load_file

    cfg = json.loads((folder / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    sd = load_file(folder / "adapter_model.safetensors")
    return {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight"):
            scale * (sd[k.replace("lora_A", "lora_B")] @ sd[k]) for k in sd if "lora_A" in k}


def peft_delta(base, adapter, module):
    """The weight PEFT gets for ``module`` after loading ``adapter`` on ``base`` and merging, minus the base's."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    w0 = model.get_submodule(module).weight.detach().clone()
    merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return merged.get_submodule(module).weight.detach() - w0


def test_linear_concatenation_is_exact_and_peft_loads_it(adapters, tmp_path):
    base, (a, b) = adapters
    merge({"merge_method": "linear", "models": [{"model": str(a), "parameters": {"weight": 1.0}},
                                                {"model": str(b), "parameters": {"weight": 3.0}}]}, tmp_path / "cat")
    da, db = deltas(a), deltas(b)
    q = "model.layers.0.self_attn.q_proj"
    assert torch.allclose(peft_delta(base, tmp_path / "cat", q), (da[q] + 3 * db[q]) / 4, atol=1e-6)
    v = "model.layers.1.self_attn.v_proj"  # only the first adapter targets v_proj
    assert torch.allclose(peft_delta(base, tmp_path / "cat", v), da[v] / 4, atol=1e-6)


def test_ties_with_svd_to_a_rank(adapters, tmp_path):
    base, (a, b) = adapters
    merge({"merge_method": "ties", "models": [{"model": str(a), "parameters": {"weight": 1.0, "density": 0.5}},
                                              {"model": str(b), "parameters": {"weight": 1.0, "density": 0.5}}],
           "parameters": {"rank": 3}}, tmp_path / "ties")
    da, db = deltas(a), deltas(b)
    q = "model.layers.1.self_attn.q_proj"
    dense = M.task_arithmetic_family(M.METHODS["ties"].recipe, torch.zeros_like(da[q]), [da[q], db[q]], [1.0, 1.0],
                                     [0.5, 0.5], normalize=True)
    u, s, vh = torch.linalg.svd(dense)
    want = u[:, :3] @ torch.diag(s[:3]) @ vh[:3]
    assert torch.allclose(peft_delta(base, tmp_path / "ties", q), want, atol=1e-5)


def test_svd_factors_are_the_best_low_rank_approximation():
    torch.manual_seed(0)
    x = torch.randn(6, 3) @ torch.randn(3, 5)  # rank 3
    b, a = svd_factors(x, 3)
    assert b.shape == (6, 3) and a.shape == (3, 5) and torch.allclose(b @ a, x, atol=1e-5)
    b, a = svd_factors(x, 8)  # more than the matrix allows: zero-padded
    assert b.shape == (6, 8) and torch.allclose(b @ a, x, atol=1e-5)
