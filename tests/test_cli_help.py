"""`ntpflow --help` and each command's `--help`: a short description, every command once, each command's own
examples (not the global ones)."""

import pytest

from ntpflow.cli import EXAMPLES, build_parser, main


def help_of(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def commands() -> dict:
    return next(a for a in build_parser()._actions if a.dest == "command").choices


def test_top_help_is_a_description_not_the_module_docstring(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    out = help_of(capsys)
    assert "Parses input, builds configs" not in out and "``" not in out
    assert out.startswith("usage: ntpflow") and "ntpflow trains small GPT-2 models" in out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("    ") and line[4] != " "]
    assert listed == list(commands())  # every command with its one-line help, in order
    assert out.count("examples:") == 1 and out.count("Python equivalents:") == 1


@pytest.mark.parametrize("command", list(commands()))
def test_command_help_shows_its_own_examples_not_the_global_ones(capsys, command):
    out = help_of(capsys, command)
    assert out.startswith(f"usage: ntpflow {command}")
    assert "Python equivalents:" not in out
    assert "ntpflow reproduce all --scale small   # every experiment" not in out
    own = [line for line in out.splitlines() if f"ntpflow {command} " in line and "usage:" not in line]
    assert own, out  # at least one example of the command itself
    others = [line for line in out.splitlines() if line.strip().startswith("ntpflow ")
              and not line.strip().startswith(f"ntpflow {command}")]
    assert not others, others  # no examples of other commands


def test_train_help_is_not_the_global_examples(capsys):
    out = help_of(capsys, "train")
    assert EXAMPLES.strip() not in out
    assert "ntpflow probe runs/maj-myopic-s0" not in out and "--set KEY=VALUE" in out
