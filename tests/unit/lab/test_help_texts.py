"""Every ``--help`` of the measurement wing is plain text: no reStructuredText markup from the
docstrings, no issue numbers."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from backfill.bench import BENCHMARKS
from backfill.cli import main

MARKUP = re.compile(r"``|:(func|mod|class|meth|data|attr):|\bissue \d")


@pytest.mark.parametrize("argv", [["bench", name, "--help"] for name in BENCHMARKS]
                         + [["simulate", "--help"], ["bench", "--help"], ["--help"]])
def test_help_is_plain_text(argv):
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert MARKUP.findall(result.output) == [], result.output
