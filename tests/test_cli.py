"""The `stallfree` dispatcher: every command answers --help (cheaply, in a fresh process), an unknown
command is refused with the list, and the list holds only what a user runs (experiments live in experiments/)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stallfree.cli import COMMANDS, main

# What a user runs (STYLE.md habit 12). A new product command is added here on purpose; an experiment is
# added to experiments/ instead.
PRODUCT_COMMANDS = {"generate", "serve", "up", "operator", "download", "bench", "profile", "tune", "simulate"}


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


def test_help_lists_only_product_commands(capsys):
    assert main(["--help"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert listed == set(COMMANDS) == PRODUCT_COMMANDS
    assert all(module.startswith("stallfree.") for module, _ in COMMANDS.values())
