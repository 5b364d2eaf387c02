"""Prefill/decode disaggregation as vLLM's NixlConnector does it, between engine twins: the
``kv_transfer_params`` handshake and the side channel that carries NIXL's metadata and notifications.

Request flow (vLLM ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/scheduler.py`` and the toy
proxy ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``):

1. The proxy sends the **prefill engine** the request with ``max_tokens: 1``, ``stream: false`` and
   ``"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id":
   null, "remote_block_ids": null, "remote_host": null, "remote_port": null}``. The engine prefills,
   samples one token and, the request being length-capped, keeps its blocks held
   (:attr:`EngineCore.held`) and answers with the top-level ``kv_transfer_params`` of
   :func:`prefill_params`. A request that ends otherwise (``stop``, abort) frees its blocks at once
   and answers ``kv_transfer_params: null``, as vLLM. Streamed (``stream: true``), vLLM puts no
   ``kv_transfer_params`` in the chunks; the blocks stay held until the timeout, as there.
2. The proxy sends the **decode engine** the original request plus that dict. The engine allocates
   the prompt's blocks, waits in ``WAITING_FOR_REMOTE_KVS`` for the modeled read
   (:class:`~engine_twin.core.KVLoad`), then decodes from the loaded blocks; its ``usage`` counts
   the whole prompt, ``cached_tokens`` being every prompt token but the last (vLLM's decode side).
3. The read ends with NIXL's notification ``"<remote_request_id>:<tp_size>"`` to the prefill engine,
   which frees the held blocks; unread blocks are freed after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``
   (480 s).

The side channel: vLLM serves NIXL agent metadata on a ZMQ socket at
``VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT`` (``remote_host`` / ``remote_port``) and
moves notifications over NIXL itself. The twin serves both as a small HTTP/1.1 endpoint on that
same host and port (:class:`SideChannel`, an aiohttp server): ``GET /nixl/meta`` (the
handshake: engine id, block size, KV bytes per token) and ``POST /nixl/notif`` with body
``{"notif_msg": "<remote_request_id>:<tp_size>"}``. The decode twin calls the first before the read
and the second when the read ends (a READ carries its notification in NIXL); 5 s timeouts, vLLM's
handshake receive timeout. An unreachable prefill engine, or one whose engine id or KV layout does
not match, is a failed load (``kv_load_failure_policy``).

Bad ``kv_transfer_params`` (``do_remote_prefill`` without ``remote_block_ids``, ``remote_engine_id``,
``remote_request_id``, ``remote_host`` or ``remote_port``): vLLM logs "Got invalid KVTransferParams
… This request will not utilize KVTransfer"; the twin logs the same and computes the prompt locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from engine_twin.errors import BadRequestError

logger = logging.getLogger(__name__)

META_PATH = "/nixl/meta"
NOTIF_PATH = "/nixl/notif"
SIDE_CHANNEL_TIMEOUT_S = 5.0
"""Seconds a decode twin waits for the prefill twin's side channel: vLLM's NIXL handshake sets the
ZMQ receive timeout to 5,000 ms (``_nixl_handshake``)."""
REQUIRED_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
"""Fields NixlConnector needs besides ``remote_block_ids`` to read a prefill engine's blocks."""


def kv_transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body's ``kv_transfer_params`` (vLLM's request field): an object or null; raises
    BadRequestError otherwise."""
    value = body.get("kv_transfer_params")
    if value is not None and not isinstance(value, dict):
        raise BadRequestError("kv_transfer_params: Input should be a valid dictionary", "kv_transfer_params")
    return value


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode-side request's KV lives: the prefill engine and its request."""

    engine_id: str
    request_id: str
    host: str
    port: int
    num_blocks: int
    tp_size: int = 1

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def notif_msg(self) -> str:
        """NIXL's notification: ``"<remote_request_id>:<tp_size of the reader>"`` (the twin is TP 1)."""
        return f"{self.request_id}:1"


def _flat_block_ids(value: Any) -> list[int] | None:
    """``remote_block_ids`` as one list: vLLM sends one list per KV cache group (``[[0, 1, 2]]``);
    older versions sent a flat list. None when it is neither."""
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(b, int) and not isinstance(b, bool) for b in value):
        return value
    if all(isinstance(g, list) for g in value) and all(isinstance(b, int) for b in value[0]):
        return value[0]
    return None


def remote_prefill_of(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The prefill engine a decode request reads from, or None when it computes its prompt locally
    (no ``do_remote_prefill``, or bad params: logged as vLLM logs them, never an error)."""
    if not params or not params.get("do_remote_prefill"):
        return None
    blocks = _flat_block_ids(params.get("remote_block_ids"))
    port = params.get("remote_port")
    ok = (blocks and all(params.get(k) is not None for k in REQUIRED_REMOTE_FIELDS)
          and isinstance(params.get("remote_host"), str) and isinstance(port, int) and 0 < port < 65536)
    if not ok or blocks is None or not isinstance(port, int):
        logger.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", params)
        return None
    tp = params.get("tp_size", 1)
    return RemotePrefill(str(params["remote_engine_id"]), str(params["remote_request_id"]), params["remote_host"],
                         port, len(blocks), tp if isinstance(tp, int) else 1)


def prefill_params(engine_id: str, request_id: str, block_ids: list[int], host: str, port: int,
                   tp_size: int = 1) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill engine answers with (NixlConnector's ``request_finished``):
    ``do_remote_prefill`` true, ``do_remote_decode`` false, ``remote_block_ids`` (one list per KV
    cache group: one for a full-attention model), ``remote_engine_id``, ``remote_request_id``,
    ``remote_host``, ``remote_port``, ``tp_size``."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(block_ids)],
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
            "remote_port": port, "tp_size": tp_size}


class SideChannel:
    """The prefill twin's side channel (module docstring): a small aiohttp server.

    ``meta()`` gives the handshake's JSON; ``notify(request_id)`` frees the held blocks and returns
    whether they were held. Bad requests get 400/404/405 with a JSON ``error``; bodies over
    :data:`MAX_BODY_BYTES` get 413."""

    def __init__(self, meta: Callable[[], dict[str, Any]], notify: Callable[[str], bool]):
        self._meta = meta
        self._notify = notify
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen on ``host:port``; raises RuntimeError when the port cannot be bound."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
        app.router.add_get(META_PATH, self._get_meta)
        app.router.add_post(NOTIF_PATH, self._post_notif)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise RuntimeError(f"the NIXL side channel cannot listen on {host}:{port} ({exc}); set "
                               "VLLM_NIXL_SIDE_CHANNEL_PORT to a free port") from exc
        self._runner = runner

    async def aclose(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(runner.cleanup(), 1.0)

    def notified(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """Status and JSON answer of one notification (body ``{"notif_msg": "<request id>:<tp>"}``)."""
        try:
            msg = orjson.loads(body).get("notif_msg")
            request_id, _tp = msg.rsplit(":", 1)
        except (orjson.JSONDecodeError, AttributeError, ValueError):
            return 400, {"error": 'body must be {"notif_msg": "<remote_request_id>:<tp_size>"}'}
        released = self._notify(request_id)
        if not released:
            logger.error("Potentially invalid KV blocks for unrecognized request %s were retrieved by a "
                         "decode worker. They may have expired.", request_id)
        return 200, {"released": released}

    async def _get_meta(self, request: web.Request) -> web.Response:
        return web.json_response(self._meta(), dumps=_dumps)

    async def _post_notif(self, request: web.Request) -> web.Response:
        status, answer = self.notified(await request.read())
        return web.json_response(answer, status=status, dumps=_dumps)


MAX_BODY_BYTES = 64 * 1024
"""Largest side-channel request body (bytes): a notification is a few dozen."""


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
    """aiohttp's own 404/405/413 answers as JSON ``{"error": …}``, like the routes' own errors."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response({"error": exc.reason}, status=exc.status)
