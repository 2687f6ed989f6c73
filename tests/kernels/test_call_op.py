"""call_op: the registered custom op where compile or autograd must see it, the implementation itself elsewhere."""

from __future__ import annotations

import torch

from entrenar.kernels._common import call_op


def _recorder():
    calls: list[str] = []

    def op(x: torch.Tensor) -> torch.Tensor:
        calls.append("op")
        return x * 2

    def impl(x: torch.Tensor) -> torch.Tensor:
        calls.append("impl")
        return x * 2

    return calls, op, impl


def test_autograd_sees_the_op_and_everything_else_calls_the_implementation():
    calls, op, impl = _recorder()
    x = torch.ones(3, requires_grad=True)
    call_op(op, impl, x)  # grad mode on, an input needs a gradient: the op (its registered backward)
    with torch.no_grad():
        call_op(op, impl, x)
    call_op(op, impl, torch.ones(3))  # nothing to differentiate
    assert calls == ["op", "impl", "impl"]


def test_torch_compile_traces_the_op():
    calls, op, impl = _recorder()
    compiled = torch.compile(lambda x: call_op(op, impl, x), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 2.0))
    assert calls == ["op"]
