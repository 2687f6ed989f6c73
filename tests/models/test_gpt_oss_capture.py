"""A gpt-oss QLoRA micro-step can be captured in a CUDA graph: it moves nothing between host and device memory.

Capture refuses any copy between the CPU and the GPU through unpinned host memory ("Cannot copy between CPU and
CUDA tensors during CUDA graph capture unless the CPU tensor is pinned"), either way: a host tensor moved to the
device, or ``.tolist()`` / ``.item()`` of a device tensor. Without a GPU the check runs the micro-step that
``entrenar.train.stepping.MicroStep`` captures (forward with every layer checkpointed, the loss, the router
losses, backward) on the meta device, under a dispatch mode that sees every such copy as one between ``cpu`` and
``meta``. Packed rows with sinks attended one document at a time read ``cu_seqlens`` back to the host in every
layer (issue #35: the capture at step 3 of bench_e2e's qlora-gpt-oss-20b failed so); while a graph captures they
attend under a mask built on the device, which the second half of this file checks against the documents alone.
"""

from __future__ import annotations

import sys
import traceback

import pytest
import torch
from family_checks import check_packed_equals_documents, save_family
from test_family_gpt_oss import EXPERT_TARGETS, GPT_OSS
from torch.utils._python_dispatch import TorchDispatchMode

from entrenar.models import padding_free
from entrenar.models.hf import load_hf
from entrenar.models.padding_free import Documents, documents_attention

_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default, torch.ops.aten._copy_from.default)


def _tensors(*trees) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def walk(x) -> None:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    for tree in trees:
        walk(tree)
    return found


def _where() -> str:
    """The innermost line of entrenar's own code on the stack."""
    frames = [f for f in traceback.extract_stack() if "/entrenar/" in f.filename and "/tests/" not in f.filename]
    return f"{frames[-1].filename.rsplit('/src/', 1)[-1]}:{frames[-1].lineno} ({frames[-1].line})" if frames else "?"


class HostTraffic(TorchDispatchMode):
    """Records every op that moves data between host memory and ``device``: a copy between them, either way, or an
    op on the device fed a host tensor that is not a 0-d scalar (such as indexing by a host index tensor)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        if func in _COPIES:
            src = inputs[1] if func is torch.ops.aten.copy_.default else inputs[0]
            dst = inputs[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device") or src.device
            if {src.device.type, torch.device(dst).type} == {"cpu", self.device}:
                self.found.append(f"{func}: {src.device.type} -> {torch.device(dst).type} {tuple(src.shape)} "
                                  f"at {_where()}")
                if src.device.type == self.device:  # a read to the host: a meta tensor has nothing to read
                    raise AssertionError(self.found[-1])
        out = func(*args, **kwargs)
        host = [t for t in inputs if t.device.type == "cpu" and t.dim() > 0]
        if func not in _COPIES and host and any(t.device.type == self.device for t in _tensors(inputs, out)):
            self.found.append(f"{func} on {self.device} fed host tensors {[tuple(t.shape) for t in host]} "
                              f"at {_where()}")
        return out


def test_the_check_sees_host_traffic_either_way():
    """What the check below counts: a host tensor moved to the device, a device tensor indexed by a host index, and
    a device value read back (which it stops at)."""
    x = torch.empty(4, device="meta")
    with HostTraffic("meta") as traffic:
        x + torch.arange(4).to("meta")
        x[torch.tensor([0, 2])]
        x * 2.0 + torch.tensor(1.0)  # a 0-d host scalar is a launch argument, not a copy
    assert [f.split(":")[0].split(" ")[0] for f in traffic.found] == ["aten._to_copy.default", "aten.index.Tensor"]
    with pytest.raises(AssertionError, match="meta -> cpu"), HostTraffic("meta"):
        x.tolist()


@pytest.fixture
def gpt_oss(tmp_path):
    return save_family(tmp_path / "gpt_oss", "GptOssConfig", "GptOssForCausalLM", **GPT_OSS)


def _packed_batch(capacity: int) -> dict:
    """Two rows of 32 tokens as the loop lays packed rows out for CUDA graphs (padding runs, segments padded to
    ``capacity`` with empty ones): documents of 7 and 20 tokens then padding, and of 30 then padding."""
    from entrenar.data.batching import collate, packed_documents
    from entrenar.data.tokenize import Example

    generator = torch.Generator().manual_seed(0)

    def doc(n: int) -> Example:
        ids = torch.randint(3, 128, (n,), generator=generator).tolist()
        return Example(ids, ids)

    return packed_documents(collate([[doc(7), doc(20)], [doc(30)]], 32), capacity=capacity)


@pytest.mark.parametrize("rows", ["packed", "document_mask"])
def test_qlora_micro_step_moves_nothing_between_host_and_device(gpt_oss, monkeypatch, rows):
    """QLoRA on gpt-oss as bench_e2e's qlora-gpt-oss-20b trains it (NF4 attention and experts, the experts as one
    grouped product, LoRA on q/k/v/o and per expert, the fused kernels' layers, every layer checkpointed, bf16,
    packed rows, or rows under a document mask), one captured micro-step: no host tensor reaches the device,
    nothing is read back. The loss is
    the causal-LM task's unfused one: the fused loss's Triton kernel, which dense models' captured steps already
    run, has no meta stand-in (its CPU path reads the host)."""
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.config.sections import MoeSection
    from entrenar.kernels import apply_kernels
    from entrenar.models.loss import token_cross_entropy
    from entrenar.models.moe import moe_blocks
    from entrenar.quant.nf4 import format as nf4_format
    from entrenar.quant.nf4.sinks import nf4_sinks
    from entrenar.train.moe import MoeTraining

    # What the GPU runs and meta cannot: NF4 weights dequantized by the Triton kernel, from tables it keeps on the
    # device after its first (eager) call; autocast, which has no meta device (the weights are bf16 already).
    def triton_dequantize(q, dtype=None):
        return torch.empty(q.shape, dtype=dtype or q.dtype, device=q.codes.device)

    monkeypatch.setattr(nf4_format, "dequantize_nf4", triton_dequantize)
    monkeypatch.setattr(sys.modules["entrenar.kernels.lora_linear"], "dequantize_nf4", triton_dequantize)
    autocast_enabled = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled",
                        lambda *a: False if a and str(a[0]) == "meta" else autocast_enabled(*a))
    # A graph captures (on meta, which a CUDA graph never sees: entrenar asks through padding_free._capturing;
    # raising=False: the check also runs, and fails, on code from before that question).
    monkeypatch.setattr(padding_free, "_capturing", lambda t: True, raising=False)

    folder, _ = gpt_oss
    model = load_hf(folder, dtype=torch.bfloat16, sinks=nf4_sinks)
    apply_lora(model, LoraConfig(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 target_parameters=EXPERT_TARGETS))
    apply_kernels(model)
    model.set_activation_checkpointing(True)
    model.train().to("meta")
    moe = MoeTraining(model, MoeSection(aux_loss=0.01, z_loss=0.001, experts="grouped"))  # auto's choice on CUDA
    assert all(block.experts.use_grouped(torch.empty(0, 64, device="meta", dtype=torch.bfloat16))
               for _, block in moe_blocks(model))

    batch = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in _packed_batch(capacity=8).items()}
    layout = {"cu_seqlens": batch["cu_seqlens"], "max_seqlen": batch["max_seqlen"]} if rows == "packed" else {}
    traffic = HostTraffic("meta")
    with traffic:
        logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"], **layout)
        loss = token_cross_entropy(logits, batch["labels"])[0]
        (loss + moe.router_loss(batch)).backward()
    assert traffic.found == []
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def _random_documents_attention(capturing: bool, monkeypatch, window: int | None) -> torch.Tensor:
    monkeypatch.setattr(padding_free, "_capturing", lambda t: capturing)
    torch.manual_seed(0)
    b, h, hk, t, d = 2, 4, 2, 32, 16
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, hk, t, d), torch.randn(b, hk, t, d)
    sinks = torch.randn(h)
    # row 0: documents of 7 and 20 tokens, a padding run of 5; row 1: 30 tokens, padding of 2; two empty segments
    cu = torch.tensor([0, 7, 27, 32, 62, 64, 64, 64], dtype=torch.int32)
    return documents_attention(q, k, v, Documents(cu, t), window, sinks=sinks)


@pytest.mark.parametrize("window", [None, 8])
def test_the_captured_layout_attends_as_the_documents_do(window, monkeypatch):
    """Attention with sinks under the segments' mask gives the per-document loop's outputs (packed rows, padding
    runs, empty segments, a window shorter than the documents)."""
    captured = _random_documents_attention(True, monkeypatch, window)
    per_document = _random_documents_attention(False, monkeypatch, window)
    torch.testing.assert_close(captured, per_document, atol=1e-6, rtol=1e-5)


def test_captured_packed_rows_give_each_document_its_own_logits(gpt_oss, monkeypatch):
    """The model on a padding-free row, attending as a captured graph does, gives each document the logits it
    gets alone (documents longer than the sliding window, past YaRN's original context)."""
    monkeypatch.setattr(padding_free, "_capturing", lambda t: True)
    folder, _ = gpt_oss
    check_packed_equals_documents(load_hf(folder).eval(), lengths=(7, 30, 19))


def test_the_segment_mask_is_the_document_mask():
    """segment_mask from cu_seqlens equals the padded path's mask from document ids (Transformer.attention_mask)."""
    from entrenar.data.batching import collate, packed_documents
    from entrenar.data.tokenize import Example
    from entrenar.models.config import ModelConfig
    from entrenar.models.transformer import Transformer

    batch = packed_documents(collate([[Example([5] * 7, [5] * 7), Example([6] * 20, [6] * 20)],
                                      [Example([7] * 30, [7] * 30)]], 32), capacity=8)
    documents = Documents(batch["cu_seqlens"], batch["max_seqlen"])
    with torch.device("meta"):
        model = Transformer(ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1,
                                        num_heads=2, num_kv_heads=1, sliding_window=6))
    for window in (None, 6):
        expected = model.attention_mask(32, batch["document_ids"], torch.device("cpu"), window=window or False)
        assert expected is not None
        assert torch.equal(padding_free.segment_mask(documents, 2, 32, window), expected[:, 0])

