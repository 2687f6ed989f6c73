"""Sharded checkpoints (torch.distributed.checkpoint) on one process: an exact round trip, an atomic write, and
checks that name what does not fit. The multi-process resumes are in test_fsdp.py."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from entrenar.distributed.world import SOLO
from entrenar.errors import CheckpointError
from entrenar.train.checkpoint import is_sharded, latest_checkpoint, load_checkpoint
from entrenar.train.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint


def model_and_optimizer(seed: int = 0, width: int = 6) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))
    model[0].weight.requires_grad_(False)  # frozen, as a LoRA run's base: not saved
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.linspace(-1, 1, 8).reshape(2, 4)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_round_trip_restores_weights_optimizer_and_generators_exactly(tmp_path):
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer)
    ckpt = save_sharded_checkpoint(tmp_path, 1, model, optimizer, {"data": {"position": 7}}, SOLO)
    assert ckpt == tmp_path / "checkpoints" / "step-1" and is_sharded(ckpt) and latest_checkpoint(tmp_path) == ckpt
    expected_draw = torch.rand(3)
    train_step(model, optimizer)  # the uninterrupted run's next step

    restored, restored_optimizer = model_and_optimizer(seed=1)  # other weights, a fresh optimizer
    restored[0].weight.data.copy_(model[0].weight)  # the frozen base comes from the model files, not the checkpoint
    state = load_sharded_checkpoint(ckpt, restored, restored_optimizer, SOLO)
    assert state == {"data": {"position": 7}, "step": 1}
    torch.testing.assert_close(torch.rand(3), expected_draw, rtol=0, atol=0)
    train_step(restored, restored_optimizer)
    for (name, got), want in zip(restored.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    got_state, want_state = restored_optimizer.state_dict()["state"], optimizer.state_dict()["state"]
    for i in want_state:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got_state[i][key], want_state[i][key], rtol=0, atol=0)


def test_a_failed_write_leaves_the_previous_checkpoint_and_no_partial_folder(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    model, optimizer = model_and_optimizer()
    train_step(model, optimizer)
    save_sharded_checkpoint(tmp_path, 1, model, optimizer, {"data": {}}, SOLO)

    def failing_save(state, checkpoint_id, **_):
        os.makedirs(checkpoint_id)
        with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as half:
            half.write(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(dcp, "save", failing_save)
    with pytest.raises(CheckpointError, match=r"step-2: writing the shards failed \(No space left on device\)"):
        save_sharded_checkpoint(tmp_path, 2, model, optimizer, {"data": {}}, SOLO)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-1"]
    assert latest_checkpoint(tmp_path).name == "step-1"


def test_non_finite_weights_are_refused_before_anything_is_written(tmp_path):
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer)
    with torch.no_grad():
        model[2].bias[1] = float("nan")
    with pytest.raises(CheckpointError, match=r"step-1/shards: tensor 'model\.2\.bias' holds 1 non-finite"):
        save_sharded_checkpoint(tmp_path, 1, model, optimizer, {"data": {}}, SOLO)
    assert not (tmp_path / "checkpoints" / "step-1").exists()


def test_a_checkpoint_that_does_not_fit_the_model_is_named(tmp_path):
    model, optimizer = model_and_optimizer()
    train_step(model, optimizer)
    ckpt = save_sharded_checkpoint(tmp_path, 1, model, optimizer, {"data": {}}, SOLO)
    wider, wider_optimizer = model_and_optimizer(width=5)
    with pytest.raises(CheckpointError, match=r"shards: tensor '0\.bias' has shape \(6,\), the model has \(5,\)"):
        load_sharded_checkpoint(ckpt, wider, wider_optimizer, SOLO)
    other = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3), nn.Linear(3, 3))
    other[0].weight.requires_grad_(False)
    with pytest.raises(CheckpointError, match=r"shards: tensor '3\.weight' of the model is missing \(2 missing"):
        load_sharded_checkpoint(ckpt, other, torch.optim.AdamW(other[1:].parameters()), SOLO)
    with pytest.raises(CheckpointError, match=r"step-1: a sharded checkpoint .*entrenar train --resume"):
        load_checkpoint(ckpt)

