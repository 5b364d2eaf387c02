"""Every ``--help`` of the command line is plain text: no reStructuredText markup from the
docstrings, no issue numbers. The commands are walked from the top group, subgroups included."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from backfill.cli import main

MARKUP = re.compile(r"``|:(?:func|mod|class|meth|data|attr):|\bissue \d")


def _command_paths(group: click.Group, prefix: list[str]) -> list[list[str]]:
    ctx = click.Context(group)
    paths = [prefix]
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            paths += _command_paths(command, [*prefix, name])
        else:
            paths.append([*prefix, name])
    return paths


@pytest.mark.parametrize("argv", [[*path, "--help"] for path in _command_paths(main, [])], ids=" ".join)
def test_help_is_plain_text(argv):
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert MARKUP.findall(result.output) == [], result.output


def test_the_markup_check_finds_markup():
    assert MARKUP.findall("see ``x`` and :func:`y` (issue 12)")
