"""``backfill router --prefill-engine … --decode-engine …`` in front of two real engine twins in
their roles (vLLM's NixlConnector flow between them, ``engine_twin``), driven with the real
``openai`` client: every request answers in full; a long prompt is computed by the prefill twin,
which generates one token for it, its KV read by the decode twin (a NIXL transfer), which
generates the output; a short prompt runs whole on the decode twin."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine_twin.launch import pd_engine_env, sim_engine_argv, wait_ready
from router.cli import router_argv
from tests.integration.engine_twin.conftest import free_port

MODEL = "sim-model"


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


class TwinFleet:
    """A prefill twin, a decode twin and the router, as processes."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []
        self.prefill = f"http://127.0.0.1:{free_port()}"
        self.decode = f"http://127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{free_port()}"

    def _spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env or dict(os.environ, PYTHONUNBUFFERED="1"))
        self.procs.append(proc)
        return proc

    def __enter__(self) -> TwinFleet:
        try:
            for role, url in (("prefill", self.prefill), ("decode", self.decode)):
                port = int(url.rsplit(":", 1)[1])
                proc = self._spawn(sim_engine_argv(port, [MODEL], pd_role=role, time_scale=0.0), role,
                                   pd_engine_env(free_port()))
                wait_ready(url, timeout=30, process=proc)
            router = self._spawn(router_argv(int(self.url.rsplit(":", 1)[1]), [], prefill_engines=[self.prefill],
                                             decode_engines=[self.decode]), "router")
            wait_ready(self.url, timeout=30, process=router)
            deadline = time.monotonic() + 15
            while sum(e["healthy"] and e["metrics_age_s"] is not None
                      for e in httpx.get(f"{self.url}/admin/state", timeout=5).json()["endpoints"]) < 2:
                assert time.monotonic() < deadline, "the twins never became candidates"
                time.sleep(0.05)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwinFleet]:
    with TwinFleet(tmp_path_factory.mktemp("pd-twins")) as fleet:
        yield fleet


def test_long_prompts_are_prefilled_by_the_prefill_twin_and_decoded_by_the_decode_twin(twins: TwinFleet) -> None:
    client = openai.OpenAI(base_url=f"{twins.url}/v1", api_key="unused", max_retries=0, timeout=30)
    before = {url: (counter(url, "vllm:generation_tokens_total"), counter(url, "vllm:nixl_xfer_time_seconds_count"))
              for url in (twins.prefill, twins.decode)}
    long_texts = [" ".join(f"doc{n}-word{i}" for i in range(400)) for n in range(3)]
    for n, text in enumerate(long_texts):
        if n % 2:
            answer = client.completions.create(model=MODEL, prompt=text, max_tokens=7)
            assert answer.usage.completion_tokens == 7 and len(answer.choices[0].text) > 0
        else:
            chunks = list(client.chat.completions.create(model=MODEL, max_tokens=7, stream=True,
                                                         stream_options={"include_usage": True},
                                                         messages=[{"role": "user", "content": text}]))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 7
            assert chunks[-1].usage.prompt_tokens > 256
    short = client.completions.create(model=MODEL, prompt="hi there", max_tokens=4)
    assert short.usage.completion_tokens == 4

    generated = {url: counter(url, "vllm:generation_tokens_total") - before[url][0] for url in before}
    transfers = {url: counter(url, "vllm:nixl_xfer_time_seconds_count") - before[url][1] for url in before}
    assert generated[twins.prefill] == 3  # one token per disaggregated request, no more
    assert generated[twins.decode] == 3 * 7 + 4  # every output, the short request's whole
    assert transfers[twins.decode] == 3  # one KV read per disaggregated request
    state = httpx.get(f"{twins.url}/admin/state", timeout=5).json()
    assert state["disaggregation"]["decisions"] == {"disaggregated": 3, "below_threshold": 1}
    assert state["disaggregation"]["fallbacks"] == {}
