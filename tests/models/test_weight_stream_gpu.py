"""NF4 base weights streamed to the GPU block by block: the GPU holds about one block's, the numbers stay the same."""

from __future__ import annotations

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora, lora_parameters
from entrenar.kernels import apply_kernels
from entrenar.models.config import ModelConfig
from entrenar.models.transformer import Transformer
from entrenar.quant.nf4.format import NF4Linear, quantize_model_nf4
from entrenar.quant.nf4.sinks import nf4_sinks
from entrenar.quant.nf4.streaming import stream_weights
from entrenar.train.cuda_graph import GraphedMicroStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="streams weights from CPU to GPU memory")

CONFIG = ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_layers=6, num_heads=8,
                     num_kv_heads=4, model_type="llama")


def _qlora() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(CONFIG).cuda().to(torch.bfloat16)
    model.reset_parameters()
    quantize_model_nf4(model.model.layers)
    apply_lora(model, LoraConfig(r=8, alpha=16.0))
    for p in lora_parameters(model):
        torch.nn.init.normal_(p, std=0.02)
    apply_kernels(model)
    model.set_activation_checkpointing(True)
    return model


def _nf4_bytes(model: Transformer) -> int:
    return sum(m.quantized.nbytes for m in model.model.layers.modules() if isinstance(m, NF4Linear))


def _step(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def test_the_gpu_holds_the_blocks_weights_only_while_they_run():
    ids = torch.randint(0, 512, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    reference = _qlora()
    want = _step(reference, ids)
    want_grads = [p.grad.clone() for p in lora_parameters(reference)]
    del reference
    torch.cuda.empty_cache()

    model = _qlora()
    before = torch.cuda.memory_allocated()
    stream = stream_weights(model, torch.device("cuda"))
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    block = _nf4_bytes(model) / CONFIG.num_layers
    assert freed >= _nf4_bytes(model) - block / 4  # everything but rounding of the allocator's blocks
    assert stream.blocks[0].host.is_pinned()

    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    got = _step(model, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for p, g in zip(lora_parameters(model), want_grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    # at most the running block, the prefetched one and the last block kept for backward's first rerun
    held = torch.cuda.memory_allocated() - start
    assert held <= 1.5 * block + sum(p.grad.numel() * p.grad.element_size() for p in lora_parameters(model))


def test_a_graphed_step_replays_the_copies():
    """The copies recorded in a CUDA graph: replays give the eager losses, with the module's buffers on the host."""
    batches = [torch.randint(0, 512, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))] * 6

    def run(streamed: bool) -> list[torch.Tensor]:
        model = _qlora()
        if streamed:
            stream_weights(model, torch.device("cuda"))
        params = list(lora_parameters(model))
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.SGD(params, lr=0.5)
        step = GraphedMicroStep(lambda b: _step(model, b["ids"]), params) if streamed else \
            (lambda b: _step(model, b["ids"]))
        losses = []
        for ids in batches:
            losses.append(step({"ids": ids}))
            optimizer.step()
            for p in params:
                p.grad.zero_()
        return losses

    eager, graphed = run(False), run(True)
    torch.testing.assert_close(torch.stack(graphed), torch.stack(eager), rtol=0, atol=1e-2)
    assert graphed[-1] < graphed[0]


def test_a_model_loaded_for_streaming_never_holds_its_nf4_weights_on_the_gpu(tmp_path):
    """Loaded inside nf4_in_host_memory, the NF4 buffers are in CPU memory from the start and quantized on the GPU
    a tensor at a time: the same codes as a GPU load, and the load's peak stays under the NF4 weights' size."""
    from entrenar.models.hf import load_hf, save_hf
    from entrenar.quant.nf4.streaming import nf4_in_host_memory

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**CONFIG.__dict__, "num_layers": 24})).to(torch.bfloat16)  # weights >> one
    model.reset_parameters()
    save_hf(model, tmp_path / "m")
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    resident = load_hf(tmp_path / "m", torch.bfloat16, "cuda", sinks=nf4_sinks)
    resident_bytes = torch.cuda.memory_allocated() - start
    codes = {n: b.cpu() for n, b in resident.named_buffers() if "weight_" in n}
    del resident
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with nf4_in_host_memory():
        held = load_hf(tmp_path / "m", torch.bfloat16, "cuda", sinks=nf4_sinks)
    held_bytes = torch.cuda.memory_allocated() - start
    assert held_bytes < resident_bytes - 0.9 * sum(c.numel() * c.element_size() for c in codes.values())
    assert torch.cuda.max_memory_allocated() - start < resident_bytes / 2  # the peak: one tensor's quantization
    for n, b in held.named_buffers():
        if "weight_" in n:
            assert b.device.type == "cpu" and torch.equal(b, codes[n]), n
