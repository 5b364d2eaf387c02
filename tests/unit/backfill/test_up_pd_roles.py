"""``backfill up --engines K --prefill-engines N --decode-engines M``: the K engines that do both
run vLLM's NixlConnector too (``kv_both``), since the router may pick them for either leg of a
disaggregated request; without P/D counts they run without it. No process is started: the
children are recorded."""

from __future__ import annotations

import json

import pytest

import backfill.up as up
import engine_twin.launch
from backfill.up import Stack, start_engines, start_router


def _kv_config(argv: list[str]) -> dict | None:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1]) if "--kv-transfer-config" in argv else None


@pytest.fixture
def stack(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Stack:
    monkeypatch.setattr(up, "_spawn", lambda argv, env, logs, name: object())
    monkeypatch.setattr(engine_twin.launch, "wait_ready", lambda url, timeout, process: None)
    monkeypatch.setattr(up, "_wait_ready", lambda url, stack, owner: None)
    return Stack(gateway_url="http://127.0.0.1:1/v1", api_key="k", data_dir=tmp_path)


def test_the_engines_doing_both_in_a_pd_fleet_run_the_nixl_connector(stack: Stack) -> None:
    start_engines(stack, 1, ["sim-model"], [], prefill=1, decode=1)
    roles = {name: _kv_config(argv)["kv_role"] for name, argv in stack.argv.items()}
    assert roles == {"engine-0": "kv_both", "prefill-0": "kv_producer", "decode-0": "kv_consumer"}
    assert set(stack.child_env) == {"engine-0", "prefill-0", "decode-0"}  # each its own NIXL side channel
    both, prefill, decode = stack.engine_urls
    assert stack.engine_roles == {both: "both", prefill: "prefill", decode: "decode"}
    start_router(stack, "127.0.0.1", simulated=True)
    argv = stack.argv["router"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--engine"] == [both]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--prefill-engine"] == [prefill]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--decode-engine"] == [decode]


def test_without_pd_counts_the_engines_run_no_connector(stack: Stack) -> None:
    start_engines(stack, 2, ["sim-model"], [])
    assert [_kv_config(argv) for argv in stack.argv.values()] == [None, None]
    assert stack.engine_roles == {} and stack.child_env == {}
    start_router(stack, "127.0.0.1", simulated=True)
    argv = stack.argv["router"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--engine"] == stack.engine_urls
    assert "--prefill-engine" not in argv
