"""What the fleet serves today: the router's ``GET /v1/models``, asked with a short timeout and
remembered briefly (:class:`FleetModels`).

Validation reads it to fail a batch whose model no engine serves (``model_not_found``) instead of
running every line to a 404. When the fleet cannot be asked (no router configured, router down,
timeout, an answer that is not OpenAI's model list, or an empty list: no healthy engine right now)
the answer is "unknown" and the batch runs; its lines then end with the engines' own 404s.

The router answers OpenAI's list shape (``router/app.py``)::

    GET {router_url}/v1/models  ->  200 {"object": "list", "data": [{"id": "m", "object": "model", …}, …]}
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx
import orjson

log = logging.getLogger(__name__)


class FleetModels:
    """The model ids the fleet serves, from ``{router_url}/v1/models``.

    ``timeout_seconds``: the whole request (connect and answer); ``cache_seconds``: how long one
    answer — a list, or "unknown" after a failure — is reused (so a burst of batch creations asks
    once, and a router that is down costs at most one timeout per period). ``clock`` is monotonic
    seconds; ``transport`` replaces the network (``httpx.MockTransport`` in tests). Not shared across
    processes (the worker context builds one per process).
    """

    def __init__(self, router_url: str | None, *, timeout_seconds: float, cache_seconds: float,
                 clock: Callable[[], float] = time.monotonic, transport: httpx.BaseTransport | None = None) -> None:
        self.url = router_url.rstrip("/") + "/v1/models" if router_url else None
        self.timeout_seconds = timeout_seconds
        self.cache_seconds = cache_seconds
        self.clock = clock
        self.transport = transport
        self._client: httpx.Client | None = None
        self._cached: tuple[float, frozenset[str] | None] | None = None

    def served(self) -> frozenset[str] | None:
        """The served model ids, or None when they cannot be known now (see the module docstring).
        Never raises."""
        if self.url is None:
            return None
        now = self.clock()
        if self._cached is not None and now < self._cached[0]:
            return self._cached[1]
        models = self._ask(self.url)
        self._cached = (now + self.cache_seconds, models)
        return models

    def _ask(self, url: str) -> frozenset[str] | None:
        if self._client is None:
            self._client = httpx.Client(timeout=self.timeout_seconds, follow_redirects=False,
                                        transport=self.transport)
        try:
            response = self._client.get(url)
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}")
            data = orjson.loads(response.content).get("data")
            if not isinstance(data, list):
                raise ValueError("no 'data' list")
            models = frozenset(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
        except (httpx.HTTPError, ValueError, AttributeError) as exc:  # orjson's error is a ValueError
            log.warning("fleet models unknown", extra={"action": "fleet_models_unknown", "url": url,
                                                       "error": str(exc) or type(exc).__name__})
            return None
        if not models:
            log.warning("fleet serves no model now", extra={"action": "fleet_models_unknown", "url": url,
                                                              "error": "empty model list"})
            return None
        return models

    def close(self) -> None:
        """Close the HTTP client (a later :meth:`served` opens another)."""
        if self._client is not None:
            self._client.close()
            self._client = None
