"""NF4 base weights streamed block by block (training.offload_weights): same numbers, buffers at rest on the host.

On a CPU the stream still gives each block a copy of its own while it runs (what a GPU would get), so these
tests see the hooks' order: a block computes on its copy, checkpointed blocks fetch again when they rerun in
backward, and between blocks every buffer is back in the pinned (here: plain) host buffer.
"""

from __future__ import annotations

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.kernels import apply_kernels
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer
from entrenar.quant.nf4.format import NF4Linear, quantize_model_nf4
from entrenar.quant.nf4.streaming import stream_weights


def _qlora(layers: int = 3, kernels: bool = False) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=layers, num_heads=4,
                         num_kv_heads=2, model_type="llama")
    model = Transformer(config)
    model.reset_parameters()
    quantize_model_nf4(model.model.layers)
    apply_lora(model, LoraConfig(r=4, alpha=8.0, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    if kernels:
        apply_kernels(model)
    return model


def _loss_and_grads(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _on_host(stream, block: int) -> bool:
    host = stream.blocks[block].host
    lo, hi = host.data_ptr(), host.data_ptr() + host.numel()
    return all(lo <= getattr(m, name).data_ptr() < hi for m, name, *_ in stream.blocks[block].layout)


@pytest.mark.parametrize("checkpointed", [True, [1], False], ids=["all-checkpointed", "one-checkpointed", "none"])
@pytest.mark.parametrize("kernels", [False, True], ids=["plain", "kernels"])
def test_streamed_weights_give_the_same_loss_and_gradients(checkpointed, kernels):
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    reference = _qlora(kernels=kernels)
    reference.set_activation_checkpointing(checkpointed)
    want_loss, want_grads = _loss_and_grads(reference, ids)

    model = _qlora(kernels=kernels)
    model.set_activation_checkpointing(checkpointed)
    stream = stream_weights(model, torch.device("cpu"))
    assert stream is not None
    nf4_bytes = sum(m.quantized.nbytes for m in model.model.layers.modules() if isinstance(m, NF4Linear))
    assert nf4_bytes <= stream.host_bytes < nf4_bytes + 256 * 4 * 7 * 3  # every buffer, each padded to 256 bytes

    seen = []  # (block, ran on a copy of its own) for every forward of a block, reruns included
    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(lambda _m, _a, i=i: seen.append((i, not _on_host(stream, i))))
    loss, grads = _loss_and_grads(model, ids)

    assert torch.equal(loss, want_loss)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, want_grads[name]), name
    reruns = [i for i in range(3) if checkpointed is True or i in (checkpointed or [])]
    assert [i for i, _ in seen] == [0, 1, 2] + sorted(reruns, reverse=True)
    assert all(own for _, own in seen)
    # at rest, every block's weights are in host memory, but for the last rerun's (freed by the next forward)
    assert all(_on_host(stream, i) for i in range(3) if i != (min(reruns) if reruns else None))


def test_a_second_step_and_evaluation_read_the_host_weights_again():
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    reference = _qlora()
    reference.set_activation_checkpointing(True)
    model = _qlora()
    model.set_activation_checkpointing(True)
    stream_weights(model, torch.device("cpu"))
    for _ in range(2):
        assert torch.equal(_loss_and_grads(model, ids)[0], _loss_and_grads(reference, ids)[0])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


def test_a_model_without_nf4_blocks_has_nothing_to_stream():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                    num_kv_heads=2, model_type="llama"))
    apply_lora(model, LoraConfig(r=2, alpha=4.0))
    assert stream_weights(model, torch.device("cpu")) is None


def test_nf4_buffers_kept_in_host_memory_stay_through_device_moves_and_quantize_alike():
    torch.manual_seed(0)
    w = torch.randn(48, 64)
    plain = NF4Linear(64, 48, bias=True)
    plain.load_full_weight(w)
    held = NF4Linear(64, 48, bias=True, device="meta")
    held.keep_in_host_memory(quantize_on=torch.device("cpu"))
    held.to_empty(device="meta")  # what empty_model does to the rest of the model
    assert held.bias.is_meta and all(t.device.type == "cpu" for n, t in held.named_buffers())
    held.load_full_weight(w)
    for name, t in plain.named_buffers():
        assert torch.equal(getattr(held, name), t), name


def test_adapters_of_a_base_kept_in_host_memory_live_where_it_computes():
    from entrenar.adapters.lora import LoraLinear

    base = NF4Linear(64, 48, bias=False, device="meta")
    base.keep_in_host_memory(quantize_on=torch.device("meta"))  # stands for the GPU the base computes on
    adapted = LoraLinear(base, r=4, alpha=8.0)
    assert base.weight_codes.device.type == "cpu"
    assert all(p.is_meta for p in adapted.parameters())


def _copies_alive_after_forward(model: Transformer, stream, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
    """How many blocks' weight copies something still refers to once forward is done (before backward)."""
    storages = []
    fetch = stream._fetch

    def recording(i):
        new = i not in stream._pending
        fetch(i)
        if new and i in stream._pending:
            storages.append(stream._pending[i][0].untyped_storage())

    stream._fetch = recording
    logits = model(ids)
    # a storage nothing else refers to is held by this list alone (and the pending entry of a prefetch)
    alive = sum(torch._C._storage_Use_Count(st._cdata) > 1 for st in storages)
    return alive, logits


@pytest.mark.parametrize("kernels", [False, True], ids=["plain", "kernels"])
def test_checkpointed_blocks_hold_no_copy_between_forward_and_backward(kernels):
    """Products keep the weights they read through save_for_backward, which checkpointing drops: after forward
    only the last block's copy (prefetched for backward's first rerun) is alive; without checkpointing, all."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    for checkpointed, expected in ((True, 1), (False, 3)):
        model = _qlora(kernels=kernels)
        model.set_activation_checkpointing(checkpointed)
        stream = stream_weights(model, torch.device("cpu"))
        alive, logits = _copies_alive_after_forward(model, stream, ids)
        assert alive == expected
        logits.float().sum().backward()
        assert not stream._pending


def test_backward_that_stops_above_a_block_prefetches_nothing_for_it():
    """LoRA on the last block only: backward never reruns the blocks below, so none is prefetched for them (an
    unused side-stream copy would also break a CUDA graph capture)."""
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))

    def build():
        torch.manual_seed(0)
        config = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
                             num_kv_heads=2, model_type="llama")
        model = Transformer(config)
        model.reset_parameters()
        quantize_model_nf4(model.model.layers)
        apply_lora(model, LoraConfig(r=4, alpha=8.0, target_modules=["layers.2.mlp.down_proj"]))
        model.set_activation_checkpointing(True)
        return model

    reference, model = build(), build()
    stream = stream_weights(model, torch.device("cpu"))
    assert torch.equal(_loss_and_grads(model, ids)[0], _loss_and_grads(reference, ids)[0])
    assert not stream._pending
