"""Checkpointed blocks rerun their forward in backward without the MLP's last product, and get the same gradients."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
from entrenar.kernels import apply_kernels, norm_projections
from entrenar.models.config import ModelConfig
from entrenar.models.recompute import checkpointed, recomputing
from entrenar.models.transformer import Transformer
from entrenar.quant.nf4.format import quantize_model_nf4

CONFIG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
RANK = 4


def _model(nf4: bool) -> Transformer:
    torch.manual_seed(21)
    model = Transformer(CONFIG)
    model.reset_parameters()
    if nf4:
        quantize_model_nf4(model)
    apply_lora(model, LoraConfig(r=RANK, alpha=8.0))
    for p in lora_parameters(model):
        nn.init.normal_(p, std=0.05)  # B = 0 would hide every gradient but dB
    apply_kernels(model)
    return model


def _loss_and_grads(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    loss = model(ids).logsumexp(-1).mean()
    return loss.detach(), torch.autograd.grad(loss, lora_parameters(model))


@pytest.mark.parametrize("nf4", [False, True], ids=["fp32-base", "nf4-base"])
def test_checkpointed_blocks_give_the_gradients_of_uncheckpointed_ones(nf4):
    plain = _model(nf4)
    recomputed = copy.deepcopy(plain)
    recomputed.set_activation_checkpointing(True)
    ids = torch.randint(0, 64, (2, 11))
    loss, grads = _loss_and_grads(plain, ids)
    loss_ckpt, grads_ckpt = _loss_and_grads(recomputed, ids)
    assert torch.equal(loss_ckpt, loss)
    for g_ckpt, g in zip(grads_ckpt, grads, strict=True):
        assert torch.equal(g_ckpt, g)  # the rerun saves bit for bit what the first run saved


def _addmm_flop(c_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def _backward_flops(model: Transformer, ids: torch.Tensor) -> int:
    loss = model(ids).logsumexp(-1).mean()
    # In-place addmm_ (the fused LoRA layer's base product, adding into the adapter's) counted as addmm.
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_flop}) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_the_rerun_skips_the_down_projection_and_nothing_else(monkeypatch):
    swiglu_module = importlib.import_module("entrenar.kernels.swiglu")  # the package re-exports a function of that name
    model = _model(nf4=False)
    model.set_activation_checkpointing(True)
    ids = torch.randint(0, 64, (2, 11))
    products = []
    real_swiglu = swiglu_module.swiglu
    monkeypatch.setattr(swiglu_module, "swiglu", lambda *a, **k: products.append(1) or real_swiglu(*a, **k))
    skipping = _backward_flops(model, ids)
    swiglus_skipping = len(products)
    monkeypatch.setattr(norm_projections, "recomputing", lambda: False)  # the rerun computes everything
    full = _backward_flops(model, ids)
    # silu(gate) * up per block: forward's and backward's rebuild; a full rerun forms it once more in between
    assert swiglus_skipping == 2 * CONFIG.num_layers
    assert len(products) - swiglus_skipping == 3 * CONFIG.num_layers
    tokens = ids.numel()
    # per block: the base product [tokens, intermediate] x [intermediate, hidden] and the adapter's B product
    base = 2 * tokens * CONFIG.intermediate_size * CONFIG.hidden_size
    adapter = 2 * tokens * RANK * CONFIG.hidden_size
    assert full - skipping == CONFIG.num_layers * (base + adapter)


def test_recomputing_is_set_only_during_the_rerun():
    seen = []

    def layer(x: torch.Tensor) -> torch.Tensor:
        seen.append(recomputing())
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    y = checkpointed(layer, x)
    assert seen == [False] and not recomputing()
    y.sum().backward()
    assert seen == [False, True] and not recomputing()
    torch.testing.assert_close(x.grad, x.detach().cos())


def test_a_rerun_in_one_thread_is_not_seen_in_another():
    """Two models training in two threads (one per GPU) must not skip work because of each other's reruns."""
    import threading

    from entrenar.models.recompute import _rerun

    seen = {}
    with _rerun():
        other = threading.Thread(target=lambda: seen.setdefault("other thread", recomputing()))
        other.start()
        other.join()
        assert recomputing()
        with _rerun():
            assert recomputing()
        assert recomputing()  # a nested rerun's exit restores, not clears
    assert seen == {"other thread": False} and not recomputing()


def test_offloaded_layers_are_every_one_but_the_last_or_the_first_n():
    from entrenar.models.transformer import offloaded_layer_indices

    assert offloaded_layer_indices(4, True) == [0, 1, 2]
    assert offloaded_layer_indices(4, False) == []
    assert offloaded_layer_indices(4, 2) == [0, 1]
    assert offloaded_layer_indices(4, 4) == [0, 1, 2]  # the last layer's saves stay: backward reads them first
    with pytest.raises(ValueError, match="cannot offload 5 layers of a 4-layer model"):
        offloaded_layer_indices(4, 5)
    model = Transformer(CONFIG)
    model.set_activation_checkpointing([0], offload=1)
    assert (model.checkpointed_layers, model.offloaded_layers) == ({0}, {0})
    model.set_activation_offload(False)
    assert model.activation_offload is None
