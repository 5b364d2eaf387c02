"""The Responses API state at the router (``POST/GET/DELETE /v1/responses``): stored responses in a
Redis every replica shares, ``previous_response_id`` rebuilt into the full input so prefix routing
sees the whole conversation. See :mod:`router.responses.api` (routes), :mod:`router.responses.turn`
(one create request), :mod:`router.responses.store` (the store) and
:mod:`common.contracts.responses` (shapes, record layout)."""

from router.responses.api import ResponsesAPI
from router.responses.store import MemoryResponseStore, RedisResponseStore, ResponseStore, StoreUnavailable
from router.responses.turn import ResponsesTurn

__all__ = ["MemoryResponseStore", "RedisResponseStore", "ResponseStore", "ResponsesAPI", "ResponsesTurn",
           "StoreUnavailable"]
