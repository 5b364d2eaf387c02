"""The plugin in a real ``vllm`` OpenAI server (engine core in its own process): the rules act and
their counters, and the engine's size, are on ``/metrics``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    ASYNC,
    BACKGROUND_SHARE,
    BATCH,
    BLOCK_SIZE,
    INTERACTIVE,
    MAX_BATCHED_TOKENS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    NUM_BLOCKS,
    SCHEDULER,
    prompt,
)
from prometheus_client.parser import text_string_to_metric_families


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


PORT = _free_port()
BASE = f"http://127.0.0.1:{PORT}"


def _get(path: str) -> str:
    with urllib.request.urlopen(BASE + path, timeout=10) as resp:
        return resp.read().decode()


def _complete(ids: list[int], priority: int, max_tokens: int) -> dict[str, Any]:
    body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "priority": priority,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(BASE + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _stream(ids: list[int], priority: int, max_tokens: int, started: threading.Event) -> int:
    """A streamed completion: sets ``started`` at its first chunk; returns its usage's
    ``completion_tokens`` (the last chunk's, ``stream_options.include_usage``)."""
    body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": max_tokens, "priority": priority,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(BASE + "/v1/completions", body, {"content-type": "application/json"})
    tokens = -1
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                started.set()
                usage = json.loads(line[len(b"data: "):]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on /metrics: (name, sorted labels) → value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(_get("/metrics")) for s in fam.samples}


def _value(name: str, **labels: str) -> float:
    want = tuple(sorted({"engine": "0", **labels}.items()))
    return _samples()[(name, want)]


def _wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    log = tmp_path_factory.mktemp("server") / "vllm.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(BACKFILL_BACKGROUND_PRIORITY_THRESHOLD=str(ASYNC),
               BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS=str(BACKGROUND_SHARE))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(PORT), "--dtype", "float32",
           "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--skip-tokenizer-init",
           "--enable-prompt-tokens-details", "--scheduler-cls", SCHEDULER, "--scheduling-policy", "priority",
           "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
           "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_for(lambda: proc.poll() is not None or _get("/health") == "", 300, "vLLM to answer /health")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield log
    finally:
        proc.send_signal(signal.SIGTERM)  # vLLM stops its engine-core process with it
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_engine_config_info_states_what_the_engine_holds(server: Path) -> None:
    value = _value("backfill:engine_config_info", max_num_seqs=str(MAX_NUM_SEQS), num_gpu_blocks=str(NUM_BLOCKS),
                   block_size=str(BLOCK_SIZE))
    assert value == 1
    cache_info = [labels for (name, labels) in _samples() if name == "vllm:cache_config_info"]
    assert cache_info and all("max_num_seqs" not in dict(labels) for labels in cache_info)  # why ours exists


def test_deferred_background_prefill_is_counted(server: Path) -> None:
    before = _value("backfill:deferred_background_prefill_tokens_total")
    _complete(prompt(900, 300), BATCH, 1)
    _wait_for(lambda: _value("backfill:deferred_background_prefill_tokens_total") > before, 30, "the counter")


def test_preemption_of_background_for_interactive_is_counted(server: Path) -> None:
    before = _value("backfill:preemptions_total", **{"class": "background"})
    fg_before = _value("backfill:preemptions_total", **{"class": "foreground"})
    # Three streamed batch requests fill the three slots; the interactive one is sent once each has
    # its first token (all three running then, whatever the machine's speed: 300 tokens each to go,
    # and 3 × 340 tokens fit the 39 blocks, so only the interactive request can preempt them).
    results: list[int] = []
    started = [threading.Event() for _ in range(MAX_NUM_SEQS)]
    threads = [threading.Thread(target=lambda i=i: results.append(_stream(prompt(910 + i, 40), BATCH, 300,
                                                                          started[i])))
               for i in range(MAX_NUM_SEQS)]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(120), "a batch request never started"
    assert not results, "a batch request ended before the interactive one was sent"
    interactive = _complete(prompt(920, 40), INTERACTIVE, 2)
    assert interactive["usage"]["completion_tokens"] == 2
    for t in threads:
        t.join(180)
    assert results == [300] * MAX_NUM_SEQS  # the preempted one ran again and finished
    _wait_for(lambda: _value("backfill:preemptions_total", **{"class": "background"}) >= before + 1, 30,
              "a background preemption on /metrics")
    assert _value("backfill:preemptions_total", **{"class": "foreground"}) == fg_before


def test_batch_sweep_evicts_background_blocks_and_keeps_the_interactive_prefix(server: Path) -> None:
    bg_before = _value("backfill:evictions_total", **{"class": "background"})
    fg_before = _value("backfill:evictions_total", **{"class": "foreground"})
    shared = prompt(930, 256)
    _complete(shared, INTERACTIVE, 1)
    for i in range(4):
        _complete(prompt(940 + i, 320), BATCH, 1)
    again = _complete(shared, INTERACTIVE, 1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 224
    _wait_for(lambda: _value("backfill:evictions_total", **{"class": "background"}) > bg_before, 30,
              "background evictions on /metrics")
    assert _value("backfill:evictions_total", **{"class": "foreground"}) == fg_before
