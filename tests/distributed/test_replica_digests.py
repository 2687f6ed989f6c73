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
