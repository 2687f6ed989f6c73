"""The native model against transformers: same logits, loss and gradients per family."""

from __future__ import annotations

import pytest
import torch
from family_checks import shifted_ce

from conftest import FAMILIES
from entrenar.models.hf import load_hf

FAMILY_NAMES = list(FAMILIES)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_logits_loss_and_gradients_match_transformers(hf_folder, family):
    folder, ref = hf_folder(family)
    model = load_hf(folder).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 48))  # longer than mistral's sliding window of 16
    labels = ids.clone()
    labels[:, :5] = -100

    ref_out = ref(ids, labels=labels)
    logits = model(ids)
    assert logits.shape == (2, 48, 128)
    torch.testing.assert_close(logits, ref_out.logits, atol=1e-4, rtol=0)

    loss = shifted_ce(logits, labels)
    torch.testing.assert_close(loss, ref_out.loss, atol=1e-5, rtol=0)

    ref_out.loss.backward()
    loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_matches_transformers_in_bf16(hf_folder, family):
    folder, ref = hf_folder(family)
    ref = ref.to(torch.bfloat16)
    model = load_hf(folder, dtype=torch.bfloat16).eval()
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model.inv_freq.dtype == torch.float32
    ids = torch.randint(0, 128, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=2e-2, rtol=2e-2)


def test_packed_documents_do_not_see_each_other(hf_folder):
    """A packed row gives each document the logits it gets alone."""
    folder, _ = hf_folder("qwen3")
    model = load_hf(folder).eval()
    a, b = torch.randint(0, 128, (1, 7)), torch.randint(0, 128, (1, 9))
    packed = torch.cat([a, b], dim=1)
    position_ids = torch.cat([torch.arange(7), torch.arange(9)])[None]
    document_ids = torch.tensor([[0] * 7 + [1] * 9])
    with torch.no_grad():
        out = model(packed, position_ids=position_ids, document_ids=document_ids)
        torch.testing.assert_close(out[:, :7], model(a), atol=1e-5, rtol=0)
        torch.testing.assert_close(out[:, 7:], model(b), atol=1e-5, rtol=0)
        # Without the document ids the second document attends to the first: the test can fail.
        leaky = model(packed, position_ids=position_ids)
        assert (leaky[:, 7:] - model(b)).abs().max() > 1e-3


def test_activation_checkpointing_gives_the_same_gradients(hf_folder):
    folder, _ = hf_folder("llama")
    ids = torch.randint(0, 128, (2, 16))
    grads = []
    for layers in (False, True):
        model = load_hf(folder)
        model.set_activation_checkpointing(layers)
        model(ids).float().logsumexp(-1).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=0)
