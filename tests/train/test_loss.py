"""Token-summed cross-entropy, the gradient-accumulation contract, and the chunked path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from entrenar.data import IGNORE_INDEX, num_target_tokens
from entrenar.models.loss import chunked_cross_entropy, token_cross_entropy

V, H, T = 96, 32, 12


def _labels(batch: int, n_masked: list[int], seed: int) -> torch.Tensor:
    """Random labels with the first ``n_masked[b]`` positions of row b ignored (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (batch, T), generator=g)
    for b, m in enumerate(n_masked):
        labels[b, :m] = IGNORE_INDEX
    return labels


def _reference_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Shift by hand, one row and position at a time: -log_softmax at the next token.
    total = torch.zeros((), dtype=torch.float64)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            if labels[b, t + 1] != IGNORE_INDEX:
                total -= torch.log_softmax(logits[b, t].double(), -1)[labels[b, t + 1]]
    return total


def test_token_cross_entropy_is_shifted_token_sum() -> None:
    logits = torch.randn(3, T, V)
    labels = _labels(3, [0, 5, 11], seed=0)
    loss_sum, n = token_cross_entropy(logits, labels)
    assert loss_sum.dtype == torch.float32
    torch.testing.assert_close(loss_sum, _reference_sum(logits, labels).float())  # float32 tolerances for a float32 sum
    # Row 0: 11 targets, row 1: T-1-4 (position 5..11 as targets), row 2: label 11 only.
    assert int(n) == num_target_tokens({"labels": labels}) == 11 + 7 + 1


def test_token_cross_entropy_upcasts_low_precision_logits() -> None:
    logits = torch.randn(2, T, V).bfloat16()
    labels = _labels(2, [0, 3], seed=1)
    loss_sum, _ = token_cross_entropy(logits, labels)
    assert loss_sum.dtype == torch.float32
    torch.testing.assert_close(loss_sum, _reference_sum(logits.float(), labels).float())


def test_shape_errors_name_the_shapes() -> None:
    with pytest.raises(ValueError, match=r"\(2, 12, 96\) and \(2, 11\)"):
        token_cross_entropy(torch.randn(2, T, V), torch.zeros(2, T - 1, dtype=torch.long))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_accumulation_with_global_token_count_equals_one_big_batch() -> None:
    # Three micro-batches with very different numbers of target tokens.
    micro = [(torch.randint(0, V, (2, T)), _labels(2, m, seed=i)) for i, m in enumerate([[0, 0], [10, 9], [4, 11]])]
    counts = [num_target_tokens({"labels": lab}) for _, lab in micro]
    assert len(set(counts)) == 3

    # Reference: one batch, mean over all target tokens (PyTorch's definition).
    model = TinyLM()
    ids = torch.cat([i for i, _ in micro])
    labels = torch.cat([lab for _, lab in micro])
    F.cross_entropy(model(ids)[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX).backward()
    reference = _grads(model)

    # The loop's contract: divide each micro-batch's sum by the step's total.
    model = TinyLM()
    total = sum(counts)
    for ids, lab in micro:
        loss_sum, _ = token_cross_entropy(model(ids), lab)
        (loss_sum / total).backward()
    accumulated = _grads(model)
    for name in reference:
        torch.testing.assert_close(accumulated[name], reference[name], msg=name)

    # Averaging per micro-batch weights the tokens of small micro-batches more,
    # so the same comparison fails: the test above can tell them apart.
    model = TinyLM()
    for ids, lab in micro:
        loss_sum, n = token_cross_entropy(model(ids), lab)
        (loss_sum / n / len(micro)).backward()
    averaged = _grads(model)
    assert (averaged["head.weight"] - reference["head.weight"]).abs().max() > 1e-3


def _plain_and_chunked(dtype: torch.dtype, weight_grad: bool, chunk_size: int, labels: torch.Tensor):
    torch.manual_seed(1)
    hidden = torch.randn(labels.shape[0], T, H, dtype=dtype)
    weight = (torch.randn(V, H) / H**0.5).to(dtype)
    results = []
    for use_chunks in (False, True):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(weight_grad)
        if use_chunks:
            loss_sum, n = chunked_cross_entropy(h, w, labels, chunk_size)
        else:
            loss_sum, n = token_cross_entropy(F.linear(h, w), labels)
        (loss_sum * 0.37).backward()  # a non-unit upstream gradient, as after dividing by the token count
        results.append((loss_sum, n, h.grad, w.grad))
    return results


@pytest.mark.parametrize("chunk_size", [1, 7, 4096])
def test_chunked_matches_plain_loss_and_gradients(chunk_size: int) -> None:
    labels = _labels(3, [0, 6, 11], seed=3)
    (loss, n, gh, gw), (closs, cn, cgh, cgw) = _plain_and_chunked(torch.float32, True, chunk_size, labels)
    assert closs.dtype == torch.float32 and int(cn) == int(n)
    torch.testing.assert_close(closs, loss)
    torch.testing.assert_close(cgh, gh)
    torch.testing.assert_close(cgw, gw)
    assert torch.all(cgh[:, -1] == 0)  # the last position predicts nothing


def test_chunked_bf16_and_frozen_head() -> None:
    labels = _labels(2, [2, 5], seed=4)
    (loss, _, gh, gw), (closs, _, cgh, cgw) = _plain_and_chunked(torch.bfloat16, False, 5, labels)
    assert gw is None and cgw is None
    assert cgh.dtype == torch.bfloat16
    torch.testing.assert_close(closs, loss, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(cgh, gh, rtol=2e-2, atol=2e-3)


def test_chunked_without_grad_and_with_no_targets() -> None:
    labels = _labels(2, [T, T], seed=5)
    hidden, weight = torch.randn(2, T, H), torch.randn(V, H)
    with torch.no_grad():
        loss, n = chunked_cross_entropy(hidden.requires_grad_(), weight, labels, 4)
    assert not loss.requires_grad and loss.item() == 0.0 and int(n) == 0
    loss, n = chunked_cross_entropy(hidden, weight.requires_grad_(), labels, 4)
    loss.backward()
    assert torch.all(weight.grad == 0) and torch.all(hidden.grad == 0)


def _largest_saved(fn) -> int:
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        fn()
    return max(sizes)


def test_chunked_saves_no_full_logits_for_backward() -> None:
    batch, chunk = 16, 8  # N = 176 tokens >> H, so [N, V] logits dwarf the [N, H] and [V, H] gradients
    labels = _labels(batch, [0] * batch, seed=6)
    hidden = torch.randn(batch, T, H, requires_grad=True)
    weight = torch.randn(V, H, requires_grad=True)
    n_tokens = batch * (T - 1)
    assert _largest_saved(lambda: token_cross_entropy(F.linear(hidden, weight), labels)) >= n_tokens * V
    # Only the [N, H] and [V, H] gradients survive the forward pass.
    assert _largest_saved(lambda: chunked_cross_entropy(hidden, weight, labels, chunk)) <= max(n_tokens, V) * H


def test_chunked_argument_errors() -> None:
    labels = _labels(1, [0], seed=7)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_cross_entropy(torch.randn(1, T, H), torch.randn(V, H), labels, 0)
    with pytest.raises(ValueError, match=r"lm_head_weight must be \[V, 32\]"):
        chunked_cross_entropy(torch.randn(1, T, H), torch.randn(V, H + 1), labels, 8)
