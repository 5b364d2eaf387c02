"""An ``httpx`` transport that sends through an ``aiohttp`` connection pool.

The processor talks to the router through ``httpx.AsyncClient``; httpx's own pool (httpcore) slows
down as connections grow (on a 2-core box: ~2,000 req/s at 4 connections, ~330 at 128), while
aiohttp's pool holds ~16,000 req/s at 128 (``backfill bench processor`` shows both). This transport
keeps the httpx API — requests, responses, ``MockTransport`` in tests — and swaps only the wire.

Body decoding is left to httpx (aiohttp's auto-decompression is off). Timeouts come from the httpx
request's ``timeout`` extension (seconds); aiohttp errors become the matching httpx exceptions
(``ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``).
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

_SKIP = {b"host", b"content-length", b"transfer-encoding", b"connection"}


class AiohttpTransport(httpx.AsyncBaseTransport):
    """``limit``: connections at most (aiohttp ``TCPConnector(limit=...)``). The session is made on
    first use, in the running loop, and closed by ``aclose()`` (the owning client's ``aclose``)."""

    def __init__(self, limit: int = 100):
        self.limit = limit
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.limit),
                                                  auto_decompress=False, skip_auto_headers=("User-Agent",))
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` (its body must be bytes, not a stream) and read the whole answer."""
        t = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(total=None, connect=t.get("connect"), sock_read=t.get("read"))
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw
                   if k.lower() not in _SKIP]
        body = await request.aread()
        try:
            async with self._get_session().request(request.method, str(request.url), data=body or None,
                                                   headers=headers, timeout=timeout,
                                                   allow_redirects=False) as resp:
                content = await resp.read()
                return httpx.Response(resp.status, headers=list(resp.raw_headers), content=content,
                                      request=request)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise httpx.ReadTimeout(str(exc) or "timed out", request=request) from exc
        except aiohttp.ClientConnectionError as exc:
            if isinstance(exc, aiohttp.ClientConnectorError):
                raise httpx.ConnectError(str(exc), request=request) from exc
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc

    async def aclose(self) -> None:
        """Close the aiohttp session."""
        if self._session is not None:
            await self._session.close()
            self._session = None
