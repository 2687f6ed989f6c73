"""The launcher without processes: torchrun's options, the one-line root cause, the worker's error report."""

from __future__ import annotations

import json

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.run import config_from_args, parse_args

from entrenar.cli.main import main
from entrenar.distributed.launch import LAUNCHER_ENV, report_worker_error, root_cause, torchrun_args
from entrenar.errors import DataError


def test_torchrun_options_parse_into_torchruns_own_config():
    config, _, _ = config_from_args(parse_args([*torchrun_args(4, max_restarts=2), "-m", "entrenar"]))
    assert (config.nproc_per_node, config.max_nodes, config.max_restarts) == (4, 1, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "localhost:0")  # torchrun --standalone
    config, _, _ = config_from_args(parse_args([*torchrun_args(8, 2, 1, "node0:29500"), "-m", "entrenar"]))
    assert (config.rdzv_backend, config.rdzv_configs["rank"], config.rdzv_endpoint) == ("static", 1, "node0:29500")
    config, _, _ = config_from_args(parse_args([*torchrun_args(8, 3, None, "node0:29500"), "-m", "entrenar"]))
    assert (config.rdzv_backend, config.min_nodes, config.rdzv_endpoint) == ("c10d", 3, "node0:29500")


def failure(tmp_path, rank: int, exitcode: int, report: dict | None) -> ProcessFailure:
    path = tmp_path / f"error-{rank}-{len(list(tmp_path.iterdir()))}.json"  # a file of its own
    if report is not None:
        path.write_text(json.dumps(report))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_the_root_cause_is_the_user_error_then_the_silent_death(tmp_path):
    lost = {"message": {"message": "RuntimeError: Connection closed by peer", "extraInfo": {"timestamp": "1"}}}
    user = {"message": "data.train: no such file", "timestamp": 5, "entrenar": "user"}
    assert root_cause({0: failure(tmp_path, 0, 1, lost), 1: failure(tmp_path, 1, 2, user)}) == \
        "rank 1: data.train: no such file (1 other rank(s) stopped with it)"
    assert root_cause({0: failure(tmp_path, 0, 1, lost), 1: failure(tmp_path, 1, -9, None)}) == \
        "rank 1: the process stopped with signal 9 (SIGKILL) (1 other rank(s) stopped with it)"
    assert root_cause({0: failure(tmp_path, 0, 1, lost)}).startswith(
        "rank 0: the process stopped with exit code 1: RuntimeError: Connection closed by peer (this rank lost")


def test_a_launched_worker_reports_to_its_error_file_and_prints_nothing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert not report_worker_error(DataError("x"), user_error=True)  # not under entrenar's launcher
    monkeypatch.setenv(LAUNCHER_ENV, "1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == ""
    assert json.loads(path.read_text())["entrenar"] == "user"
    assert "missing.yaml" in json.loads(path.read_text())["message"]


def test_a_nested_launch_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("training: {max_steps: 1}\n")
    assert main(["train", str(recipe), "--nproc-per-node", "2"]) == 2
    assert "already a worker of torchrun" in capsys.readouterr().err


def test_a_job_of_one_process_runs_as_a_plain_process(monkeypatch):
    """torchrun --nproc-per-node 1 opens no process group (a run of one needs no collectives, and CUDA graphs and
    overlapped steps then apply as on a plain process); FSDP on one process still gets its group."""
    import torch
    import torch.distributed as dist

    from entrenar.distributed.world import join, leave

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29517"}.items():
        monkeypatch.setenv(key, value)
    world, device = join(torch.device("cpu"), 30)
    assert not world.distributed and world.size == 1 and device == torch.device("cpu")
    assert not dist.is_initialized()
    world, _ = join(torch.device("cpu"), 30, group_for_one=True)
    try:
        assert world.distributed and dist.is_initialized() and dist.get_world_size() == 1
    finally:
        leave()
