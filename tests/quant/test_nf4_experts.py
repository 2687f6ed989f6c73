"""NF4 experts (QLoRA on MoE models): streamed loading equals quantizing the loaded experts, the block computes
with the dequantized weights, adapters train on top, and merging into them is refused."""

from __future__ import annotations

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora, merge_lora
from entrenar.errors import AdapterError
from entrenar.models.hf import load_hf
from entrenar.models.moe import moe_blocks
from entrenar.quant.nf4.experts import NF4Experts, quantize_experts_nf4
from entrenar.quant.nf4.format import dequantize_nf4, quantize_nf4
from entrenar.quant.nf4.sinks import nf4_sinks

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_streamed_nf4_experts_compute_with_the_dequantized_weights(hf_folder, family):
    folder, _ = hf_folder(family)
    full = load_hf(folder).eval()
    streamed = load_hf(folder, sinks=nf4_sinks).eval()
    blocks = moe_blocks(streamed)
    assert blocks and all(isinstance(b.experts, NF4Experts) for _, b in blocks)
    # Each expert's projection is bitsandbytes-style NF4 of the checkpoint's tensor.
    (layer, block), = blocks[:1]
    ref = full.model.layers[layer].mlp.experts
    i = ref.intermediate_size
    expected = dequantize_nf4(quantize_nf4(ref.gate_up_proj[2, i:].detach()))
    assert torch.equal(block.experts.expert(2).up_proj.weight, expected)
    # Quantizing after loading gives the same model as quantizing while streaming.
    quantize_experts_nf4(full)
    x = torch.randn(1, 6, full.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(block(x), full.model.layers[layer].mlp(x), atol=0, rtol=0)
    # And the block computes with the dequantized stacks (the full-precision Experts on those weights).
    from entrenar.models.moe import Experts

    plain = Experts(ref.num_experts, ref.hidden_size, i)
    with torch.no_grad():
        plain.gate_up_proj.copy_(block.experts.gate_up_proj)
        plain.down_proj.copy_(block.experts.down_proj)
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = block.gate(flat)
        torch.testing.assert_close(block.experts(flat, indices, weights), plain(flat, indices, weights),
                                   atol=1e-6, rtol=1e-5)


def test_qlora_adapters_on_nf4_experts_get_gradients_and_refuse_to_merge(hf_folder):
    folder, _ = hf_folder("qwen3_moe")
    model = load_hf(folder, sinks=nf4_sinks)
    apply_lora(model, LoraConfig(r=2, alpha=4, target_modules=["q_proj"], target_parameters=TARGETS))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
    model(torch.randint(0, 128, (2, 8))).float().logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "experts" in n}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    with pytest.raises(AdapterError, match="quantized"):
        merge_lora(model)


def _nf4_stack(gpt_oss: bool, dtype: torch.dtype, lora: bool, e: int = 4, h: int = 64, i: int = 128):
    """NF4 experts quantized from random ones: gpt-oss's (biases, clamped SwiGLU at a limit the values reach) or
    plain SwiGLU (Qwen3-MoE's); with ``lora``, per-expert adapters (r=8, B drawn non-zero) on gate_up and down."""
    from entrenar.adapters.experts import LoraExpertWeights
    from entrenar.models.moe import Experts

    torch.manual_seed(0)
    full = Experts(e, h, i, bias=gpt_oss, activation="clamped_swiglu" if gpt_oss else "silu", limit=0.3)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(std=0.2)
    experts = NF4Experts.from_experts(full.to(dtype))
    if not lora:
        return experts
    wrapped = LoraExpertWeights(LoraExpertWeights(experts, "gate_up_proj", 8, 16), "down_proj", 8, 16)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)
    return wrapped


def _routed(h: int, dtype: torch.dtype):
    """Six tokens routed to two of four experts each, expert 3 chosen by none."""
    torch.manual_seed(1)
    x = torch.randn(6, h, dtype=dtype, requires_grad=True)
    indices = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 1], [1, 0], [0, 1]])
    return x, indices, torch.rand(6, 2).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "lora"])
@pytest.mark.parametrize("gpt_oss", [True, False], ids=["gpt_oss", "swiglu"])
def test_grouped_nf4_experts_equal_the_loop(monkeypatch, gpt_oss, lora, dtype):
    """The grouped NF4 path (each stack dequantized once a pass into one buffer, one grouped product) gives the
    per-expert loop's output, input gradient and adapter gradients: biases, the clamped SwiGLU, an expert no token
    chose, LoRA on both stacks; to fp32 rounding in fp32, within bf16's in bf16."""
    experts = _nf4_stack(gpt_oss, dtype, lora)
    core = experts if isinstance(experts, NF4Experts) else experts.base_layer.base_layer
    stacked = []
    original = NF4Experts.stacked
    monkeypatch.setattr(NF4Experts, "stacked", lambda self, *a: stacked.append(a[0]) or original(self, *a))
    results = []
    for impl in ("loop", "grouped"):
        experts.implementation = impl
        x, indices, weights = _routed(core.hidden_size, dtype)
        assert experts.use_grouped(x) is (impl == "grouped")
        stacked.clear()
        out = experts(x, indices, weights)
        out.float().square().sum().backward()
        # grouped: each stack built once in forward and once in backward; the loop builds none
        assert sorted(stacked) == (sorted(2 * ["gate_up_proj", "down_proj"]) if impl == "grouped" else []), impl
        grads = {n: p.grad.clone() for n, p in experts.named_parameters() if p.requires_grad}
        assert all(p.grad is None for p in core.parameters())  # the frozen base (biases included) gets none
        for p in experts.parameters():
            p.grad = None
        results.append((out.detach(), x.grad, grads))
    (out_loop, dx_loop, g_loop), (out_grouped, dx_grouped, g_grouped) = results
    assert g_loop.keys() == g_grouped.keys() and (len(g_loop) == 4) is lora
    for name, mine, ref in [("out", out_grouped, out_loop), ("grad x", dx_grouped, dx_loop),
                            *((n, g_grouped[n], g_loop[n]) for n in g_loop)]:
        if dtype == torch.float32:
            torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
        else:  # bf16 adapter products on the grouped path, fp32 on the loop: 1% apart on full-precision Experts too
            assert (mine.float() - ref.float()).norm() <= 2e-2 * ref.float().norm(), name


def test_grouped_nf4_experts_save_nothing_weight_sized():
    """What the grouped NF4 path saves for backward is activations, routing and offsets: no dequantized stack or
    expert weight, not even an expert's packed codes (the loop's NF4 layers save those, by reference)."""
    experts = _nf4_stack(True, torch.float32, False)
    one_expert_codes = experts.intermediate_size * experts.hidden_size // 2
    for impl in ("loop", "grouped"):
        experts.implementation = impl
        x, indices, weights = _routed(experts.hidden_size, torch.float32)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            out = experts(x, indices, weights)
        largest = max(t.numel() for t in saved)
        assert (largest < one_expert_codes) is (impl == "grouped"), (impl, sorted(t.shape for t in saved))
        out.sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0


def test_grouped_nf4_experts_read_nothing_back_from_the_device(monkeypatch):
    """Under fake tensors, where any read of a value (``.tolist()``, ``.item()``, ``bool()``) raises, the grouped
    path runs forward and backward in bf16 (its products in bf16, as on CUDA): token counts stay on the device as
    offsets, so a CUDA graph can replay the step. The loop reads the counts back (why no graph replays it)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from entrenar.quant.nf4 import experts as nf4_experts

    monkeypatch.setattr(nf4_experts, "cpu_products_in_fp32", lambda device, dtype: False)
    experts = _nf4_stack(True, torch.bfloat16, True)
    for impl in ("grouped", "loop"):
        experts.implementation = impl
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(6, 64, dtype=torch.bfloat16, requires_grad=True)
            indices, weights = torch.randint(0, 4, (6, 2)), torch.rand(6, 2, dtype=torch.bfloat16)
            if impl == "loop":
                with pytest.raises(DataDependentOutputException):
                    experts(x, indices, weights)
                continue
            experts(x, indices, weights).sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape


def test_the_decode_step_over_nf4_experts_stays_eager(hf_folder, monkeypatch):
    """A sampler's decode step (``task.decode_cuda_graphs``) is not captured over NF4 experts, which now run grouped
    on CUDA (stacks dequantized inside the step) but have not been captured on a GPU: it says so and runs eager."""
    from entrenar.generation import graphed

    folder, _ = hf_folder("qwen3_moe")
    model = load_hf(folder, dtype=torch.bfloat16, sinks=nf4_sinks)
    apply_lora(model, LoraConfig(r=8, alpha=16, target_modules=["q_proj"], target_parameters=TARGETS))
    monkeypatch.setattr(graphed, "compute_device", lambda model: torch.device("cuda"))  # the checks past the device
    name = f"model.layers.{moe_blocks(model)[0][0]}.mlp"
    assert f"NF4 experts of '{name}'" in graphed.graph_refusal(model)
    on, how = graphed.uses_graphs("auto", model)
    assert not on and "NF4 experts" in how
