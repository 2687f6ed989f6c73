"""Padding-free batches: one row of documents end to end gives what each document gives on its own."""

from __future__ import annotations

import pytest
import torch

from entrenar.adapters.lora import LoraConfig, apply_lora
from entrenar.data import Example, collate, num_target_tokens, packed_documents, padding_free
from entrenar.data.tokenize import IGNORE_INDEX
from entrenar.models.hf import load_hf
from entrenar.models.loss import token_cross_entropy
from entrenar.models.padding_free import Documents

LENGTHS = [[9, 23, 5], [30], [1, 17, 12]]  # rows of documents; rows padded to 48


def _rows(vocab: int, seed: int = 0) -> list[list[Example]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in LENGTHS:
        row = []
        for n in lengths:
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            row.append(Example(input_ids=ids, labels=list(ids)))
        rows.append(row)
    return rows


def _lora_model(folder):
    """The folder's model with seeded all-linear LoRA whose B is non-zero (B = 0 would make every A gradient zero)."""
    torch.manual_seed(0)
    model = load_hf(folder)
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def test_padding_free_layout_keeps_every_real_token_and_marks_documents():
    rows = _rows(vocab=50)
    batch = collate(rows, seq_len=48)
    flat = padding_free(batch)
    lengths = [n for row in LENGTHS for n in row]
    assert flat["input_ids"].shape == (1, sum(lengths))
    assert flat["cu_seqlens"].tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert flat["cu_seqlens"].dtype == torch.int32 and flat["max_seqlen"] == 30
    assert flat["input_ids"][0].tolist() == [t for row in rows for e in row for t in e.input_ids]
    # Each document's first label stays masked (never predicted across documents); nothing else is lost.
    starts = flat["cu_seqlens"][:-1].long()
    assert (flat["labels"][0, starts] == IGNORE_INDEX).all()
    assert flat["position_ids"][0, starts].tolist() == [0] * len(lengths)
    assert num_target_tokens(flat) == num_target_tokens(batch) == sum(lengths) - len(lengths)
    assert "document_ids" not in flat


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_padding_free_logits_equal_each_document_alone_in_transformers(hf_folder, family):
    folder, hf = hf_folder(family)
    model = load_hf(folder)
    rows = _rows(hf.config.vocab_size)
    flat = padding_free(collate(rows, seq_len=48))
    with torch.no_grad():
        logits = model(flat["input_ids"], flat["position_ids"], cu_seqlens=flat["cu_seqlens"],
                       max_seqlen=flat["max_seqlen"])[0]
        expected = torch.cat([hf(torch.tensor([e.input_ids])).logits[0] for row in rows for e in row])
    # mistral's window is 16 and two documents are longer: the window applies within documents.
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-4)


def test_padding_free_gives_the_padded_packed_batch_loss_and_adapter_gradients(hf_folder):
    folder, hf = hf_folder("llama")
    rows = _rows(hf.config.vocab_size, seed=1)
    batch = collate(rows, seq_len=48)
    flat = padding_free(batch)

    def loss_and_grads(padding_free_batch: bool):
        model = _lora_model(folder)
        model.set_activation_checkpointing(1)  # one layer of two recomputes, with its input "offloaded"
        if padding_free_batch:
            logits = model(flat["input_ids"], flat["position_ids"], cu_seqlens=flat["cu_seqlens"])
            loss = token_cross_entropy(logits, flat["labels"])[0]
        else:
            logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
            loss = token_cross_entropy(logits, batch["labels"])[0]
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss_padded, grads_padded = loss_and_grads(False)
    loss_flat, grads_flat = loss_and_grads(True)
    torch.testing.assert_close(loss_flat, loss_padded, atol=1e-4, rtol=1e-5)
    assert grads_flat.keys() == grads_padded.keys() and len(grads_flat) == 2 * 7 * 2
    for name in grads_flat:
        torch.testing.assert_close(grads_flat[name], grads_padded[name], atol=1e-5, rtol=1e-4, msg=name)


def test_packed_documents_cover_every_token_of_the_rows_end_to_end():
    batch = collate(_rows(vocab=50), seq_len=48)
    packed = packed_documents(batch)
    # Each row's documents, then its padding as one more segment; the [B, T] layout itself is unchanged.
    segments = [9, 23, 5, 11, 30, 18, 1, 17, 12, 18]
    assert packed["cu_seqlens"].tolist() == [0, *torch.tensor(segments).cumsum(0).tolist()]
    assert packed["cu_seqlens"].dtype == torch.int32 and packed["max_seqlen"] == 30
    for key in batch:
        assert torch.equal(packed[key], batch[key]), key


def test_a_fixed_capacity_pads_with_empty_segments_and_the_row_length():
    batch = collate(_rows(vocab=50), seq_len=48)
    packed = packed_documents(batch, capacity=16)
    assert packed["cu_seqlens"].tolist() == packed_documents(batch)["cu_seqlens"].tolist() + [144] * 6
    assert packed["max_seqlen"] == 48
    # More segments than the capacity: the batch keeps its own layout (CUDA graphs then run it eagerly).
    assert packed_documents(batch, capacity=4)["cu_seqlens"].tolist() == packed_documents(batch)["cu_seqlens"].tolist()


def test_segment_capacity_covers_the_stream_and_leaves_it_where_it_was():
    from entrenar.data import BatchStream, segment_capacity

    examples = [Example(input_ids=list(range(n)), labels=list(range(n))) for n in [3, 9, 1, 14, 6, 2, 11] * 5]
    stream = BatchStream(examples, 2, 16, packing=True, shuffle=True, seed=0, pad_id=0)
    state = stream.state_dict()
    capacity = segment_capacity(stream, batches=8)
    assert stream.state_dict() == state
    seen = [len(packed_documents(next(stream))["cu_seqlens"]) - 1 for _ in range(8)]
    assert capacity % 16 == 0 and max(seen) <= capacity < 1.25 * max(seen) + 16


def test_empty_segments_change_nothing(hf_folder):
    folder, hf = hf_folder("llama")
    model = load_hf(folder)
    batch = collate(_rows(hf.config.vocab_size, seed=4), seq_len=48)
    with torch.no_grad():
        outs = [model(batch["input_ids"], batch["position_ids"], batch["document_ids"],
                      cu_seqlens=p["cu_seqlens"], max_seqlen=p["max_seqlen"])
                for p in (packed_documents(batch), packed_documents(batch, capacity=32))]
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_packed_rows_read_end_to_end_give_the_document_mask_loss_and_gradients(hf_folder, family):
    """Packed rows [B, T] handed over as documents (what the loop does on CUDA, for the flash kernel) compute
    what the dense document mask computes: same loss, same adapter gradients (mistral: windowed)."""
    folder, hf = hf_folder(family)
    batch = collate(_rows(hf.config.vocab_size, seed=2), seq_len=48)
    packed = packed_documents(batch)

    def loss_and_grads(as_documents: bool):
        model = _lora_model(folder)
        layout = {"cu_seqlens": packed["cu_seqlens"], "max_seqlen": packed["max_seqlen"]} if as_documents else {}
        logits = model(batch["input_ids"], batch["position_ids"], batch["document_ids"], **layout)
        loss = token_cross_entropy(logits, batch["labels"])[0]
        loss.backward()
        real = batch["document_ids"] >= 0
        return logits[real], loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    logits_mask, loss_mask, grads_mask = loss_and_grads(False)
    logits_docs, loss_docs, grads_docs = loss_and_grads(True)
    torch.testing.assert_close(logits_docs, logits_mask, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(loss_docs, loss_mask, atol=1e-5, rtol=1e-5)
    assert grads_docs.keys() == grads_mask.keys() and grads_docs
    for name in grads_docs:
        torch.testing.assert_close(grads_docs[name], grads_mask[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's variable-length kernel needs CUDA")
def test_packed_rows_through_the_varlen_kernel_match_the_mask_on_gpu(hf_folder):
    from entrenar.models import padding_free as pf

    folder, hf = hf_folder("llama")
    batch = {k: v.cuda() for k, v in collate(_rows(hf.config.vocab_size, seed=3), seq_len=48).items()}
    packed = packed_documents({k: v.cpu() for k, v in batch.items()})
    model = load_hf(folder).cuda()
    assert pf.varlen_available(model.config.head_dim, torch.device("cuda"))
    real = batch["document_ids"] >= 0
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        masked = model(batch["input_ids"], batch["position_ids"], batch["document_ids"])
        varlen = model(batch["input_ids"], batch["position_ids"], batch["document_ids"],
                       cu_seqlens=packed["cu_seqlens"].cuda(), max_seqlen=packed["max_seqlen"])
    torch.testing.assert_close(varlen[real].float(), masked[real].float(), atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's variable-length kernel needs CUDA")
@pytest.mark.parametrize("window", [None, 64])
def test_varlen_kernel_equals_per_document_sdpa_on_gpu(window):
    from entrenar.models import padding_free as pf

    torch.manual_seed(0)
    lengths = [300, 17, 1, 512, 90]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    docs = Documents(cu, max(lengths))
    n = sum(lengths)
    q = torch.randn(1, 8, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q3, k3 = q[0].transpose(0, 1), k[0].transpose(0, 1)
    assert pf._varlen_fits(q3, k3, docs, window)
    grad = torch.randn(1, n, 8, 64, device="cuda", dtype=torch.bfloat16)

    def run(fn):
        out = fn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), docs, window)[None]
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        return out, dq, dk, dv

    for got, want in zip(run(pf._varlen), run(pf._per_document)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_whole_rows_are_told_from_the_host_layout_alone():
    from entrenar.models.padding_free import whole_rows

    def docs(bounds: list[int], max_len: int, **extra) -> Documents:
        return Documents(torch.tensor(bounds, dtype=torch.int32), max_len, **extra)

    assert whole_rows(docs([0, 48, 96, 144], 48), rows=3, length=48)
    assert whole_rows(docs([0, 48, 96, 144], 48, shards=None), rows=3, length=48)
    assert not whole_rows(docs([0, 30, 48, 96, 144], 48), rows=3, length=48)  # a row of two segments
    assert not whole_rows(docs([0, 40, 96], 56), rows=2, length=48)  # a document across the rows' boundary
    # The graph layout of whole rows with spare capacity: its empty segments make it look packed (kept varlen).
    assert not whole_rows(docs([0, 48, 96, 96], 48), rows=2, length=48)
    # Shared-prompt segments read other tokens' keys: never plain rows.
    shared = docs([0, 48, 96], 48, kv_index=torch.arange(96), cu_seqlens_k=torch.tensor([0, 48, 96]), max_len_k=48)
    assert not whole_rows(shared, rows=2, length=48)
    # packed_documents' layout of rows that are each one document
    batch = collate([[Example(input_ids=list(range(1, 49)), labels=list(range(1, 49)))]] * 2, seq_len=48)
    packed = packed_documents(batch)
    assert whole_rows(Documents(packed["cu_seqlens"], packed["max_seqlen"]), rows=2, length=48)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_whole_rows_attend_as_plain_causal_rows(monkeypatch, scale):
    """Rows that are each one document go through causal SDPA (cuDNN's kernel on CUDA), with the per-document
    path's output and gradients (GQA, a custom scale); routed on the CPU here to check the arithmetic."""
    from entrenar.models import padding_free as pf

    torch.manual_seed(0)
    b, t = 3, 40
    q = torch.randn(b, 8, t, 16, requires_grad=True)
    k, v = (torch.randn(b, 2, t, 16, requires_grad=True) for _ in range(2))
    docs = Documents(torch.arange(0, b * t + 1, t, dtype=torch.int32), t)
    grad = torch.randn(b, t, 8, 16)
    calls = []
    causal_rows = pf.causal_rows
    monkeypatch.setattr(pf, "causal_rows", lambda *a: calls.append(1) or causal_rows(*a))

    def run(devices):
        monkeypatch.setattr(pf, "WHOLE_ROW_DEVICES", devices)
        out = pf.documents_attention(q, k, v, docs, scale=scale)
        return out, *torch.autograd.grad(out, (q, k, v), grad)

    by_document = run(frozenset())
    assert not calls
    rows = run(frozenset({"cpu"}))
    assert calls == [1]
    for got, want in zip(rows, by_document, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # A sliding window shorter than the row, soft-capped scores or sinks keep the per-document path.
    pf.documents_attention(q, k, v, docs, window=16, scale=scale)
    pf.documents_attention(q, k, v, docs, scale=scale, softcap=30.0)
    assert calls == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's attention needs CUDA")
def test_whole_rows_through_cudnn_equal_the_varlen_kernel_on_gpu():
    from entrenar.models import padding_free as pf

    torch.manual_seed(0)
    b, t = 2, 1024
    q = torch.randn(b, 8, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, 2, t, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    docs = Documents(torch.arange(0, b * t + 1, t, dtype=torch.int32, device="cuda"), t)
    grad = torch.randn(b, t, 8, 64, device="cuda", dtype=torch.bfloat16)
    rows = pf.documents_attention(q, k, v, docs)
    flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], 64) for x in (q, k, v)]
    varlen = pf._varlen(*flat, docs, None).view(b, t, 8, 64)
    for got, want in zip((rows, *torch.autograd.grad(rows, (q, k, v), grad)),
                         (varlen, *torch.autograd.grad(varlen, (q, k, v), grad)), strict=True):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_row_layout_is_read_to_the_host_once_however_many_layers_ask():
    """Every layer of a forward (and its checkpointed reruns) shares one Documents; on a GPU each read of
    cu_seqlens is a device sync, which the per-document paths (gpt-oss's sinks) made once a layer."""
    reads = []

    class Counted(torch.Tensor):
        def tolist(self):
            reads.append(1)
            return super().tolist()

    cu = torch.tensor([0, 3, 7, 12], dtype=torch.int32).as_subclass(Counted)
    cu_k = torch.tensor([0, 5, 9, 14], dtype=torch.int32).as_subclass(Counted)
    docs = Documents(cu, 5)
    assert [docs.bounds() for _ in range(24)][-1] == [0, 3, 7, 12] and docs.key_bounds() == [0, 3, 7, 12]
    assert len(reads) == 1
    shared = Documents(cu, 5, kv_index=torch.arange(14), cu_seqlens_k=cu_k, max_len_k=5)
    for _ in range(24):
        assert shared.bounds() == [0, 3, 7, 12] and shared.key_bounds() == [0, 5, 9, 14]
    assert len(reads) == 3


def test_a_row_layout_survives_fsdp2s_forward_input_cast():
    """FSDP2 casts a block's forward inputs by rebuilding each dataclass with dataclasses.replace over all its
    fields (torch.distributed.utils._apply_to_tensors): a field Documents could not take in __init__ stopped every
    padding-free FSDP run on GPUs (2 H200s, 2026-11-27: "field _read is declared with init=False")."""
    from torch.distributed.utils import _apply_to_tensors

    docs = Documents(torch.tensor([0, 3, 7], dtype=torch.int32), 4, kernel="fa4")
    assert docs.bounds() == [0, 3, 7]
    cast = _apply_to_tensors(lambda t: t.clone(), docs)
    assert isinstance(cast, Documents) and cast is not docs
    assert (cast.max_len, cast.kernel, cast.bounds()) == (4, "fa4", [0, 3, 7])
    assert torch.equal(cast.cu_seqlens, docs.cu_seqlens)
