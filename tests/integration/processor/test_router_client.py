"""The router client port (``async_processor.router_client``): the aiohttp implementation against a
real local HTTP server, and the httpx one over ``httpx.MockTransport``, give the same answers."""

from __future__ import annotations

import asyncio
import gzip

import httpx
import pytest
from aiohttp import web

from async_processor.router_client import AiohttpRouterClient, Answer, NoAnswer
from async_processor.testing import mock_target
from backfill.up import free_port


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _app(seen: list, release: asyncio.Event) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        seen.append((dict(request.headers), await request.read()))
        return web.Response(status=429, body=b'{"busy":true}', headers={"Retry-After": "3"})

    async def zipped(request: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(b"plain"), headers={"Content-Encoding": "gzip"})

    async def moved(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": "/elsewhere"})

    async def slow(request: web.Request) -> web.Response:
        await release.wait()  # answers only after the client gave up
        return web.Response()

    app = web.Application()
    app.add_routes([web.post("/echo", echo), web.get("/zipped", zipped), web.post("/moved", moved),
                    web.post("/slow", slow)])
    return app


def test_aiohttp_client_answers_errors_and_no_answer():
    async def main():
        seen: list = []
        release = asyncio.Event()
        runner, base = await _serve(_app(seen, release))
        client = AiohttpRouterClient(limit=4)
        try:
            answer = await client.post(base + "/echo", b'{"x":1}', {"content-type": "application/json",
                                                                   "x-llm-d-inference-objective": "batch"}, 5.0)
            assert answer == Answer(429, b'{"busy":true}', "3")
            headers, body = seen[0]
            assert body == b'{"x":1}' and headers["x-llm-d-inference-objective"] == "batch"
            assert headers["Content-Type"] == "application/json"
            assert (await client.get(base + "/zipped", 5.0)).body == b"plain"
            assert (await client.post(base + "/moved", b"", {}, 5.0)).status == 307  # not followed
            with pytest.raises(NoAnswer, match="Timeout"):
                await client.post(base + "/slow", b"", {}, 0.2)
        finally:
            release.set()
            await client.aclose()
            await runner.cleanup()
        refused = AiohttpRouterClient()
        with pytest.raises(NoAnswer, match="ClientConnectorError"):
            await refused.post(f"http://127.0.0.1:{free_port()}/v1/chat/completions", b"{}", {}, 5.0)
        await refused.aclose()
    asyncio.run(main())


def test_httpx_client_over_mock_transport():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/down":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(503, content=request.content, headers={"retry-after": "1"})

    async def main():
        client = mock_target(handler)
        assert await client.post("http://router/x", b"abc", {}, 1.0) == Answer(503, b"abc", "1")
        with pytest.raises(NoAnswer, match="ConnectError: refused"):
            await client.get("http://router/down", 1.0)
        await client.aclose()
    asyncio.run(main())
