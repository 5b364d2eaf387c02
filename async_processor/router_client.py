"""The processor's one way to talk HTTP to the router: the :class:`RouterClient` port.

Two implementations, both thin over a well-kept library:

- :class:`AiohttpRouterClient` (what :func:`make_router_client` builds, what ``backfill processor``
  runs): aiohttp's ``ClientSession`` and pool. On a 2-core box it holds ~5x the requests/s of
  httpx's API at 64 connections (``backfill bench processor`` shows both side by side).
- :class:`HttpxRouterClient`: over any ``httpx.AsyncClient``; tests use it with
  ``httpx.MockTransport`` (:func:`async_processor.testing.mock_target`).

Only what the processor needs crosses the port: POST bytes with headers, a total timeout and an
optional idle timeout (the longest silence while the answer streams in), GET; the answer is status,
body bytes, ``Retry-After`` and ``x-llm-d-request-dropped-reason``. A request that got no HTTP answer (refused, reset, timed out)
raises :class:`NoAnswer`, whose ``timed_out`` tells a timeout after the request was sent (the
router had it) from a failure to connect; any HTTP status, 5xx included, is an :class:`Answer`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import aiohttp
import httpx

from async_processor.errors import ProcessorError
from async_processor.retry import DROPPED_REASON_HEADER


class Answer(NamedTuple):
    """The router's HTTP answer: ``status``, the whole ``body`` (content-encoding decoded), the
    raw ``Retry-After`` header and the ``x-llm-d-request-dropped-reason`` header (None when absent)."""

    status: int
    body: bytes
    retry_after: str | None = None
    dropped_reason: str | None = None


class NoAnswer(ProcessorError):
    """No HTTP answer at all; the message names the cause (``ClientConnectorError: ...``).
    ``timed_out``: a timeout fired after the connection was made (the request reached the router),
    as opposed to a refused, reset or timed-out connection."""

    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class RouterClient(Protocol):
    """The port. Implementations own their pool and close it in :meth:`aclose`."""

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float,
                   idle_s: float | None = None) -> Answer:
        """POST ``body``; ``timeout_s`` bounds the whole attempt (pool wait, connect, send, read),
        ``idle_s`` (when given) each wait for the next bytes of the answer."""
        ...

    async def get(self, url: str, timeout_s: float) -> Answer:
        """GET ``url`` within ``timeout_s``."""
        ...

    async def aclose(self) -> None:
        """Close the pool."""
        ...


def _no_answer(exc: BaseException, timed_out: bool = False) -> NoAnswer:
    return NoAnswer(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, timed_out=timed_out)


def _aiohttp_timed_out(exc: BaseException) -> bool:
    """A timeout once connected: aiohttp's total timeout (a bare ``TimeoutError``) or its read
    timeout; not its connect timeout."""
    return isinstance(exc, TimeoutError) and not isinstance(exc, aiohttp.ConnectionTimeoutError)


class AiohttpRouterClient:
    """:class:`RouterClient` over ``aiohttp.ClientSession``. ``limit``: connections at most. The
    session is made on first use (in the running loop); no cookies are kept, redirects are not
    followed, compressed bodies are decoded."""

    def __init__(self, limit: int = 100):
        self.limit = limit
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.limit),
                                                  cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def _send(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str] | None,
                    timeout_s: float, idle_s: float | None = None) -> Answer:
        try:
            async with self._get_session().request(method, url, data=body, headers=headers,
                                                   timeout=aiohttp.ClientTimeout(total=timeout_s, sock_read=idle_s),
                                                   allow_redirects=False) as resp:
                return Answer(resp.status, await resp.read(), resp.headers.get("Retry-After"),
                              resp.headers.get(DROPPED_REASON_HEADER))
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise _no_answer(exc, _aiohttp_timed_out(exc)) from exc

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float,
                   idle_s: float | None = None) -> Answer:
        return await self._send("POST", url, body, headers, timeout_s, idle_s)

    async def get(self, url: str, timeout_s: float) -> Answer:
        return await self._send("GET", url, None, None, timeout_s)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class HttpxRouterClient:
    """:class:`RouterClient` over ``client`` (an ``httpx.AsyncClient``, closed by :meth:`aclose`)."""

    def __init__(self, client: httpx.AsyncClient):
        self.client = client

    async def _send(self, method: str, url: str, body: bytes | None, headers: Mapping[str, str] | None,
                    timeout_s: float, idle_s: float | None = None) -> Answer:
        timeout = httpx.Timeout(timeout_s, read=idle_s if idle_s is not None else timeout_s)
        try:
            resp = await self.client.request(method, url, content=body, headers=headers, timeout=timeout)
        except httpx.HTTPError as exc:
            raise _no_answer(exc, isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout))) from exc
        return Answer(resp.status_code, resp.content, resp.headers.get("retry-after"),
                      resp.headers.get(DROPPED_REASON_HEADER))

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], timeout_s: float,
                   idle_s: float | None = None) -> Answer:
        return await self._send("POST", url, body, headers, timeout_s, idle_s)

    async def get(self, url: str, timeout_s: float) -> Answer:
        return await self._send("GET", url, None, None, timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()


def make_router_client(concurrency: int) -> AiohttpRouterClient:
    """The production client: aiohttp, ``concurrency`` connections plus one for the saturation
    gate's reads."""
    return AiohttpRouterClient(limit=concurrency + 1)
