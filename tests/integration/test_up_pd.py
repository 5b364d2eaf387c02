"""``backfill up --prefill-engines N --decode-engines M``: a prefill/decode fleet on one machine. The
engines start in their roles, the router gets them as ``--prefill-engine`` / ``--decode-engine``,
a long prompt is prefilled on the prefill engine (one token generated there) and decoded on the
decode engine, and combinations that cannot make a fleet are refused before anything starts."""

from __future__ import annotations

import json

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from backfill.up import run_stack, up_command
from tests.conftest import free_port


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == name
               for s in f.samples if s.name.endswith("_total"))


@pytest.mark.parametrize(("args", "message"), [
    (["--prefill-engines", "2"], "--prefill-engines 2 needs --decode-engines"),
    (["--decode-engines", "1"], "--decode-engines 1 needs --prefill-engines"),
    (["--prefill-engines", "1", "--decode-engines", "1", "--engine-url", "http://127.0.0.1:9"],
     "cannot be combined with --engine-url"),
    (["--prefill-engines", "-1", "--decode-engines", "1"], "-1 is not in the range"),
])
def test_combinations_that_make_no_fleet_are_usage_errors(tmp_path, args, message):
    data_dir = tmp_path / "never-made"
    result = CliRunner().invoke(up_command, ["--data-dir", str(data_dir), "--port", str(free_port()), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not data_dir.exists()  # refused before the stores start


def test_up_runs_prefill_and_decode_engines_in_their_roles(database_url, stores, monkeypatch, tmp_path):
    monkeypatch.setenv("DATABASE_URL", database_url)
    monkeypatch.setenv("REDIS_URL", stores.redis_url)
    with run_stack(tmp_path / "data", "127.0.0.1", free_port(), "sk-up-pd", engines=0,
                   prefill_engines=1, decode_engines=2) as stack:
        assert len(stack.engine_urls) == 3
        prefill = [u for u, r in stack.engine_roles.items() if r == "prefill"]
        decode = [u for u, r in stack.engine_roles.items() if r == "decode"]
        assert len(prefill) == 1 and len(decode) == 2
        assert set(stack.children) >= {"prefill-0", "decode-0", "decode-1", "router"}
        assert "engine-0" not in stack.children  # --engines counts engines doing both: none asked for
        router_argv = stack.argv["router"]
        assert router_argv[router_argv.index("--prefill-engine") + 1] == prefill[0]
        assert "--engine" not in router_argv
        described = json.loads((tmp_path / "data" / "stack.json").read_text())
        assert described["engine_roles"] == stack.engine_roles

        # a 4,000-token prompt: far above the P/D config's threshold, so it is disaggregated
        body = {"model": "sim-model", "max_tokens": 24,
                "messages": [{"role": "user", "content": "long document " + "word " * 3200}]}
        answer = httpx.post(f"{stack.router_url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert usage["completion_tokens"] == 24 and usage["prompt_tokens"] > 3000
        assert _counter(prefill[0], "vllm:request_success") == 1
        assert _counter(prefill[0], "vllm:generation_tokens") <= 1
        assert _counter(prefill[0], "vllm:prompt_tokens") >= usage["prompt_tokens"]
        assert sum(_counter(u, "vllm:generation_tokens") for u in decode) == 24
