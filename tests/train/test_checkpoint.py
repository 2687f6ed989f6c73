"""Checkpoints: exact resume, atomic save under crashes, pruning, and errors that name the file."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from entrenar.errors import CheckpointError
from entrenar.train import checkpoint as ckpt_mod
from entrenar.train.checkpoint import (
    best_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    mark_best,
    save_checkpoint,
)
from entrenar.train.optim import build_optimizer, build_param_groups


def _model(seed: int = 0, hidden: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, 4))


def _optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    groups = build_param_groups(model, weight_decay=0.1, lr_scale={r"^3\.": 2.0})
    return build_optimizer(groups, name, lr=1e-2, momentum=0.9)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """A few steps on data drawn from the global RNG, so a restored RNG draws the same data."""
    for _ in range(steps):
        x = torch.randn(5, 8)
        loss = model(x).pow(2).mean() + 0.01 * np.random.rand() + 0.0 * random.random()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _save(run: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, **kw) -> Path:
    state = {"lr": 1e-2, "data": {"epoch": 0, "position": step * 5}, "best_eval_loss": float("inf")}
    return save_checkpoint(run, step, model.state_dict(), opt, state, **kw)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_resume_continues_bit_exactly(tmp_path: Path, name: str) -> None:
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    model = _model()
    opt = _optimizer(model, name)
    _train(model, opt, 3)
    path = _save(tmp_path, 3, model, opt)
    saved_opt_state = opt.state_dict()  # holds the live tensors: copy them before training on
    saved_opt_state["state"] = {
        pid: {k: v.clone() for k, v in st.items()} for pid, st in saved_opt_state["state"].items()
    }
    _train(model, opt, 2)  # the uninterrupted run
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(999)  # a new process: different weights, different RNG
    np.random.seed(999)
    random.seed(999)
    model2 = _model(seed=7)
    opt2 = _optimizer(model2, name)
    model_state, trainer_state = load_checkpoint(tmp_path, opt2, expected_model_state=model2.state_dict())
    model2.load_state_dict(model_state)
    assert trainer_state == {
        "lr": 1e-2,
        "data": {"epoch": 0, "position": 15},
        "best_eval_loss": float("inf"),
        "step": 3,
    }

    restored = opt2.state_dict()
    assert restored["param_groups"] == saved_opt_state["param_groups"]  # betas stay a tuple, names and lr_scale kept
    for pid, state in saved_opt_state["state"].items():
        for key, value in state.items():
            assert torch.equal(restored["state"][pid][key], value), (pid, key)
    _train(model2, opt2, 2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert path == tmp_path / "checkpoints" / "step-3"


def test_rng_streams_continue_after_load(tmp_path: Path) -> None:
    model = _model()
    opt = _optimizer(model, "adamw")
    _ = torch.rand(3), np.random.rand(), random.random(), random.gauss(0, 1)  # leaves a cached gaussian
    _save(tmp_path, 1, model, opt)
    uninterrupted = (torch.rand(4), np.random.rand(3), random.random(), random.gauss(0, 1))
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    load_checkpoint(tmp_path, opt)
    resumed = (torch.rand(4), np.random.rand(3), random.random(), random.gauss(0, 1))
    assert torch.equal(resumed[0], uninterrupted[0])
    assert np.array_equal(resumed[1], uninterrupted[1])
    assert resumed[2:] == uninterrupted[2:]


def test_nothing_is_pickled(tmp_path: Path) -> None:
    model = _model()
    opt = _optimizer(model, "adamw")
    _train(model, opt, 1)
    path = _save(tmp_path, 1, model, opt)
    assert sorted(p.name for p in path.iterdir()) == sorted(ckpt_mod.REQUIRED_FILES)
    saved = json.loads((path / "optimizer.json").read_text())
    assert saved["param_groups"][0]["betas"] == {"__tuple__": [0.9, 0.999]}
    assert saved["state"]["__int_keys__"]["0"]["exp_avg"] == {"__tensor__": "state.0.exp_avg"}


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    opt = _optimizer(model, "adamw")
    _train(model, opt, 1)
    _save(tmp_path, 1, model, opt)
    step1_weights = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 1)

    real_save = ckpt_mod.save_file
    calls = []

    def save_then_crash(*args, **kwargs):
        calls.append(args[1])
        if len(calls) > 1:
            raise OSError("disk full")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "save_file", save_then_crash)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2, model, opt)
    assert Path(calls[0]).name == "model.safetensors"  # the crash came after one file was written
    monkeypatch.undo()

    ckpts = tmp_path / "checkpoints"
    assert not (ckpts / "step-2").exists()
    assert (ckpts / "latest").read_text().strip() == "step-1"
    assert latest_checkpoint(tmp_path) == ckpts / "step-1"
    model_state, trainer_state = load_checkpoint(tmp_path, _optimizer(_model(), "adamw"))
    assert trainer_state["step"] == 1
    assert all(torch.equal(model_state[k], step1_weights[k]) for k in step1_weights)

    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-1"]  # the failed save left no temporary

    # A hard kill leaves the staging folder behind: it is ignored, then cleaned by the next save.
    leftover = ckpts / ".step-2.k1ll3d.tmp" / "new"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == ckpts / "step-1"
    _save(tmp_path, 2, model, opt)
    assert latest_checkpoint(tmp_path) == ckpts / "step-2"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-1", "step-2"]


def test_incomplete_checkpoint_is_skipped_and_refused(tmp_path: Path) -> None:
    model = _model()
    opt = _optimizer(model, "sgd")
    _save(tmp_path, 1, model, opt)
    broken = _save(tmp_path, 2, model, opt)
    (broken / "optimizer.json").unlink()
    with pytest.warns(UserWarning, match="latest names step-2, which is not a complete checkpoint; using step-1"):
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-1"
    (tmp_path / "checkpoints" / "latest").unlink()  # no pointer: fall back to the highest complete step
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-1"
    with pytest.raises(CheckpointError, match=r"step-2: incomplete checkpoint, missing optimizer.json"):
        load_checkpoint(broken, opt)
    assert latest_checkpoint(tmp_path / "elsewhere") is None
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_checkpoint(_empty_run(tmp_path), opt)


def _empty_run(tmp_path: Path) -> Path:
    run = tmp_path / "empty-run"
    (run / "checkpoints").mkdir(parents=True)
    return run


def test_keep_last_spares_the_best(tmp_path: Path) -> None:
    model = _model()
    opt = _optimizer(model, "sgd")
    for step in range(1, 6):
        _save(tmp_path, step, model, opt, keep_last=2)
        if step == 2:
            mark_best(tmp_path, 2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step-2", "step-4", "step-5"]
    assert best_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-2"
    with pytest.raises(CheckpointError, match="step-3: cannot mark as best"):
        mark_best(tmp_path, 3)
    with pytest.raises(CheckpointError, match="keep_last"):
        _save(tmp_path, 6, model, opt, keep_last=0)


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    model = _model()
    opt = _optimizer(model, "sgd")
    _save(tmp_path, 1, model, opt)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    _save(tmp_path, 1, model, opt)
    model_state, _ = load_checkpoint(tmp_path)
    assert torch.equal(model_state["0.weight"], model[0].weight)


def test_tied_tensors_are_saved(tmp_path: Path) -> None:
    model = _model()
    state = dict(model.state_dict())
    state["tied.weight"] = state["0.weight"]  # shares storage, as tied embeddings do
    save_checkpoint(tmp_path, 1, state, _optimizer(model, "sgd"), {})
    loaded, trainer = load_checkpoint(tmp_path)
    assert torch.equal(loaded["tied.weight"], model[0].weight) and trainer == {"step": 1}


def test_model_mismatch_names_file_and_tensor(tmp_path: Path) -> None:
    model = _model()
    _save(tmp_path, 1, model, _optimizer(model, "adamw"))
    other = _model(hidden=12)
    with pytest.raises(
        CheckpointError, match=r"model.safetensors: tensor '0.weight' has shape \(16, 8\), the model has \(12, 8\)"
    ):
        load_checkpoint(tmp_path, expected_model_state=other.state_dict())
    renamed = {"x." + k: v for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'x.0.weight' of the model is missing"):
        load_checkpoint(tmp_path, expected_model_state=renamed)
    fewer = {k: v for k, v in model.state_dict().items() if k != "3.bias"}
    with pytest.raises(CheckpointError, match=r"tensor '3.bias' is not in the model"):
        load_checkpoint(tmp_path, expected_model_state=fewer)


def test_optimizer_mismatch_names_the_parameter(tmp_path: Path) -> None:
    model = _model()
    opt = _optimizer(model, "adamw")
    _train(model, opt, 1)
    _save(tmp_path, 1, model, opt)
    other = _model(hidden=12)
    other_opt = _optimizer(other, "adamw")
    before = torch.get_rng_state()
    with pytest.raises(
        CheckpointError,
        match=r"optimizer.safetensors: tensor 'state.0.exp_avg' \(parameter '0.weight'\) has shape \(16, 8\)",
    ):
        load_checkpoint(tmp_path, other_opt)
    assert torch.equal(torch.get_rng_state(), before)  # a refused checkpoint changes nothing
    assert not other_opt.state

    frozen = _model()
    frozen[1].requires_grad_(False)  # the LayerNorm leaves the no-decay group
    with pytest.raises(CheckpointError, match="optimizer.json: group 1 has 3 parameters saved, the optimizer has 1"):
        load_checkpoint(tmp_path, _optimizer(frozen, "adamw"))


def test_corrupt_files_are_named(tmp_path: Path) -> None:
    model = _model()
    path = _save(tmp_path, 1, model, _optimizer(model, "adamw"))
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"step-1/model.safetensors: corrupt safetensors file"):
        load_checkpoint(path)
    (path / "model.safetensors").write_bytes(data)
    (path / "trainer.json").write_text('{\n  "step": 1,\n  oops\n}')
    with pytest.raises(CheckpointError, match=r"step-1/trainer.json: corrupt JSON at line 3"):
        load_checkpoint(path)
    (path / "trainer.json").write_text('{"format_version": 99, "step": 1}')
    with pytest.raises(CheckpointError, match="unsupported format_version 99"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match="no run folder or checkpoint"):
        load_checkpoint(tmp_path / "missing")


def test_trainer_state_must_be_json(tmp_path: Path) -> None:
    model = _model()
    with pytest.raises(TypeError, match="JSON-serialisable"):
        save_checkpoint(tmp_path, 1, model.state_dict(), _optimizer(model, "sgd"), {"when": object()})
    with pytest.raises(ValueError, match="'step'"):
        save_checkpoint(tmp_path, 1, model.state_dict(), _optimizer(model, "sgd"), {"step": 2})
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_fused_choice_is_not_taken_from_the_checkpoint(tmp_path: Path) -> None:
    model = _model()
    fused = build_optimizer(build_param_groups(model, 0.1), "adamw", lr=1e-3, fused=True)
    _train(model, fused, 1)
    save_checkpoint(tmp_path, 1, model.state_dict(), fused, {})
    plain = build_optimizer(build_param_groups(model, 0.1), "adamw", lr=1e-3, fused=False)
    load_checkpoint(tmp_path, plain)
    assert all(not g["fused"] for g in plain.param_groups)
    assert all(torch.equal(plain.state[p]["exp_avg"], fused.state[p]["exp_avg"]) for p in model.parameters())


def test_a_trainer_state_naming_another_step_than_its_folder_is_refused(tmp_path: Path) -> None:
    model = _model()
    path = _save(tmp_path, 4, model, _optimizer(model, "sgd"))
    state = json.loads((path / "trainer.json").read_text())
    state["step"] = 2
    (path / "trainer.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=r"step-4/trainer.json: says step 2 but the folder is step-4"):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"says step 2 but the folder is step-4"):
        load_checkpoint(tmp_path)  # through the run folder's latest too


@pytest.mark.parametrize("pointer", [b"\xff\xfe step-2\x00", b"step-9\n", b"../../etc\n"])
def test_a_damaged_latest_pointer_falls_back_to_the_newest_complete_checkpoint(tmp_path: Path, pointer) -> None:
    model = _model()
    opt = _optimizer(model, "sgd")
    _save(tmp_path, 1, model, opt)
    _save(tmp_path, 2, model, opt)
    (tmp_path / "checkpoints" / "latest").write_bytes(pointer)
    with pytest.warns(UserWarning, match=r"latest.*(unreadable pointer|does not name a checkpoint|names step-9, which "
                                         r"is not a complete checkpoint).*newest complete"):
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-2"
    with pytest.warns(UserWarning):
        assert load_checkpoint(tmp_path, opt)[1]["step"] == 2
    _save(tmp_path, 3, model, opt)  # the next save repairs the pointer
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-3\n"


def test_deeply_nested_json_and_a_cut_rng_state_name_the_file(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = _model()
    opt = _optimizer(model, "adamw")
    _train(model, opt, 1)
    path = _save(tmp_path, 1, model, opt)
    deep = "[" * 100_000 + "]" * 100_000
    good_optimizer = (path / "optimizer.json").read_bytes()
    for name in ("trainer.json", "optimizer.json"):
        good = (path / name).read_bytes()
        (path / name).write_text(deep)
        with pytest.raises(CheckpointError, match=rf"step-1/{name}: corrupt JSON, nested too deeply"):
            load_checkpoint(path, _optimizer(_model(), "adamw"))
        (path / name).write_bytes(good)
    # Nested less deeply than the JSON reader's limit, but more than the optimizer-state decoder's (Python 3.11;
    # where the interpreter's limits let it through, the malformed groups are refused by name instead).
    (path / "optimizer.json").write_text('{"state": {}, "param_groups": ' + "[" * 900 + "]" * 900 + "}")
    with pytest.raises(CheckpointError, match=r"step-1/optimizer.json: (nested too deeply|corrupt JSON, nested|"
                                              r"1 parameter groups saved)"):
        load_checkpoint(path, _optimizer(_model(), "adamw"))
    (path / "optimizer.json").write_bytes(good_optimizer)

    rng_file = path / "rng.safetensors"
    good_rng = rng_file.read_bytes()
    damages = {  # a cut-short state, and whole states of the wrong shape (a TypeError inside numpy before)
        "torch_cpu": (lambda t: t[:100].clone(), r"'torch_cpu' is torch.uint8 of shape \[100\], a generator state "
                                                r"is torch.uint8 of shape \[\d+\]"),
        "numpy_keys": (lambda t: t.reshape(624, 1).clone(), r"'numpy_keys' is torch.int64 of shape \[624, 1\]"),
    }
    for name, (damage, message) in damages.items():
        with safe_open_metadata(rng_file) as metadata:
            tensors = load_file(str(rng_file))
            tensors[name] = damage(tensors[name])
            save_file(tensors, str(rng_file), metadata=metadata)
        opt = _optimizer(_model(), "adamw")
        before = torch.get_rng_state()
        with pytest.raises(CheckpointError, match=r"step-1/rng.safetensors: tensor " + message):
            load_checkpoint(path, opt)
        assert torch.equal(torch.get_rng_state(), before) and opt.state_dict()["state"] == {}  # nothing restored
        rng_file.write_bytes(good_rng)
    with safe_open_metadata(rng_file) as metadata:  # metadata of the wrong types
        tensors = load_file(str(rng_file))
        save_file(tensors, str(rng_file), metadata={**metadata, "numpy": json.dumps(
            {"kind": "MT19937", "pos": [1], "has_gauss": 0, "cached_gaussian": 0.0})})
    with pytest.raises(CheckpointError, match=r"step-1/rng.safetensors: RNG metadata 'python_random' or 'numpy'"):
        load_checkpoint(path, _optimizer(_model(), "adamw"))


class safe_open_metadata:
    """The metadata of a safetensors file, for rewriting it with other tensors."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            self.metadata = f.metadata()

    def __enter__(self) -> dict:
        return self.metadata

    def __exit__(self, *exc) -> None:
        return None


def test_saves_clean_stale_staging_left_by_a_killed_save(tmp_path: Path) -> None:
    import subprocess
    import sys

    model = _model()
    opt = _optimizer(model, "sgd")
    _save(tmp_path, 1, model, opt)
    ckpts = tmp_path / "checkpoints"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has ended
    stale = [ckpts / f".step-2.{dead_pid}-abc123.tmp", ckpts / f".latest.{dead_pid}-x9y8z7.tmp",
             ckpts / ".best.oldstyle.tmp"]
    (stale[0] / "new").mkdir(parents=True)
    stale[1].write_text("step-2")
    stale[2].write_text("step-2")
    alive = ckpts / f".step-3.{__import__('os').getppid()}-live12.tmp"  # a live process's save in progress
    alive.mkdir()
    mine = ckpts / "notes.tmp"  # not entrenar's name: never touched
    mine.write_text("mine")
    _save(tmp_path, 2, model, opt, best=True)
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(["best", "latest", "step-1", "step-2", alive.name,
                                                              mine.name])


_BOUNDARIES = ("replace", "rename", "unlink", "rmdir", "mkdir", "fsync")  # os calls between which a kill can land


def _save_killed_at(run: Path, boundary: int, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    """Save ``step`` (keep_last=1, so the rotation deletes the previous one) in a forked child that dies
    (os._exit, as a kill -9 would: no cleanup runs) just before its ``boundary``-th file-system call.
    True if the save finished before reaching that call."""
    pid = os.fork()
    if pid == 0:  # the child: count the calls, die at the chosen one
        count = [0]

        def dying(real):
            def call(*args, **kwargs):
                count[0] += 1
                if count[0] == boundary:
                    os._exit(9)
                return real(*args, **kwargs)
            return call

        for name in _BOUNDARIES:
            setattr(os, name, dying(getattr(os, name)))
        try:
            _save(run, step, model, opt, keep_last=1)
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 9), f"the save failed in the child (exit {code}) at boundary {boundary}"
    return code == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_kill_at_any_file_boundary_of_a_rotation_leaves_only_whole_checkpoints(tmp_path: Path) -> None:
    model = _model()
    opt = _optimizer(model, "adamw")
    for boundary in range(1, 200):
        run = tmp_path / f"kill-{boundary}"
        _save(run, 2, model, opt, keep_last=1)
        finished = _save_killed_at(run, boundary, 3, model, opt)
        ckpts = run / "checkpoints"
        steps = [d for d in ckpts.iterdir() if d.name.startswith("step-")]
        assert steps and all((d / f).is_file() for d in steps
                             for f in ckpt_mod.REQUIRED_FILES), (boundary, sorted(p.name for p in ckpts.iterdir()))
        latest = latest_checkpoint(run)
        assert latest is not None and latest.name in ("step-2", "step-3")
        load_checkpoint(run, _optimizer(_model(), "adamw"))  # what resume would read is whole
        _save(run, 4, model, opt, keep_last=1)  # the next save cleans whatever the kill left
        assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-4"]
        if finished:
            break
    else:
        raise AssertionError("the save never finished: the boundary count is wrong")
    assert boundary > 10  # the kill landed between every pair of file-system calls of a whole save


def test_resume_names_and_removes_incomplete_checkpoint_folders(tmp_path: Path) -> None:
    from entrenar.train.resume import run_folder

    model = _model()
    opt = _optimizer(model, "sgd")
    _save(tmp_path, 1, model, opt)
    broken = _save(tmp_path, 2, model, opt)
    (broken / "model.safetensors").unlink()  # as an older version's killed rotation could leave it
    with pytest.warns(UserWarning, match=r"removed 1 incomplete checkpoint folder\(s\) \(step-2\)"):
        _, ckpt = run_folder(None, tmp_path, dry_run=False)  # type: ignore[arg-type]
    assert ckpt == tmp_path / "checkpoints" / "step-1"
    assert not broken.exists()
