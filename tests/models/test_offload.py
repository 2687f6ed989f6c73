"""What activation offload leaves where it is, checked on the CPU (the copies themselves need a GPU)."""

from __future__ import annotations

import torch

from entrenar.models.config import ModelConfig
from entrenar.models.offload import _is_weight
from entrenar.models.transformer import Transformer


def test_weights_and_their_autocast_copies_are_not_activations():
    weight = torch.randn(8, 4, requires_grad=True)
    frozen = torch.randn(8, 4)
    activation = torch.randn(3, 4, requires_grad=True) * 2
    cast = weight.to(torch.bfloat16)  # what autocast saves for a product with an fp32 trained weight
    assert _is_weight(weight) and _is_weight(frozen) and _is_weight(frozen.to(torch.bfloat16))
    assert _is_weight(cast) and _is_weight(cast.t())  # the transposed cast a linear layer's backward reads
    assert not _is_weight(activation) and not _is_weight(activation.t())
    assert not _is_weight(activation.to(torch.bfloat16))  # an activation cast is still an activation


class _Projection(torch.autograd.Function):
    """As the fused nodes do: the output made inside forward (no history) and returned as a view of it."""

    @staticmethod
    def forward(ctx, x, weight):
        out = x.reshape(-1, x.shape[-1]) @ weight.T
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError


def test_a_nodes_output_viewing_what_its_forward_made_is_an_activation():
    x = torch.randn(2, 3, 4, requires_grad=True)
    out = _Projection.apply(x, torch.randn(5, 4))
    assert out._is_view() and out._base.grad_fn is None  # the view's storage was made without history
    assert not _is_weight(out) and not _is_weight(out.transpose(1, 2))


def test_offload_on_a_cpu_model_changes_nothing():
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                         num_kv_heads=2)
    torch.manual_seed(0)
    model = Transformer(config)
    model.reset_parameters()
    ids = torch.randint(0, 64, (2, 7))
    model(ids).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_activation_checkpointing([1], offload=True)
    model(ids).sum().backward()
    assert model.activation_offload._pool == {}  # CPU tensors stay where they are
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)
