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
    assert COMMANDS == ("train", "inspect", "generate", "eval", "chat", "export", "quantize", "merge")
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
