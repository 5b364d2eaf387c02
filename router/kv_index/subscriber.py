"""The asyncio consumer of the engines' KV events: ZMQ SUB socket(s) → :class:`KVBlockIndex`.

Two ways to get the events (vLLM's PUB socket binds when its ``--kv-events-config`` endpoint holds
``*`` or ``::`` or is ``ipc://``/``inproc://``, and connects otherwise):

* **connect** (``sources``, :meth:`KVEventSubscriber.set_sources`; router HA): each engine binds
  its PUB (vLLM's default ``tcp://*:5557``) and every router replica connects one SUB socket to
  every engine, so every replica sees every engine's events and holds the same index. Each
  :class:`KVEventSource` names the engine's base URL (as the pool names endpoints), its PUB
  address and its replay address (vLLM's ``replay_endpoint``; :mod:`router.kv_index.replay`).
* **bind** (``bind``; one router replica): the router BINDS one SUB socket and every engine
  connects its PUB to it; each engine's topic says who it is. Through a Service each engine's
  connection reaches ONE replica, which is why this mode is for a single replica.

Topic → endpoint (bind mode): our fleet's topic is ``kv@<host>:<port>@<model>``
(``engine_twin.launch``), which names the endpoint ``http://<host>:<port>`` and the model seeding
the key chain. ``endpoint_for_topic`` overrides this, and names engines whose topic does not carry
their address: ``{topic or topic prefix: endpoint name or (endpoint name, model)}``. Order: the
exact topic, then the longest matching non-empty prefix, then a ``kv@<host>:<port>@<model>``
topic, then the ``""`` entry as a catch-all (vLLM's default topic is empty). Without a model in
the value, the model comes from a ``kv@…@<model>`` topic, else ``default_model``. Messages whose
topic resolves to nothing are dropped and counted (``unresolved``).

Model of a connected source: its :attr:`KVEventSource.model`, else the model of a
``kv@…@<model>`` topic, else ``model_of(endpoint)`` (the router passes the pool's ``/v1/models``
answer), else ``default_model``; messages until one is known are dropped and counted.

Sequence numbers (per publisher, from 0; per (topic, data-parallel rank) in bind mode, per source
in connect mode — vLLM gives each rank its own port):

* **connect**: as soon as the model is known the subscriber asks the engine's replay socket for
  every batch from 0 (vLLM's buffer holds the last ``buffer_steps``), so a replica that starts
  late, or restarts, learns what the engine cached before; live batches it then receives twice
  (sent after the SUB joined, before the replay was served) are recognised by their payload and
  skipped.
* **gap** (seq jumps forward from the expected one): the missed batches are counted
  (``seq_gaps`` on the index, ``gaps`` here) and asked from the replay socket; if they all come
  back they are applied before the new batch (``replays``). If replay is unavailable (no socket,
  no answer within ``replay_timeout_s``; then not retried for ``replay_retry_s``) or the buffer no
  longer holds them, the endpoint's entries are dropped (``drops``) and the index relearns it: the
  batches that did come back (the newest ones, continuous up to the new batch) and everything from
  the new batch on. Dropping trades stale entries (removals lost) for missing ones: blocks the
  engine still holds come back only as they are stored again.
* **reset** (seq goes back, and is not a replayed duplicate): the publisher restarted, the
  engine's cache is new: the endpoint's entries are dropped (``restarts``) and the new stream is
  learnt from 0 (replaying its first batches if they were missed).
* :meth:`resync` (the router calls it when the pool marks an engine down, which drops its entries):
  the next batch is handled as a fresh connect, so an engine that comes back is relearnt from its
  replay buffer.

In bind mode there is no replay: a gap drops the endpoint's entries, a reset too.

Everything runs in the event loop that calls :meth:`KVEventSubscriber.start`: the index is only
touched from that loop, as is the scheduler that reads it, so no lock is needed. A malformed
message counts as a decode error on the index and never stops the consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from router.kv_index.events import KVEventDecodeError, KVEventMessage, decode_message, decode_payload
from router.kv_index.index import KVBlockIndex
from router.kv_index.replay import DEFAULT_REPLAY_TIMEOUT_S, ReplayUnavailable, request_replay

log = logging.getLogger(__name__)

#: Receive high-water mark of the SUB sockets, in messages: vLLM's publisher default ``hwm``.
DEFAULT_RCVHWM = 100_000
#: Seconds after a failed replay before the same engine's replay socket is asked again (gaps in
#: between drop the engine's entries at once instead of waiting ``replay_timeout_s`` each time).
DEFAULT_REPLAY_RETRY_S = 30.0
#: Seconds a new connected source waits for its model (``model_of``) before its connect replay
#: waits for the first live batch instead (whose topic may name the model).
MODEL_WAIT_S = 30.0

TopicTarget = str | tuple[str, str]
ReplayFn = Callable[[str, int], Awaitable[list[tuple[int, bytes]]]]


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


@dataclass(frozen=True, slots=True)
class KVEventSource:
    """One engine's bound KV-event sockets, for a connecting subscriber.

    Attributes:
        endpoint: the engine's base URL as the pool names it (``http://10.0.0.7:8000``).
        address: its PUB socket, ``tcp://host:port``.
        replay: its replay (ROUTER) socket, ``tcp://host:port``; None: the engine has none.
        model: the model seeding the engine's key chain; None: from a fleet topic or the pool.
    """

    endpoint: str
    address: str
    replay: str | None = None
    model: str | None = None


def replay_address_for(address: str, offset: int) -> str | None:
    """The replay address by convention: ``address``'s port + ``offset`` (None for offset 0 or an
    address without a port)."""
    base, colon, port = address.rpartition(":")
    if not offset or not colon or not port.isdigit() or not 0 < int(port) + offset < 65536:
        return None
    return f"{base}:{int(port) + offset}"


def parse_connect_spec(spec: str, replay_port_offset: int = 1) -> KVEventSource:
    """``ENGINE_URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]`` (``--kv-events-connect``) → a source.

    Without a replay address, the replay socket is taken at ``PORT + replay_port_offset`` (0: the
    engine has none).

    Raises:
        ValueError: no ``=``, an engine URL that is not ``http(s)://``, an address that is not
            ``tcp://host:port`` with a port in 1..65535, or a trailing comma without a replay address.
    """
    url, sep, rest = spec.partition("=")
    url = url.strip().rstrip("/")
    if not sep or not url.startswith(("http://", "https://")):
        raise ValueError(f"--kv-events-connect wants ENGINE_URL=tcp://HOST:PORT, got {spec!r}")
    address, comma, replay = (part.strip() for part in rest.partition(","))
    if comma and not replay:
        raise ValueError(f"--kv-events-connect: nothing after the comma in {spec!r} (give the replay address or "
                         "leave the comma out)")
    for value in (address, replay):
        if value and not _is_tcp(value):
            raise ValueError(f"KV-event address must be tcp://HOST:PORT: {value!r} in {spec!r}")
    if not address:
        raise ValueError(f"--kv-events-connect wants ENGINE_URL=tcp://HOST:PORT, got {spec!r}")
    return KVEventSource(url, address, replay or replay_address_for(address, replay_port_offset))


def _is_tcp(address: str) -> bool:
    host, colon, port = address.removeprefix("tcp://").rpartition(":")
    return address.startswith("tcp://") and bool(colon and host) and port.isdigit() and 0 < int(port) < 65536


class _Stream:
    """Sequence state of one connected source."""

    __slots__ = ("source", "expected", "synced", "model", "dups", "dup_high", "retry_at", "last_seq",
                 "gaps", "replays", "replayed", "replay_failures", "drops", "restarts", "task", "sock")

    def __init__(self, source: KVEventSource) -> None:
        self.source = source
        self.expected = 0  # next sequence number wanted
        self.synced = False  # something of this stream was applied since the last (re)connect
        self.model = source.model
        self.dups: dict[int, int] = {}  # replayed seq -> hash(payload), until seen live
        self.dup_high = -1
        self.retry_at = 0.0  # monotonic time before which replay is not asked again
        self.last_seq: int | None = None
        self.gaps = self.replays = self.replayed = self.replay_failures = self.drops = self.restarts = 0
        self.task: asyncio.Task[None] | None = None
        self.sock: zmq.asyncio.Socket | None = None

    def view(self) -> dict[str, Any]:
        src = self.source
        return {"address": src.address, "replay": src.replay, "model": self.model, "seq": self.last_seq,
                "synced": self.synced, "gaps": self.gaps, "replays": self.replays, "replayed_batches": self.replayed,
                "replay_failures": self.replay_failures, "drops": self.drops, "restarts": self.restarts}


class KVEventSubscriber:
    """Consumes KV events from ZMQ and applies them to ``index``.

    Args:
        index: the index to feed.
        bind: address the SUB socket binds (engines' PUB sockets connect to it), e.g.
            ``tcp://127.0.0.1:5557``; ``tcp://127.0.0.1:*`` picks a free port (see
            :attr:`bound_address`); None for no bound socket.
        endpoint_for_topic: explicit topic (or topic prefix) → endpoint name or (endpoint name,
            model), bind mode; see the module docstring.
        sources: engines with a bound PUB socket to connect to: :class:`KVEventSource` objects, or
            (older form) ``{pub address: (endpoint name, model)}`` (no replay).
        default_model: model for explicitly mapped topics and sources that name none.
        model_of: endpoint name → its model (or None while unknown), for connected sources.
        replay_timeout_s: seconds a replay may take before it counts as unavailable.
        replay_retry_s: seconds before a source whose replay failed is asked again.
        context: a ``zmq.asyncio.Context`` to use (default: a private one, closed by :meth:`stop`).
        replay: ``(address, start) → [(seq, payload)]`` (default: :func:`request_replay` on the
            context); raises :class:`ReplayUnavailable`. For tests.

    Raises:
        ValueError: neither ``bind`` nor ``sources`` nor ``allow_empty``.
        zmq.ZMQError: from :meth:`start` when the address cannot be bound.
    """

    def __init__(self, index: KVBlockIndex, bind: str | None = "tcp://127.0.0.1:5557",
                 endpoint_for_topic: Mapping[str, TopicTarget] | None = None, *,
                 sources: Iterable[KVEventSource] | Mapping[str, tuple[str, str]] | None = None,
                 default_model: str | None = None, model_of: Callable[[str], str | None] | None = None,
                 replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S, replay_retry_s: float = DEFAULT_REPLAY_RETRY_S,
                 context: zmq.asyncio.Context | None = None, replay: ReplayFn | None = None,
                 allow_empty: bool = False) -> None:
        if isinstance(sources, Mapping):
            sources = [KVEventSource(endpoint, address, None, model) for address, (endpoint, model) in sources.items()]
        initial = list(sources or [])
        if bind is None and not initial and not allow_empty:
            raise ValueError("KVEventSubscriber needs a bind address or sources to connect to")
        self.index = index
        self.bind = bind
        self.default_model = default_model
        self.model_of = model_of
        self.replay_timeout_s = replay_timeout_s
        self.replay_retry_s = replay_retry_s
        self._replay_fn = replay
        self._explicit = dict(endpoint_for_topic or {})
        self._prefixes = sorted((t for t in self._explicit if t), key=len, reverse=True)
        self._resolved: dict[str, tuple[str, str] | None] = {}
        self._own_context = context is None
        self._context = context
        self._bound_sock: zmq.asyncio.Socket | None = None
        self._bound_task: asyncio.Task[None] | None = None
        self._initial = initial
        self._streams: dict[str, _Stream] = {}  # by endpoint
        self._last_seq: dict[tuple[str, int | None], int] = {}  # bind mode
        self._started = False
        self.bound_address: str | None = None
        self.messages = 0
        self.unresolved = 0
        self.restarts = 0  # bind mode (connected sources count their own)
        self.drops = 0  # bind mode
        self.gaps = 0  # bind mode, batches missed

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Bind / connect the sockets and start consuming; call from the running event loop.

        Raises:
            RuntimeError: already started, or no running loop.
            zmq.ZMQError: the bind address is taken or invalid.
        """
        if self._started:
            raise RuntimeError("KVEventSubscriber already started")
        loop = asyncio.get_running_loop()
        if self._context is None:
            self._context = zmq.asyncio.Context()
        self._started = True
        try:
            if self.bind is not None:
                sock = self._bound_sock = self._socket()
                sock.bind(self.bind)
                self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                self._bound_task = loop.create_task(self._consume_bound(sock), name="kv-events-sub")
            self.set_sources(self._initial)
        except BaseException:
            self._started = False
            self._close()
            raise

    async def stop(self) -> None:
        """Stop consuming and close the sockets (and the private context). Idempotent."""
        tasks = [t for t in [self._bound_task, *(s.task for s in self._streams.values())] if t is not None]
        self._bound_task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._started:
            self._initial = [s.source for s in self._streams.values()]
        self._close()
        self._streams.clear()
        self._started = False

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
        return sock

    def _close(self) -> None:
        if self._bound_sock is not None:
            self._bound_sock.close(linger=0)
            self._bound_sock = None
        for stream in self._streams.values():
            if stream.sock is not None:
                stream.sock.close(linger=0)
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None

    # ---- connected sources ----------------------------------------------------------------
    @property
    def sources(self) -> dict[str, KVEventSource]:
        """The connected sources by endpoint name."""
        if not self._started:
            return {s.endpoint: s for s in self._initial}
        return {name: s.source for name, s in self._streams.items()}

    def set_sources(self, sources: Iterable[KVEventSource]) -> None:
        """Connect to exactly ``sources`` (one per endpoint; the last wins): new ones get a SUB
        socket and their connect replay, gone or changed ones are closed and their endpoint's
        entries dropped. Before :meth:`start` this only records them. Call from the event loop."""
        wanted = {s.endpoint: s for s in sources}
        if not self._started:
            self._initial = list(wanted.values())
            return
        for name, stream in list(self._streams.items()):
            if wanted.get(name) != stream.source:
                self._remove_stream(name)
        for name, source in wanted.items():
            if name not in self._streams:
                self._add_stream(source)

    def _add_stream(self, source: KVEventSource) -> None:
        stream = self._streams[source.endpoint] = _Stream(source)
        sock = stream.sock = self._socket()
        try:
            sock.connect(source.address)
        except zmq.ZMQError:
            sock.close(linger=0)
            del self._streams[source.endpoint]
            log.warning("kv events: cannot connect to %s for %s", source.address, source.endpoint,
                        extra={"action": "kv_events_connect_failed"})
            return
        stream.task = asyncio.get_running_loop().create_task(self._consume_source(stream),
                                                             name=f"kv-events {source.endpoint}")

    def _remove_stream(self, name: str) -> None:
        stream = self._streams.pop(name)
        if stream.task is not None:
            stream.task.cancel()
        if stream.sock is not None:
            stream.sock.close(linger=0)
        self.index.remove_endpoint(name)

    def resync(self, endpoint: str) -> None:
        """Handle ``endpoint``'s next batch as a fresh connect (its entries were dropped: the
        pool marked it down); unknown names are ignored."""
        stream = self._streams.get(endpoint)
        if stream is not None:
            stream.synced = False
            stream.expected = 0
            stream.dups.clear()
            stream.dup_high = -1

    async def _consume_source(self, stream: _Stream) -> None:
        sock = stream.sock
        assert sock is not None
        try:
            await self._connect_replay(stream, sock)
        except Exception:  # a bug must not stop the consumer
            log.exception("kv events: connect replay failed", extra={"action": "kv_event_apply_failed"})
        while True:
            frames = await sock.recv_multipart()
            try:
                await self.handle_source(stream.source.endpoint, frames)
            except Exception:  # a bug must not stop the consumer: log it, keep going
                log.exception("kv events: failed to apply a message", extra={"action": "kv_event_apply_failed"})

    async def _connect_replay(self, stream: _Stream, sock: zmq.asyncio.Socket) -> None:
        """Replay everything the engine still buffers, once its model is known; if a live batch
        arrives first, it is handled as the stream's first (which replays from 0 if needed)."""
        if stream.source.replay is None:
            return
        deadline = time.monotonic() + MODEL_WAIT_S
        while self._model(stream, "") is None:
            if time.monotonic() > deadline or await sock.poll(100):
                return  # the first live batch (with its topic) decides
        stream.model = self._model(stream, "")
        batches = await self._replay(stream, 0)
        if not batches:
            return
        batches.sort()
        # a buffer that rolled over no longer starts at 0: learn what it still holds
        applied = self._apply_run(stream, batches, batches[0][0], None)
        if applied:
            stream.replays += 1
            stream.dups = {seq: hash(payload) for seq, payload in batches}
            stream.dup_high = batches[-1][0]

    # ---- messages -------------------------------------------------------------------------
    async def handle_source(self, endpoint: str, frames: list[bytes]) -> None:
        """Decode one multipart message of connected source ``endpoint`` and apply it, replaying
        missed batches first (see the module docstring). Public so tests can feed messages."""
        stream = self._streams[endpoint]
        message = self._decode(frames)
        if message is None:
            return
        seq = message.seq
        stream.last_seq = seq
        if seq <= stream.dup_high:
            if stream.dups.get(seq) == hash(bytes(frames[2])):  # a replayed batch, now live
                for old in [s for s in stream.dups if s <= seq]:
                    del stream.dups[old]
                return
            stream.dups.clear()
            stream.dup_high = -1
        elif stream.dups:
            stream.dups.clear()
            stream.dup_high = -1
        model = self._model(stream, message.topic)
        if model is None:
            self.unresolved += 1
            return
        stream.model = model
        if stream.synced and seq < stream.expected:  # the publisher restarted: the engine's cache is new
            stream.restarts += 1
            self._drop(stream)
            stream.expected = 0
        if seq > stream.expected:
            if stream.synced:
                stream.gaps += seq - stream.expected
                self.index.record_seq_gap(seq - stream.expected)
            await self._fill(stream, seq)
        self.index.apply(endpoint, model, message.batch.events)
        stream.expected = seq + 1
        stream.synced = True

    async def _fill(self, stream: _Stream, until: int) -> None:
        """Replay ``[stream.expected, until)``; on failure, or when the buffer no longer holds all
        of it, drop the endpoint's entries and apply the run that did come back up to ``until``."""
        start = stream.expected
        batches = await self._replay(stream, start) if stream.source.replay else None
        wanted = sorted((seq, p) for seq, p in batches or [] if start <= seq < until)
        complete = [seq for seq, _ in wanted] == list(range(start, until))
        if complete:
            stream.replays += 1
            self._apply_run(stream, wanted, start, until)
            return
        if stream.synced:
            self._drop(stream)
        # relearn from the newest continuous run ending just before ``until`` (may be empty)
        run: list[tuple[int, bytes]] = []
        for seq, payload in reversed(wanted):
            if seq != (run[-1][0] - 1 if run else until - 1):
                break
            run.append((seq, payload))
        run.reverse()
        if run:
            self._apply_run(stream, run, run[0][0], until)

    def _apply_run(self, stream: _Stream, batches: list[tuple[int, bytes]], start: int, until: int | None) -> int:
        """Apply replayed ``(seq, payload)`` batches (sorted) from ``start`` while continuous and
        below ``until``; returns how many were applied."""
        model = stream.model or self.default_model
        if model is None:
            return 0
        applied = 0
        expected = start
        for seq, payload in batches:
            if seq < expected:
                continue  # a duplicate
            if seq != expected or (until is not None and seq >= until):
                break
            try:
                batch = decode_payload(payload)
            except KVEventDecodeError:
                self.index.record_decode_error()
            else:
                self.index.apply(stream.source.endpoint, model, batch.events)
            expected = seq + 1
            applied += 1
        if applied:
            stream.expected = expected
            stream.synced = True
            stream.replayed += applied
        return applied

    async def _replay(self, stream: _Stream, start: int) -> list[tuple[int, bytes]] | None:
        """The replay from ``start``, or None (unavailable now: counted, not asked again for
        ``replay_retry_s``)."""
        address = stream.source.replay
        if address is None or time.monotonic() < stream.retry_at:
            return None
        try:
            if self._replay_fn is not None:
                return await self._replay_fn(address, start)
            assert self._context is not None
            return await request_replay(self._context, address, start, self.replay_timeout_s)
        except ReplayUnavailable as exc:
            stream.replay_failures += 1
            stream.retry_at = time.monotonic() + self.replay_retry_s
            log.warning("kv events: replay from %s unavailable: %s", address, exc,
                        extra={"action": "kv_events_replay_unavailable"})
            return None

    def _drop(self, stream: _Stream) -> None:
        stream.drops += 1
        self.index.remove_endpoint(stream.source.endpoint)
        stream.synced = False

    def _model(self, stream: _Stream, topic: str) -> str | None:
        if stream.source.model:
            return stream.source.model
        fleet = parse_fleet_topic(topic) if topic else None
        if fleet is not None:
            return fleet[1]
        if stream.model:
            return stream.model
        found = self.model_of(stream.source.endpoint) if self.model_of is not None else None
        return found or self.default_model

    # ---- bind mode ------------------------------------------------------------------------
    async def _consume_bound(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                self.handle(frames)
            except Exception:  # a bug must not stop the consumer: log it, keep going
                log.exception("kv events: failed to apply a message", extra={"action": "kv_event_apply_failed"})

    def handle(self, frames: list[bytes], fixed: tuple[str, str] | None = None) -> None:
        """Decode one multipart message of the bound socket and apply it to the index (what the
        consumer loop does per message; public so a caller with its own socket can feed messages).

        ``fixed``: the (endpoint, model) the message is from; None to resolve the topic. A gap
        or a reset drops the endpoint's entries (no replay in this mode)."""
        message = self._decode(frames)
        if message is not None:
            self._apply_bound(message, fixed)

    def _decode(self, frames: list[bytes]) -> KVEventMessage | None:
        """Count one message and decode it; None (counted as a decode error) when it is malformed."""
        self.messages += 1
        try:
            return decode_message(frames)
        except KVEventDecodeError as exc:
            self.index.record_decode_error()
            log.debug("kv events: undecodable message: %s", exc)
            return None

    def _apply_bound(self, message: KVEventMessage, fixed: tuple[str, str] | None) -> None:
        target = fixed or self.resolve(message.topic)
        if target is None:
            self.unresolved += 1
            return
        endpoint, model = target
        stream = (message.topic if fixed is None else endpoint, message.batch.data_parallel_rank)
        last = self._last_seq.get(stream)
        if last is not None:
            if message.seq > last + 1:
                self.gaps += message.seq - last - 1
                self.index.record_seq_gap(message.seq - last - 1)
                self.drops += 1
                self.index.remove_endpoint(endpoint)
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

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``messages`` received, ``unresolved`` (dropped: unknown topic or model), and, summed over
        both modes, ``gaps`` (batches missed), ``replays`` (gaps and connects filled from a replay
        socket), ``replayed_batches``, ``replay_failures``, ``drops`` (an endpoint's entries dropped
        for an unrecoverable gap or a reset) and ``restarts`` (resets); ``topics``: the last seq per
        topic (bind mode); ``sources``: per connected endpoint its addresses, model, last ``seq``,
        ``synced`` and the same counters."""
        topics: dict[str, int] = {}
        for (topic, _rank), seq in self._last_seq.items():
            topics[topic] = max(seq, topics.get(topic, -1))
        streams = list(self._streams.values())
        return {"messages": self.messages, "unresolved": self.unresolved,
                "gaps": self.gaps + sum(s.gaps for s in streams),
                "replays": sum(s.replays for s in streams),
                "replayed_batches": sum(s.replayed for s in streams),
                "replay_failures": sum(s.replay_failures for s in streams),
                "drops": self.drops + sum(s.drops for s in streams),
                "restarts": self.restarts + sum(s.restarts for s in streams),
                "topics": topics, "sources": {name: s.view() for name, s in self._streams.items()}}
