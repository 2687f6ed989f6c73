"""Activation offload on a GPU: what the blocks save leaves GPU memory, and the gradients stay the same."""

from __future__ import annotations

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
from entrenar.kernels import apply_kernels
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer
from entrenar.quant.nf4.format import quantize_model_nf4
from entrenar.train.cuda_graph import GraphedMicroStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading moves GPU memory to the CPU")

CONFIG = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_layers=6, num_heads=8,
                     num_kv_heads=4, model_type="llama")
LAYER_INPUT = 2 * 4096 * CONFIG.hidden_size * 2  # [B, T, hidden] bf16 at the tests' batch


def _model(checkpointing, offload: bool, qlora: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(CONFIG).cuda().to(torch.bfloat16)
    model.reset_parameters()
    if qlora:
        quantize_model_nf4(model)
        apply_lora(model, LoraConfig(r=8, alpha=16.0))
        for p in lora_parameters(model):
            torch.nn.init.normal_(p, std=0.02)
        apply_kernels(model, lora_compute_dtype=torch.bfloat16)
    model.set_activation_checkpointing(checkpointing, offload=offload)
    return model


def _loss(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    return model.hidden_states(ids).float().square().mean()


def _held_after_forward(model: Transformer, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model.hidden_states(ids)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes(), out


def _grads(model: Transformer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_gradients(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert grads.keys() == reference.keys() and len(grads) > 0
    for name, grad in reference.items():
        # Not bit for bit: the attention backward (FlashAttention / cuDNN) and the embedding's backward add
        # with atomics in no fixed order, so two runs of the same step differ within bf16 rounding.
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=2e-2, msg=name)


@pytest.mark.parametrize("qlora", [False, True], ids=["plain", "qlora-kernels"])
@pytest.mark.parametrize("checkpointing", [True, False, [1, 3]], ids=["all-checkpointed", "none", "some"])
def test_offload_moves_saved_activations_to_the_cpu_and_keeps_the_gradients(checkpointing, qlora):
    """Plain blocks, and the fused nodes of the QLoRA path, whose outputs are views of tensors their forward
    made (activations all the same)."""
    ids = torch.randint(0, CONFIG.vocab_size, (2, 4096), device="cuda")
    results = {}
    for offload in (False, True):
        model = _model(checkpointing, offload, qlora)
        held, out = _held_after_forward(model, ids)
        out.float().square().mean().backward()
        results[offload] = held, _grads(model)
        del model, out
    (held_on_gpu, grads), (held_offloaded, grads_offloaded) = results[False], results[True]
    _assert_same_gradients(grads_offloaded, grads)
    # After forward the GPU still holds the last layer's saves and those of the two before it, whose copies to the
    # CPU the compute stream has not waited for yet; the other three layers' are gone.
    if checkpointing is True:  # every layer keeps only its input
        assert held_on_gpu >= CONFIG.num_layers * LAYER_INPUT
        # a frozen embedding's output, the first layer's input, has no autograd history: it stays, as weights do
        gone = 2 if qlora else 3
        assert held_offloaded <= held_on_gpu - gone * LAYER_INPUT, (held_on_gpu, held_offloaded)
    if checkpointing is False:  # every layer keeps all it saves, the same for each layer
        assert held_offloaded <= held_on_gpu * 3.2 / CONFIG.num_layers, (held_on_gpu, held_offloaded)


def test_offloaded_qlora_blocks_give_the_gradients_of_blocks_on_the_gpu():
    """The loop's QLoRA path (NF4 base, fused LoRA nodes, bf16 adapter products), some blocks checkpointed."""
    ids = torch.randint(0, CONFIG.vocab_size, (2, 1024), device="cuda")
    grads = {}
    for offload in (False, True):
        model = _model([0, 2, 4], offload, qlora=True)
        _loss(model, ids).backward()
        grads[offload] = dict(enumerate(p.grad.clone() for p in lora_parameters(model)))
    _assert_same_gradients(grads[True], grads[False])


def test_a_cuda_graph_replays_the_copies_and_steps_reuse_their_pinned_buffers():
    ids = torch.randint(0, CONFIG.vocab_size, (2, 1024), device="cuda")
    eager = _model([1, 3], offload=False, qlora=True)
    _loss(eager, ids).backward()
    reference = dict(enumerate(p.grad.clone() for p in lora_parameters(eager)))
    del eager

    model = _model([1, 3], offload=True, qlora=True)
    params = lora_parameters(model)

    def micro_step(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = _loss(model, inputs["ids"])
        loss.backward()
        return loss.detach()

    step = GraphedMicroStep(micro_step, params, warmup=2)
    pinned = []
    for _ in range(5):  # two eager warm-up calls, the capture, two replays
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        step({"ids": ids})
        pinned.append(sum(len(buffers) for buffers in model.activation_offload._pool.values()))
    assert step.graph is not None
    assert pinned[0] > 0 and len(set(pinned)) == 1, pinned  # one set of pinned buffers, reused every step
    _assert_same_gradients(dict(enumerate(p.grad for p in params)), reference)


def test_a_backward_that_stops_short_leaves_no_copy_running_and_frees_the_buffers():
    """backward(inputs=...) reads only the last layers: the block prefetched ahead is never unpacked, and the
    end-of-backward callback still joins its copy (a CUDA graph capture would fail otherwise)."""
    ids = torch.randint(0, CONFIG.vocab_size, (2, 1024), device="cuda")
    model = _model(False, offload=True)
    last = list(model.model.layers[-2].parameters())
    loss = _loss(model, ids)
    loss.backward(inputs=last)
    torch.cuda.synchronize()
    assert all(p.grad is not None for p in last)
    assert all(p.grad is None for p in model.model.layers[0].parameters())
    del loss
    assert not model.activation_offload._in_use  # every pinned buffer back in the pool


def test_a_graph_dropped_without_backward_frees_its_gpu_memory_and_buffers():
    """A forward whose loss is never backpropagated (a skipped step) leaves nothing behind once dropped."""
    ids = torch.randint(0, CONFIG.vocab_size, (2, 1024), device="cuda")
    model = _model(False, offload=True)
    _loss(model, ids).backward()  # the pool's buffers exist from here on
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = _loss(model, ids)
    torch.cuda.synchronize()
    assert model.activation_offload._in_use
    del loss
    torch.cuda.synchronize()
    assert not model.activation_offload._in_use
    assert torch.cuda.memory_allocated() <= before


def test_mixed_precision_weights_stay_on_the_gpu():
    """Under autocast the bf16 casts of fp32 weights are saved for backward: weights, not activations."""
    torch.manual_seed(0)
    model = Transformer(CONFIG).cuda()
    model.reset_parameters()
    model.set_activation_checkpointing(False, offload=True)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 1024), device="cuda")
    offload = model.activation_offload
    weight_shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    seen = []  # (shape, offloaded) of each big tensor a block saved
    pack = offload._pack

    def recording_pack(group, t):
        packed = pack(group, t)
        if t.untyped_storage().nbytes() >= offload.min_bytes:
            seen.append((tuple(t.shape), not isinstance(packed, torch.Tensor)))
        return packed

    offload._pack = recording_pack
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = _loss(model, ids)
    loss.backward()
    weights = [offloaded for shape, offloaded in seen if shape in weight_shapes]
    activations = [offloaded for shape, offloaded in seen if shape not in weight_shapes]
    assert weights and not any(weights)  # the casts were saved, and stayed
    assert activations and all(activations)


def test_a_retained_graph_brings_the_activations_back_for_a_second_backward():
    ids = torch.randint(0, CONFIG.vocab_size, (2, 1024), device="cuda")
    reference_model = _model(False, offload=False)
    _loss(reference_model, ids).backward()
    reference = _grads(reference_model)
    model = _model(False, offload=True)
    loss = _loss(model, ids)
    loss.backward(retain_graph=True)
    loss.backward()
    _assert_same_gradients({n: g / 2 for n, g in _grads(model).items()}, reference)


def test_offloading_the_first_layers_only_keeps_the_others_on_the_gpu():
    ids = torch.randint(0, CONFIG.vocab_size, (2, 4096), device="cuda")
    reference = _model(False, offload=False)
    held_on_gpu, out = _held_after_forward(reference, ids)
    out.float().square().mean().backward()
    model = _model(False, offload=2)
    held, out = _held_after_forward(model, ids)
    out.float().square().mean().backward()
    _assert_same_gradients(_grads(model), _grads(reference))
    assert {block for block, _ in model.activation_offload._pool} == {0, 1}
    # Two of six layers offloaded, their copies done (waited for two layers later): four layers' worth stays.
    assert held <= held_on_gpu * 4.2 / CONFIG.num_layers, (held_on_gpu, held)
    assert held >= held_on_gpu * 3.8 / CONFIG.num_layers, (held_on_gpu, held)
