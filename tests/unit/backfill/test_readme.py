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


def test_the_readme_starts_with_a_five_line_quick_start():
    sections = re.findall(r"^## (.+)$", README, flags=re.M)
    assert sections[0] == "Quick start"
    block = README.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    steps = [line.split("#")[0].split() for line in block.strip().splitlines()]
    assert len(steps) == 5
    assert steps[0][:2] == ["backfill", "up"] and "--admin-key" in steps[0]  # the dashboard needs it
    assert steps[1][-1].endswith("/admin")
    assert [s[:2] for s in steps[2:]] == [["backfill", "submit"], ["backfill", "batches"], ["backfill", "batches"]]
    assert [s[2] for s in steps[3:]] == ["show", "download"]


def test_running_it_is_short_sections_and_says_the_dashboard_needs_the_admin_key():
    running = README.split("## Running it", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^### .+$", running, flags=re.M)[1:]
    assert len(parts) >= 8
    assert all(len([line for line in part.splitlines() if line.strip()]) <= 40 for part in parts)
    dashboard = running.split("### The dashboard", 1)[1].split("### ", 1)[0]
    assert "needs the" in dashboard and "`--admin-key KEY`" in dashboard
