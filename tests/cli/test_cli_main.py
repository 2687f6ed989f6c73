"""The one error path of the ``entrenar`` command: exit codes, one-line errors, --debug."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from cli_helpers import fake_module

from entrenar.cli.main import COMMANDS, main
from entrenar.errors import ConfigError


def failing_train(error: BaseException):
    def train(recipe, **kwargs):
        raise error

    return train


def test_a_real_process_exits_2_with_one_error_line(tmp_path):
    missing = tmp_path / "missing.yaml"
    done = subprocess.run([sys.executable, "-m", "entrenar.cli.main", "train", str(missing)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == f"error: recipe file not found: {missing}\n"


def test_the_console_script_is_main():
    (script,) = entry_points(group="console_scripts", name="entrenar")
    assert script.load() is main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert COMMANDS == ("train", "inspect", "generate", "eval", "chat", "export", "quantize", "merge", "classify",
                        "recipes", "diagnose", "ablate")
    for command in COMMANDS:
        assert f"    {command} " in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["bogus"],
        ["inspect"],
        ["inspect", "m", "--seq-len", "0"],
        ["generate", "m", "--prompt", "x", "--device", "gpu"],
    ],
)
def test_usage_errors_exit_2(capsys, argv):
    assert main(argv) == 2
    assert "usage: entrenar" in capsys.readouterr().err


@pytest.mark.parametrize("argv, wrong, meant", [
    (["trian"], "trian", "train"),  # a command
    (["classify", "evl"], "evl", "eval"),  # a subcommand
    (["eval", "m", "--data", "d", "--train-on", "complete"], "complete", "completion"),  # a --choice
])
def test_a_misspelt_name_from_a_fixed_set_gets_did_you_mean(capsys, argv, wrong, meant):
    assert main(argv) == 2
    assert f"invalid choice: {wrong!r}; did you mean {meant!r}? (choose from " in capsys.readouterr().err


def test_user_error_is_one_line_without_traceback(capsys, monkeypatch):
    error = ConfigError("data.train: no such file x.jsonl")
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(error))
    assert main(["train"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: data.train: no such file x.jsonl\n"
    assert captured.out == ""


@pytest.mark.parametrize("argv", [["--debug", "train"], ["train", "--debug"]])
def test_debug_reraises_before_or_after_the_command(monkeypatch, argv):
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(ConfigError("bad")))
    with pytest.raises(ConfigError, match="bad"):
        main(argv)


def test_interrupt_exits_130(capsys, monkeypatch):
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(KeyboardInterrupt()))
    assert main(["train"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_a_bug_exits_1_and_points_to_debug(capsys, monkeypatch):
    bug = ZeroDivisionError("division by zero")
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(bug))
    assert main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("internal error: ZeroDivisionError: division by zero\n")
    assert "--debug" in err and "Traceback" not in err
    with pytest.raises(ZeroDivisionError):
        main(["--debug", "train"])


def test_a_device_out_of_memory_is_the_machine_s_limit_not_a_bug(capsys, monkeypatch):
    import torch

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has a total capacity of "
                                 "79.18 GiB of which 112.56 MiB is free. If reserved but unallocated memory is large "
                                 "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(oom))
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the device ran out of memory (CUDA out of memory. Tried to allocate 768.00 MiB.")
    assert "training.batch_size" in err and "internal error" not in err and "expandable_segments" not in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    "error,line",
    [
        (OSError(30, "Read-only file system", "/mnt/ro/out"), "error: /mnt/ro/out: Read-only file system\n"),
        (OSError(28, "No space left on device", "/data/out/model.safetensors"),
         "error: /data/out/model.safetensors: No space left on device\n"),
        (OSError(28, "No space left on device"), "error: No space left on device\n"),
        (PermissionError(13, "Permission denied", "/root/out"), "error: /root/out: Permission denied\n"),
        (FileNotFoundError(2, "No such file or directory", "data.jsonl"),
         "error: data.jsonl: No such file or directory\n"),
    ],
)
def test_an_os_error_about_the_users_files_is_one_line(capsys, monkeypatch, error, line):
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(error))
    assert main(["train"]) == 2
    assert capsys.readouterr().err == line
    with pytest.raises(OSError):
        main(["--debug", "train"])


@pytest.mark.parametrize("error", [OSError(22, "Invalid argument"), OSError("something odd"),
                                   FileNotFoundError(2, "No such file or directory")])
def test_an_os_error_that_names_no_path_is_still_a_bug(capsys, monkeypatch, error):
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(error))
    assert main(["train"]) == 1
    assert capsys.readouterr().err.startswith("internal error: ")


def test_a_full_disk_reported_by_safetensors_is_one_line(capsys, monkeypatch, tmp_path):
    from safetensors import SafetensorError

    error = SafetensorError('Error while serializing: I/O error: No space left on device (os error 28) at path '
                            f'"{tmp_path}/out/.tmpX1"')
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(error))
    assert main(["train"]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}/out: No space left on device\n"
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(SafetensorError("header too large")))
    assert main(["train"]) == 1  # not an OS error: still a bug


def test_a_closed_pipe_ends_the_command_quietly(capsys, monkeypatch):
    fake_module(monkeypatch, "entrenar.train.loop", train=failing_train(BrokenPipeError(32, "Broken pipe")))
    assert main(["train"]) == 0
    assert capsys.readouterr().err == ""


def test_a_real_process_piped_into_head_exits_quietly():
    """`entrenar inspect MODEL --json | head`: output longer than the pipe holds, the reader gone; no traceback."""
    program = ("import sys; from entrenar.cli import inspect, main; "
               "inspect.run = lambda args: [print('x' * 1000) for _ in range(2000)] and 0; "
               "sys.exit(main.main(['inspect', 'm']))")
    script = f"{sys.executable} -c \"{program}\" | head -c 10 >/dev/null; echo ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert (done.stdout, done.stderr) == ("0\n", "")
