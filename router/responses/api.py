"""The router's Responses API routes: :class:`ResponsesAPI`.

==========================================  =======================================================
``POST /v1/responses``                      through the proxy with a :class:`~router.responses.turn.
                                            ResponsesTurn` (input rebuilt from
                                            ``previous_response_id``, answer stored when ``store``)
``GET /v1/responses/{id}``                  the stored response object; 404 when unknown
``DELETE /v1/responses/{id}``               ``{"id", "object": "response.deleted", "deleted": true}``
``GET /v1/responses/{id}/input_items``      the input items the model saw, a list page: ``limit``
                                            (1-100, default 20), ``order`` (``asc`` | ``desc``,
                                            default ``desc``), ``after`` (an item id)
==========================================  =======================================================

The tenant of a ``GET`` / ``DELETE`` is decided as for inference (:mod:`router.trust`): a trusted
caller's fairness id header, else the API key's tenant, else ``anonymous``; another tenant's id
is a 404 like an unknown one. Without a store (no ``--state-redis-url``) every id is unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from common.contracts.errors import ErrorType, error_json
from common.contracts.responses import deleted_object, input_items_page, not_found_json
from router.parsing import FAIRNESS_ID_HEADER, LEGACY_FAIRNESS_ID_HEADER, RESPONSES_PATH
from router.proxy import Proxy
from router.responses.store import RedisResponseStore, ResponseStore, StoreUnavailable
from router.responses.turn import NO_STORE_HINT, ResponsesTurn
from router.trust import ANONYMOUS_TENANT, HeaderTrust

#: ``limit`` of ``input_items``: OpenAI's bounds and default.
MIN_LIMIT, MAX_LIMIT, DEFAULT_LIMIT = 1, 100, 20


def tenant_of(trust: HeaderTrust, headers: Any) -> str:
    """The tenant of a request without a body (the same decision :class:`router.proxy.Proxy`
    makes for inference)."""
    fairness = (headers.get(FAIRNESS_ID_HEADER) or headers.get(LEGACY_FAIRNESS_ID_HEADER) or "").strip() or None
    return trust.identify(headers, None, fairness).fairness_id or ANONYMOUS_TENANT


def listed_items(response_id: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as ``input_items`` lists them: each with an ``id`` (its own, else
    ``msg_<response hex>_<position>``), string message content as one ``input_text`` part
    (``output_text`` for an assistant message)."""
    listed = []
    stem = response_id.removeprefix("resp_")
    for i, item in enumerate(items):
        item = dict(item)
        item.setdefault("type", "message")
        if item["type"] == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        item.setdefault("id", f"msg_{stem}_{i}")
        listed.append(item)
    return listed


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def _error(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json")


def _bad(message: str, param: str) -> web.Response:
    return _error(400, error_json(message, ErrorType.INVALID_REQUEST, param, "invalid_value"))


def _unavailable(exc: StoreUnavailable) -> web.Response:
    return _error(503, error_json(f"the router's response store is unavailable: {exc}", ErrorType.SERVER,
                                  None, "state_store_unavailable"))


class ResponsesAPI:
    """The Responses routes and their store; the app's lifespan calls :meth:`open` and
    :meth:`aclose` and sets ``proxy`` once it exists.

    Args:
        proxy: returns the router's proxy (inference path, trust decision).
    """

    def __init__(self, proxy: Callable[[], Proxy]) -> None:
        self._proxy = proxy
        self.store: ResponseStore | None = None

    def open(self, redis_url: str | None, ttl_s: int) -> None:
        """Connect the store (lazily: the first request connects) when ``redis_url`` is set."""
        if redis_url:
            self.store = RedisResponseStore(redis_url, ttl_s)

    async def check(self) -> str | None:
        """Why the state Redis cannot be used now (its ``PING`` failed), or None: the router logs it
        at start, so an unreachable store shows before the first chained request fails with 503."""
        if isinstance(self.store, RedisResponseStore):
            try:
                await self.store.ping()
            except StoreUnavailable as exc:
                return str(exc)
        return None

    async def aclose(self) -> None:
        """Close the store."""
        if self.store is not None:
            await self.store.aclose()
            self.store = None

    def add_routes(self, router: web.UrlDispatcher) -> None:
        """Register the four routes."""
        router.add_post(RESPONSES_PATH, self.create)
        router.add_get(RESPONSES_PATH + "/{response_id}", self.retrieve)
        router.add_delete(RESPONSES_PATH + "/{response_id}", self.delete)
        router.add_get(RESPONSES_PATH + "/{response_id}/input_items", self.input_items)

    async def create(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses``."""
        return await self._proxy().handle(request, ResponsesTurn(self.store))

    async def retrieve(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}``: 400 for ``stream=true`` (replaying a stream is not supported)."""
        if request.query.get("stream", "false").lower() not in ("false", "0", ""):
            return _bad("Invalid value for 'stream': replaying a stored response as a stream is not supported.",
                        "stream")
        found = await self._find(request)
        if isinstance(found, web.Response):
            return found
        return _json(found.response)

    async def delete(self, request: web.Request) -> web.Response:
        """``DELETE /v1/responses/{id}``."""
        response_id = request.match_info["response_id"]
        if self.store is None:
            return _error(404, not_found_json(response_id, NO_STORE_HINT))
        try:
            deleted = await self.store.delete(tenant_of(self._proxy().trust, request.headers), response_id)
        except StoreUnavailable as exc:
            return _unavailable(exc)
        if not deleted:
            return _error(404, not_found_json(response_id))
        return _json(deleted_object(response_id))

    async def input_items(self, request: web.Request) -> web.Response:
        """``GET /v1/responses/{id}/input_items``."""
        query = request.query
        try:
            limit = int(query.get("limit", DEFAULT_LIMIT))
        except ValueError:
            limit = 0
        if not MIN_LIMIT <= limit <= MAX_LIMIT:
            return _bad(f"Invalid value for 'limit': expected an integer from {MIN_LIMIT} to {MAX_LIMIT}, but got "
                        f"{query.get('limit')!r}.", "limit")
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            return _bad(f"Invalid value for 'order': expected 'asc' or 'desc', but got {order!r}.", "order")
        found = await self._find(request)
        if isinstance(found, web.Response):
            return found
        items = listed_items(request.match_info["response_id"], found.input)
        if order == "desc":
            items.reverse()
        after = query.get("after")
        if after:
            ids = [item["id"] for item in items]
            if after not in ids:
                return _bad(f"Invalid value for 'after': no input item with id {after!r}.", "after")
            items = items[ids.index(after) + 1:]
        return _json(input_items_page(items[:limit], len(items) > limit))

    async def _find(self, request: web.Request) -> Any:
        """The tenant's record of the path's id, or the error response to answer."""
        response_id = request.match_info["response_id"]
        if self.store is None:
            return _error(404, not_found_json(response_id, NO_STORE_HINT))
        try:
            record = await self.store.get(tenant_of(self._proxy().trust, request.headers), response_id)
        except StoreUnavailable as exc:
            return _unavailable(exc)
        if record is None:
            return _error(404, not_found_json(response_id))
        return record
