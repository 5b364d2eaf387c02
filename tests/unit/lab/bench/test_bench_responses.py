"""`backfill bench responses` on a tiny fleet writes the JSON shape of ``docs/benchmarks.md``: both
modes send the same prompts, chaining sends fewer bytes from the second turn on, reuse is there."""

from __future__ import annotations

import json

from click.testing import CliRunner

from lab.bench.responses import MODES, responses_command


def test_tiny_run_compares_both_modes_on_the_same_prompts(tmp_path):
    out = tmp_path / "responses.json"
    result = CliRunner().invoke(responses_command, ["--sessions", "2", "--turns", "3", "--engines", "1",
                                                    "--time-scale", "0", "--json", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    modes = payload["modes"]
    assert list(modes) == list(MODES)
    assert all(m["requests"] == 6 and m["errors"] == 0 for m in modes.values()), modes
    assert modes["resend"]["input_tokens"] == modes["previous_response_id"]["input_tokens"] > 0
    assert modes["previous_response_id"]["client_bytes"] < modes["resend"]["client_bytes"]
    assert modes["previous_response_id"]["captured_reuse"] > 0.9
    assert payload["summary"]["reuse_not_lower"] is True
