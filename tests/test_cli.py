"""The `stallfree` dispatcher: every command answers --help (cheaply, in a fresh process) and an unknown
command is refused with the list."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stallfree.cli import COMMANDS, main


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name):
    proc = subprocess.run(
        [sys.executable, "-m", "stallfree", name, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "usage: stallfree " in proc.stdout.lower() and name in proc.stdout


def test_unknown_command_lists_the_commands(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err and all(n in err for n in COMMANDS)
