"""The README's claims a new user acts on hold for the code: every ``backfill`` command it names
exists, what the browser tests need, that simulated answers are filler text (the sentence quoted
is the simulator's), and the ``url`` rule (``url_mismatch``)."""

from __future__ import annotations

import re
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()


def test_every_backfill_command_in_the_readme_exists():
    from backfill.cli import COMMANDS

    named = set(re.findall(r"\bbackfill ([a-z][\w-]*)", README)) - {"ready"}  # "backfill ready": the ready line
    assert {"batches", "files", "submit", "enqueue"} <= named  # the client commands are documented
    assert named <= set(COMMANDS), named - set(COMMANDS)


def test_the_browser_tests_need_what_the_readme_says():
    source = (ROOT / "tests" / "browser" / "test_dashboard.py").read_text()
    assert 'CHROMIUM = Path("/usr/bin/chromium")' in source and "pytest.skip(" in source
    assert "`/usr/bin/chromium`" in README and "apt-get install chromium" in README
    assert "skipped" in README.split("## Tests and benchmarks")[1]


def test_simulated_answers_are_the_filler_sentence_the_readme_quotes():
    from engine_twin.tokenizer import _FILLER_TEXT

    assert "filler text" in README
    assert f'("{_FILLER_TEXT.strip()}")' in README.replace("\n", " ")


def test_a_url_without_v1_is_url_mismatch_as_the_readme_says():
    from workers.validation import validate_batch_file

    line = {"custom_id": "r1", "method": "POST", "url": "/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    report = validate_batch_file([orjson.dumps(line) + b"\n"], endpoint="/v1/chat/completions")
    assert [(e.code, e.param) for e in report.errors] == [("url_mismatch", "url")]
    assert '`"url": "/chat/completions"`' in README and "`url_mismatch`" in README
