"""Segments attending shared keys (Documents' kv_index: a preference pair's prompt computed once): each rejected
token's attention output equals the one it has in its own unshared sequence [prompt, rejected], on every path
(SDPA by document, sliding windows, soft-capped scores, sinks; FlashAttention's varlen kernel on CUDA, where its
bottom-right causal alignment is what makes it right)."""

from __future__ import annotations

import pytest
import torch

from entrenar.data.preference import PreferencePair, shared_prompt_layout
from entrenar.models.padding_free import Documents, documents_attention

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))]
LENGTHS = [(5, 4, 6), (3, 7, 2), (6, 1, 5)]  # (prompt, chosen, rejected) of each pair


def _layouts(device):
    """The shared layout of the pairs, and the unshared one (each pair two documents), with the index of each
    shared token's row in the unshared layout."""
    pairs = [PreferencePair(list(range(p)), list(range(c)), list(range(r))) for p, c, r in LENGTHS]
    shared = shared_prompt_layout(pairs)
    rows, cu = [], [0]
    base = 0
    for p, c, r in LENGTHS:  # unshared: [prompt, chosen] then [prompt, rejected]
        start = cu[-1]
        cu += [start + p + c, start + p + c + p + r]
        rows += list(range(start, start + p + c)) + list(range(start + p + c + p, start + p + c + p + r))
        base += p + c + r
    unshared = Documents(torch.tensor(cu, dtype=torch.int32, device=device), max(p + max(c, r) for p, c, r in LENGTHS))
    documents = Documents(shared["shared_cu_seqlens"].to(device), shared["shared_max_seqlen"],
                          shared["shared_kv_index"].to(device), shared["shared_cu_seqlens_k"].to(device),
                          shared["shared_max_seqlen_k"])
    # the unshared sequence's tokens, gathered from the shared ones: [prompt, chosen, prompt, rejected] per pair
    gather = []
    base = 0
    for p, c, r in LENGTHS:
        gather += list(range(base, base + p + c)) + list(range(base, base + p)) + \
            list(range(base + p + c, base + p + c + r))
        base += p + c + r
    return documents, unshared, torch.tensor(rows, device=device), torch.tensor(gather, device=device), base


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["causal", "window", "softcap", "sinks", "scale"])
def test_shared_keys_give_each_token_its_unshared_attention(device, case):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    documents, unshared, rows, gather, n = _layouts(device)
    g = torch.Generator().manual_seed(0)
    hq, hk, d = 4, 2, 16  # GQA
    q, k, v = (torch.randn(1, h, n, d, generator=g).to(device, dtype) for h in (hq, hk, hk))
    extra: dict = {}
    if case == "window":
        extra["window"] = 3
    elif case == "softcap":
        extra["softcap"], extra["window"] = 2.0, 4
    elif case == "sinks":
        extra["sinks"], extra["window"] = torch.randn(hq, generator=g).to(device, dtype), 4
    elif case == "scale":
        extra["scale"] = 0.3
    out = documents_attention(q, k, v, documents, **extra)[0]  # [n, Hq, D]
    qu, ku, vu = (x[:, :, gather] for x in (q, k, v))  # the unshared sequences
    ref = documents_attention(qu, ku, vu, unshared, **extra)[0][rows]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (FlashAttention's varlen kernel)")
def test_shared_prompt_pairs_in_bf16_through_varlen_attn_equal_the_unshared_sequences(tmp_path):
    """A tiny GQA Llama in bf16 on the GPU: log-probabilities and LoRA gradients of the shared layout (varlen_attn
    with separate query/key lengths) against the unshared padding-free sequences."""
    from conftest import make_hf_model, nonzero_adapters
    from entrenar.adapters.lora import LoraConfig, apply_lora
    from entrenar.data import padding_free
    from entrenar.data.preference import collate_preference
    from entrenar.models.hf import load_hf
    from entrenar.models.padding_free import varlen_available
    from entrenar.tasks.preference.logprobs import sequence_logprobs

    assert varlen_available(16, torch.device("cuda"))
    make_hf_model("llama", hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                  vocab_size=96).save_pretrained(tmp_path / "llama")
    model = load_hf(tmp_path / "llama", dtype=torch.bfloat16, device="cuda")
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    nonzero_adapters(model)
    g = torch.Generator().manual_seed(3)
    pairs = [PreferencePair(torch.randint(3, 96, (60 + 7 * i,), generator=g).tolist(),
                            torch.randint(3, 96, (40 + 5 * i,), generator=g).tolist(),
                            torch.randint(3, 96, (30 + 9 * i,), generator=g).tolist()) for i in range(4)]
    batch = padding_free(collate_preference(pairs, range(4), 256, share_prompt=True))
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    results = []
    for shared in (False, True):
        model.zero_grad()
        sums, _ = sequence_logprobs(model, batch, model.lm_head, shared=shared)
        sums.sum().backward()
        results.append((sums.detach().float(), [p.grad.float().clone() for p in trainable]))
    (a, ga), (b, gb) = results
    # bf16: both layouts round alike except where attention's blocks split differently
    torch.testing.assert_close(b, a, rtol=2e-2, atol=0.5)
    assert (b - a).abs().max() < 0.01 * a.abs().max()
    num = sum(float((x - y).norm() ** 2) for x, y in zip(ga, gb, strict=True)) ** 0.5
    den = sum(float(x.norm() ** 2) for x in ga) ** 0.5
    assert num < 0.05 * den
