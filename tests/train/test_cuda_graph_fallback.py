"""A micro-step whose CUDA-graph capture fails: under ``training.cuda_graphs: auto`` the run goes on eagerly and says
why once; with ``true`` it stops with one message naming the setting. The capture itself needs a GPU: here it is
replaced by one that fails as a capture does (an operation it refuses), and the eager step is a stand-in."""

from __future__ import annotations

import pytest
import torch

from entrenar.errors import ConfigError
from entrenar.train.cuda_graph import GraphedMicroStep
from entrenar.train.stepping import MicroStep

REFUSED = RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is "
                       "pinned\n(a second line the log leaves out)")


def _graphed(strict: bool, monkeypatch) -> tuple[GraphedMicroStep, list[str]]:
    calls: list[str] = []

    def eager(inputs):
        calls.append("eager")
        return inputs["x"] * 2

    def capture(inputs):
        calls.append("capture")
        raise REFUSED

    graphed = GraphedMicroStep(eager, [], warmup=0, strict=strict)
    monkeypatch.setattr(graphed, "_capture", capture)
    return graphed, calls


def test_auto_goes_on_eagerly_after_a_failed_capture_and_does_not_try_again(monkeypatch):
    graphed, calls = _graphed(strict=False, monkeypatch=monkeypatch)
    assert graphed({"x": torch.tensor(3.0)}).item() == 6.0
    assert graphed({"x": torch.tensor(4.0)}).item() == 8.0
    assert calls == ["capture", "eager", "eager"]
    assert graphed.eager_why is not None and "unless the CPU tensor is pinned" in graphed.eager_why
    assert "second line" not in graphed.eager_why and graphed.graph is None


def test_cuda_graphs_true_stops_naming_the_setting(monkeypatch):
    graphed, _ = _graphed(strict=True, monkeypatch=monkeypatch)
    with pytest.raises(ConfigError, match=r"training\.cuda_graphs: true, but capturing the micro-step failed: "
                                          r"Cannot copy .* \(training\.cuda_graphs: auto goes on eagerly instead\)"):
        graphed({"x": torch.tensor(3.0)})


def test_the_loop_is_told_once(monkeypatch):
    micro = MicroStep(None, None, None, torch.device("cpu"), "fp32", None, [], graphs=True,  # type: ignore[arg-type]
                      graphs_strict=False)
    assert micro.graphed is not None and micro.notice() is None
    micro.graphed.warmup = 0
    micro.graphed.fn = lambda inputs: torch.tensor(1.0)
    monkeypatch.setattr(micro.graphed, "_capture", lambda inputs: (_ for _ in ()).throw(REFUSED))
    micro.run({"input_ids": torch.zeros(1, 2)})
    notice = micro.notice()
    assert notice is not None and notice.startswith("training.cuda_graphs: capturing the micro-step failed")
    assert micro.notice() is None
