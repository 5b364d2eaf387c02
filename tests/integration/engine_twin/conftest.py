"""A simulated engine on a free 127.0.0.1 port: uvicorn in a thread, the real app and lifespan.

``RunningSim.errors`` holds the ERROR records uvicorn logged from that server's thread (for example
"Exception in ASGI application"), so tests can assert a disconnect was handled cleanly.

Streaming tests must keep the line iterator of an open httpx stream referenced: a dropped, partly
read ``iter_lines()`` / ``aiter_lines()`` is finalized at once and httpcore then closes the
connection, which is a real client disconnect (the engine aborts the request). At time scale 0 it
goes unnoticed, because the whole stream is written before the client can close."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import uvicorn

from engine_twin.server import create_app
from engine_twin.settings import build_settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ThreadErrors(logging.Handler):
    """ERROR records logged by one thread."""

    def __init__(self, thread: threading.Thread):
        super().__init__(logging.ERROR)
        self.thread = thread
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread.ident:
            self.records.append(record)


class RunningSim:
    def __init__(self, http: str = "auto", **overrides):
        self.port = free_port()
        self.settings = build_settings(**{"host": "127.0.0.1", "port": self.port, "time_scale": 0.0,
                                          "hash_seed": "0", "enable_prompt_tokens_details": True, **overrides})
        self.app = create_app(self.settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                http=http, log_config=None)  # no dictConfig: it drops handlers of earlier sims
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self._errors = _ThreadErrors(self.thread)

    def start(self) -> RunningSim:
        logging.getLogger("uvicorn.error").addHandler(self._errors)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("simulator did not start")
            time.sleep(0.01)
        return self

    @property
    def errors(self) -> list[str]:
        """Messages (with exception text) of the ERROR records this server logged."""
        return [f"{r.getMessage()} {r.exc_info[1]!r}" if r.exc_info else r.getMessage() for r in self._errors.records]

    def state(self) -> dict:
        return httpx.get(f"{self.url}/sim/state").json()

    @property
    def engine(self):
        return self.app.state.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        logging.getLogger("uvicorn.error").removeHandler(self._errors)


@pytest.fixture
def make_sim() -> Iterator[Callable[..., RunningSim]]:
    sims: list[RunningSim] = []

    def factory(**overrides) -> RunningSim:
        sim = RunningSim(**overrides).start()
        sims.append(sim)
        return sim

    yield factory
    for sim in sims:
        sim.stop()


@pytest.fixture
def sim(make_sim) -> RunningSim:
    return make_sim(served_model_name=["gpt-3.5-turbo", "meta-llama/Meta-Llama-3-8B-Instruct",
                                       "intfloat/e5-mistral-7b-instruct"], block_size=16)
