"""The official ``openai`` Node SDK (``tests/acceptance/node_sdk``: ``openai`` pinned in its
``package.json`` / ``package-lock.json``) against ``backfill up``, unchanged, as a user writes it:
background responses at the gateway (create → retrieve until it ends → replay the stream, with
``starting_after`` → a stream from create → input items in list form → cancel) and flex calls
(``service_tier: "flex"``, Chat Completions and Responses) at the router. ``background.mjs`` prints
one JSON line per check; each must pass.

Needs ``node`` (20 or later) on PATH; the SDK is installed with ``npm ci`` from the lock file the
first time (the npm registry or its cache must be reachable then)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import backfill_up

MODEL = "gpt-4o-mini"
NODE_DIR = os.path.join(os.path.dirname(__file__), "node_sdk")
CHECKS = {"create answers queued", "retrieve until it ends", "stream the stored events", "stream with starting_after",
          "stream from create", "input as input items", "cancel sticks", "flex chat completion", "flex response"}


@pytest.fixture(scope="module")
def node_sdk() -> str:
    """The folder with the SDK installed (``npm ci`` when ``node_modules`` lacks it)."""
    assert shutil.which("node") and shutil.which("npm"), "node and npm must be on PATH"
    if not os.path.exists(os.path.join(NODE_DIR, "node_modules", "openai", "package.json")):
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, capture_output=True,
                       timeout=300)
    return NODE_DIR


def test_the_node_sdk_runs_background_responses_and_flex_unchanged(node_sdk, tmp_path):
    data = tmp_path / "data"
    with backfill_up(data, "--engines", "1", "--served-model-name", MODEL) as up:
        stack = json.loads((data / "stack.json").read_text())
        env = dict(os.environ, GATEWAY_URL=up.base_url, ROUTER_URL=stack["router_url"] + "/v1",
                   API_KEY=up.api_key, MODEL=MODEL)
        run = subprocess.run(["node", "background.mjs"], cwd=node_sdk, env=env, capture_output=True, text=True,
                             timeout=300)
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in results if not r["ok"]]
    assert not failed and run.returncode == 0, (failed, run.stderr[-2000:])
    assert {r["check"] for r in results} == CHECKS
