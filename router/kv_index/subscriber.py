"""The asyncio consumer of the engines' KV events: ZMQ SUB socket(s) → :class:`KVBlockIndex`.

vLLM's PUB socket connects when its ``--kv-events-config`` endpoint is ``tcp://host:port`` (it binds
only for ``*``, ``::``, ``ipc://``, ``inproc://``), so the router BINDS one SUB socket and every
engine connects to that one address; each engine's topic says who it is. Engines started with a
bound PUB (``tcp://*:port``) can be read instead by connecting to them (``sources``).

Topic → endpoint: our fleet's topic is ``kv@<host>:<port>@<model>`` (``engine_twin.launch``), which
names the endpoint ``http://<host>:<port>`` (the engine's base URL, as the router's pool names
endpoints) and the model seeding the key chain. ``endpoint_for_topic`` overrides this, and names
engines whose topic does not carry their address: ``{topic or topic prefix: endpoint name or
(endpoint name, model)}``. Order: the exact topic, then the longest matching non-empty prefix,
then a ``kv@<host>:<port>@<model>`` topic, then the ``""`` entry as a catch-all (vLLM's default
topic is empty). Without a model in the value, the model comes from a ``kv@…@<model>`` topic, else
``default_model``. Messages whose topic resolves to nothing are dropped and counted
(``unresolved``).

Sequence numbers are tracked per (topic, data-parallel rank): a jump forward counts the missed
batches as ``seq_gaps`` on the index (their removals are lost: the caps bound the leak); a jump
backward means the publisher restarted (an engine restart empties its cache), so the endpoint's
entries are dropped before the batch applies.

Everything runs in the event loop that calls :meth:`KVEventSubscriber.start`: the index is only
touched from that loop, as is the scheduler that reads it, so no lock is needed. A malformed
message counts as a decode error on the index and never stops the consumer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import zmq
import zmq.asyncio

from router.kv_index.events import KVEventDecodeError, decode_message
from router.kv_index.index import KVBlockIndex

log = logging.getLogger(__name__)

#: Receive high-water mark of the SUB sockets, in messages: vLLM's publisher default ``hwm``.
DEFAULT_RCVHWM = 100_000

TopicTarget = str | tuple[str, str]


def parse_fleet_topic(topic: str) -> tuple[str, str] | None:
    """``kv@<host>:<port>@<model>`` → (``http://<host>:<port>``, model); None for other topics.

    IPv6 hosts are accepted in brackets (``kv@[::1]:8000@m``)."""
    if not topic.startswith("kv@"):
        return None
    address, sep, model = topic[3:].partition("@")
    host, colon, port = address.rpartition(":")
    if not (sep and model and colon and host and port.isdigit()):
        return None
    return f"http://{host}:{port}", model


class KVEventSubscriber:
    """Consumes KV events from ZMQ and applies them to ``index``.

    Args:
        index: the index to feed.
        bind: address the SUB socket binds (engines' PUB sockets connect to it), e.g.
            ``tcp://127.0.0.1:5557``; ``tcp://127.0.0.1:*`` picks a free port (see
            :attr:`bound_address`); None for no bound socket.
        endpoint_for_topic: explicit topic (or topic prefix) → endpoint name or (endpoint name,
            model); see the module docstring.
        sources: engines with a bound PUB socket to connect to: ``{pub address: (endpoint name,
            model)}``; one SUB socket each, their topics ignored.
        default_model: model for explicitly mapped topics that name none.
        context: a ``zmq.asyncio.Context`` to use (default: a private one, closed by :meth:`stop`).

    Raises:
        ValueError: neither ``bind`` nor ``sources``.
        zmq.ZMQError: from :meth:`start` when the address cannot be bound.
    """

    def __init__(self, index: KVBlockIndex, bind: str | None = "tcp://127.0.0.1:5557",
                 endpoint_for_topic: Mapping[str, TopicTarget] | None = None, *,
                 sources: Mapping[str, tuple[str, str]] | None = None, default_model: str | None = None,
                 context: zmq.asyncio.Context | None = None) -> None:
        if bind is None and not sources:
            raise ValueError("KVEventSubscriber needs a bind address or sources to connect to")
        self.index = index
        self.bind = bind
        self.sources = dict(sources or {})
        self.default_model = default_model
        self._explicit = dict(endpoint_for_topic or {})
        self._prefixes = sorted((t for t in self._explicit if t), key=len, reverse=True)
        self._resolved: dict[str, tuple[str, str] | None] = {}
        self._own_context = context is None
        self._context = context
        self._sockets: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._last_seq: dict[tuple[str, int | None], int] = {}
        self.bound_address: str | None = None
        self.messages = 0
        self.unresolved = 0
        self.restarts = 0

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Bind / connect the sockets and start consuming; call from the running event loop.

        Raises:
            RuntimeError: already started, or no running loop.
            zmq.ZMQError: the bind address is taken or invalid.
        """
        if self._tasks:
            raise RuntimeError("KVEventSubscriber already started")
        loop = asyncio.get_running_loop()
        if self._context is None:
            self._context = zmq.asyncio.Context()
        try:
            if self.bind is not None:
                sock = self._socket()
                sock.bind(self.bind)
                self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                self._tasks.append(loop.create_task(self._consume(sock, None), name="kv-events-sub"))
            for address, target in self.sources.items():
                sock = self._socket()
                sock.connect(address)
                self._tasks.append(loop.create_task(self._consume(sock, target), name=f"kv-events-{address}"))
        except BaseException:
            self._close()
            raise

    async def stop(self) -> None:
        """Stop consuming and close the sockets (and the private context). Idempotent."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._close()

    async def __aenter__(self) -> KVEventSubscriber:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _socket(self) -> zmq.asyncio.Socket:
        assert self._context is not None
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, DEFAULT_RCVHWM)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sockets.append(sock)
        return sock

    def _close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None

    # ---- consuming ------------------------------------------------------------------------
    async def _consume(self, sock: zmq.asyncio.Socket, fixed: tuple[str, str] | None) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                self.handle(frames, fixed)
            except Exception:  # a bug must not stop the consumer: log it, keep going
                log.exception("kv events: failed to apply a message", extra={"action": "kv_event_apply_failed"})

    def handle(self, frames: list[bytes], fixed: tuple[str, str] | None = None) -> None:
        """Decode one multipart message and apply it to the index (what the consumer loop does
        per message; public so a caller with its own socket can feed messages).

        ``fixed``: the (endpoint, model) of a connected source; None to resolve the topic."""
        self.messages += 1
        try:
            message = decode_message(frames)
        except KVEventDecodeError as exc:
            self.index.record_decode_error()
            log.debug("kv events: undecodable message: %s", exc)
            return
        target = fixed or self.resolve(message.topic)
        if target is None:
            self.unresolved += 1
            return
        endpoint, model = target
        stream = (message.topic if fixed is None else endpoint, message.batch.data_parallel_rank)
        last = self._last_seq.get(stream)
        if last is not None:
            if message.seq > last + 1:
                self.index.record_seq_gap(message.seq - last - 1)
            elif message.seq <= last:  # the publisher restarted: the engine's cache is new
                self.restarts += 1
                self.index.remove_endpoint(endpoint)
        self._last_seq[stream] = message.seq
        self.index.apply(endpoint, model, message.batch.events)

    def resolve(self, topic: str) -> tuple[str, str] | None:
        """(endpoint name, model) for ``topic``, or None (see the module docstring). Memoised."""
        if topic in self._resolved:
            return self._resolved[topic]
        found: tuple[str, str] | None = None
        fleet = parse_fleet_topic(topic)
        key = topic if topic in self._explicit else next((p for p in self._prefixes if topic.startswith(p)), None)
        if key is None and fleet is None and "" in self._explicit:
            key = ""  # the catch-all
        if key is not None:
            value = self._explicit[key]
            if isinstance(value, tuple):
                found = value
            else:
                model = fleet[1] if fleet else self.default_model
                found = (value, model) if model else None
        else:
            found = fleet
        self._resolved[topic] = found
        return found

    def stats(self) -> dict[str, Any]:
        """``messages`` received, ``unresolved`` (dropped: unknown topic), ``restarts``
        (publishers whose sequence went back), and the last ``seq`` per topic."""
        topics: dict[str, int] = {}
        for (topic, _rank), seq in self._last_seq.items():
            topics[topic] = max(seq, topics.get(topic, -1))
        return {"messages": self.messages, "unresolved": self.unresolved, "restarts": self.restarts,
                "topics": topics}
