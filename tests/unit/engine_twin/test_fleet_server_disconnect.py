"""Client disconnects driven through the real app as an ASGI callable (lifespan included), so the
server's ASGI spec version and the moment the client leaves are chosen exactly, with no sockets."""

import asyncio
import json

import pytest

from engine_twin.server import create_app
from engine_twin.settings import build_settings


def scope(path: str, spec_version: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


class Client:
    """The ASGI side of one HTTP client. It leaves after ``leave_after`` body chunks (0: right after its
    request; None: stays). Once gone, ``receive`` answers ``http.disconnect``; ``send`` raises
    ``OSError`` under ASGI spec 2.4 and drops the message before (as uvicorn does)."""

    def __init__(self, body: dict, leave_after: int | None, spec_version: str):
        self.raises = spec_version >= "2.4"
        self.pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
        self.leave_after = leave_after
        self.gone = asyncio.Event()
        self.messages: list[dict] = []

    async def receive(self) -> dict:
        if self.pending:
            return self.pending.pop(0)
        if self.leave_after == 0:  # leaves as soon as its request is sent
            self.gone.set()
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.gone.is_set():
            if self.raises:
                raise OSError("client went away")
            return
        self.messages.append(message)
        chunks = [m for m in self.messages if m["type"] == "http.response.body" and m.get("body")]
        if self.leave_after is not None and len(chunks) >= self.leave_after:
            self.gone.set()


def aborted(engine) -> float:
    """``vllm:request_success_total{finished_reason="abort"}`` of ``engine``."""
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.split()[-1])
    return 0.0


def run(path: str, body: dict, spec_version: str, leave_after: int | None = None,
        receive_error: Exception | None = None):
    """Serve one request on a fresh app at time scale 1; returns (client, engine) after the app returned."""

    async def main():
        app = create_app(build_settings(time_scale=1.0, step_overhead_ms=0.0, hash_seed="0"))
        async with app.router.lifespan_context(app):
            client = Client({"model": app.state.engine.settings.model, **body}, leave_after, spec_version)
            receive = client.receive
            if receive_error is not None:
                async def receive():
                    if client.pending:
                        return client.pending.pop(0)
                    raise receive_error
            await app(scope(path, spec_version), receive, client.send)
            return client, app.state.engine

    return asyncio.run(main())


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_stream_closed_after_first_chunk_aborts_at_once_without_error(spec_version):
    body = {"prompt": "x " * 40, "max_tokens": 5000, "stream": True}
    client, engine = run("/v1/completions", body, spec_version, leave_after=1)
    # the app returned normally and the engine has already aborted the request and freed its blocks
    assert engine.core.num_running == 0 and engine.cache.usage == 0.0
    assert aborted(engine) == 1.0
    assert sum(1 for m in client.messages if m.get("body")) == 1


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_stream_of_a_client_that_stays_runs_to_done(spec_version):
    client, engine = run("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 6, "stream": True}, spec_version)
    body = b"".join(m.get("body", b"") for m in client.messages if m["type"] == "http.response.body")
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b'"content":') == 7  # role chunk + 6 tokens
    assert engine.core.num_running == 0


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_non_streamed_request_whose_client_leaves_is_aborted_without_error(spec_version):
    client, engine = run("/v1/completions", {"prompt": "x", "max_tokens": 5000}, spec_version, leave_after=0)
    assert engine.core.num_running == 0 and engine.cache.usage == 0.0
    assert aborted(engine) == 1.0
    assert client.messages == []  # the 499 went nowhere; run() returning shows nothing was raised


def test_a_failing_disconnect_watch_does_not_abort_the_request():
    client, engine = run("/v1/completions", {"prompt": "x", "max_tokens": 3}, "2.3",
                         receive_error=RuntimeError("broken receive channel"))
    start = [m for m in client.messages if m["type"] == "http.response.start"]
    assert start[0]["status"] == 200
    body = json.loads(b"".join(m.get("body", b"") for m in client.messages if m["type"] == "http.response.body"))
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 3
