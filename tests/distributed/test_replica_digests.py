"""The replica check's digests: equal bytes give equal digests, any changed byte a different one, on the device."""

import pytest
import torch
from torch import nn

from entrenar.distributed import consistency
from entrenar.distributed.consistency import tensor_digests


def _digests(*tensors: torch.Tensor) -> list[str]:
    model = nn.Module()
    for i, t in enumerate(tensors):
        model.register_parameter(f"p{i}", nn.Parameter(t.clone()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return [d for _, d in tensor_digests(model, optimizer)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_changed_element_changes_only_its_tensors_digest(monkeypatch, dtype):
    monkeypatch.setattr(consistency, "_CHUNK_BYTES", 64)  # several chunks per tensor
    torch.manual_seed(0)
    a, b = torch.randn(101, dtype=dtype), torch.randn(7, 3, dtype=dtype)
    base = _digests(a, b)
    assert base == _digests(a, b)
    for i in (0, 50, 100):  # a one-ulp change anywhere, also past the first chunk
        changed = a.clone()
        changed[i] = torch.nextafter(changed[i].float(), torch.tensor(float("inf"))).to(dtype)
        if changed[i] == a[i]:  # bf16: the float step rounded back
            changed[i] = changed[i] * 1.01
        digests = _digests(changed, b)
        assert digests[0] != base[0] and digests[1] == base[1]


def test_swapped_elements_and_signed_zero_are_told_apart():
    x = torch.tensor([1.0, 2.0, 0.0])
    base = _digests(x)[0]
    assert _digests(torch.tensor([2.0, 1.0, 0.0]))[0] != base  # the same bytes in another order
    assert _digests(torch.tensor([1.0, 2.0, -0.0]))[0] != base  # compared as bytes
    nan = torch.tensor([float("nan")])
    assert _digests(nan) == _digests(nan.clone())  # NaN equals itself as bytes


def _module(*tensors: torch.Tensor) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Module()
    for i, t in enumerate(tensors):
        model.register_parameter(f"p{i}", nn.Parameter(t.clone()))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _replicas(*tensors: torch.Tensor) -> str:
    sums = consistency.replica_sums(*_module(*tensors), torch.device("cpu"))
    assert sums is not None
    return str(sums.tolist())


def test_the_replica_sums_see_any_byte_of_any_tensor(monkeypatch):
    """The check's sums run their chunks across tensors (many small ones share a chunk, a large one spans several):
    a one-ulp change in any tensor changes them; names, dtypes and shapes are compared apart, once a run."""
    monkeypatch.setattr(consistency, "_CHUNK_BYTES", 64)
    torch.manual_seed(0)
    tensors = [torch.randn(3), torch.randn(40), torch.randn(5, 2), torch.randn(1)]
    base = _replicas(*tensors)
    assert base == _replicas(*tensors)
    for which in range(len(tensors)):
        for i in (0, tensors[which].numel() - 1):
            changed = [t.clone() for t in tensors]
            flat = changed[which].view(-1)
            flat[i] = torch.nextafter(flat[i], torch.tensor(float("inf")))
            assert _replicas(*changed) != base, (which, i)
    moved = [tensors[0], torch.cat([tensors[1], tensors[2].view(-1)[:1]]), tensors[2].view(-1)[1:], tensors[3]]
    # The same bytes end to end in other tensors: the layout check (once a run) tells these apart.
    assert consistency._layout(*_module(*moved)) != consistency._layout(*_module(*tensors))


def test_the_check_sums_in_few_chunks_not_per_tensor(monkeypatch):
    """Hundreds of small tensors (a LoRA model's adapters and their optimizer state) are summed in one chunk."""
    calls = []
    real = consistency._chunk_sums

    def counted(chunk, start):
        calls.append(chunk.numel())
        return real(chunk, start)

    monkeypatch.setattr(consistency, "_chunk_sums", counted)
    _replicas(*[torch.randn(16, 8) for _ in range(300)])
    assert len(calls) == 1 and calls[0] == 300 * 16 * 8 * 4
