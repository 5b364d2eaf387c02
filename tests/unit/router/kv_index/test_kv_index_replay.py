"""Router HA: vLLM's replay framing (client against the engine twin's replay socket), and the
subscriber of connected sources — connect replay, gap → replay, a buffer that no longer holds the
missed batches or no replay at all → drop + relearn, a reset → drop + relearn, duplicates of
replayed batches skipped, resync after the pool marked an engine down."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from scheduling_helpers import prompt

from engine_twin import kv_events as sim_events
from engine_twin.settings import KVEventsConfig
from router.kv_index.events import KVEventDecodeError
from router.kv_index.index import KVBlockIndex
from router.kv_index.replay import END_SEQ, ReplayUnavailable, decode_reply, encode_request, request_replay
from router.kv_index.subscriber import KVEventSource, KVEventSubscriber, parse_connect_spec, replay_address_for
from router.scheduling.hashing import chain_seed, chained_keys, tokens_to_bytes

ENGINE = "http://10.0.0.7:8000"
TOPIC = "kv@10.0.0.7:8000@m"


def keys_of(tokens, model="m"):
    return chained_keys(tokens_to_bytes(tokens), 256, chain_seed(model))


def store(tokens, first_hash, parent=None):
    return sim_events.BlockStored(list(range(first_hash, first_hash + len(tokens) // 16)), parent, tokens, 16)


def payload(events) -> bytes:
    return sim_events.encode_batch(events, "map", 0, ts=1.0)


def frames(seq: int, body: bytes, topic: str = TOPIC) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), body]


# ---- framing ------------------------------------------------------------------------------------
def test_request_and_reply_framing_are_vllms():
    assert encode_request(5) == [b"", (5).to_bytes(8, "big")]
    assert END_SEQ == b"\xff" * 8
    assert decode_reply([b"", (7).to_bytes(8, "big"), b"body"]) == (7, b"body")
    assert decode_reply([b"", END_SEQ, b""]) is None
    for bad in ([b"", b"\x00" * 7, b"x"], [b"x", (1).to_bytes(8, "big"), b"y"], [(1).to_bytes(8, "big"), b"y"],
                [b"", END_SEQ, b"tail"]):
        with pytest.raises(KVEventDecodeError):
            decode_reply(bad)
    with pytest.raises(ValueError):
        encode_request(-1)


def test_the_twins_replay_socket_serves_its_buffer_to_the_client():
    context = zmq.Context()
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:*",
                            replay_endpoint="tcp://127.0.0.1:*", buffer_steps=3)
    publisher = sim_events.KVEventPublisher(config, "map", context=context)
    try:
        for i in range(5):
            publisher.publish([sim_events.BlockRemoved([i])])
        address = publisher.replay_address
        assert address is not None and address.startswith("tcp://127.0.0.1:")

        async def scenario():
            actx = zmq.asyncio.Context()
            try:
                # a request without vLLM's empty delimiter frame gets no answer, the next one does
                junk = actx.socket(zmq.DEALER)
                junk.connect(address)
                await junk.send_multipart([(0).to_bytes(8, "big")])
                assert not await junk.poll(200)
                junk.close(linger=0)
                return (await request_replay(actx, address, 0), await request_replay(actx, address, 4),
                        await request_replay(actx, address, 9))
            finally:
                actx.term()

        from_0, from_4, from_9 = asyncio.run(scenario())
    finally:
        publisher.close()
        context.term()
    assert [seq for seq, _ in from_0] == [2, 3, 4]  # buffer_steps=3: 0 and 1 are gone
    assert [sim_events.decode_batch(p)[1] for _, p in from_4] == [
        [{"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU", "group_idx": 0}]]
    assert from_9 == []
    assert publisher.replays_served == 3


def test_no_replay_socket_is_unavailable_not_a_hang():
    async def scenario():
        actx = zmq.asyncio.Context()
        try:
            with pytest.raises(ReplayUnavailable):
                await request_replay(actx, "tcp://127.0.0.1:9", 0, timeout_s=0.2)
        finally:
            actx.term()

    asyncio.run(scenario())


def test_connect_specs():
    assert parse_connect_spec("http://e:8000/=tcp://e:5557") == KVEventSource("http://e:8000", "tcp://e:5557",
                                                                             "tcp://e:5558")
    assert parse_connect_spec("http://e:8000=tcp://e:5557,tcp://e:6000").replay == "tcp://e:6000"
    assert parse_connect_spec("http://e:8000=tcp://e:5557", replay_port_offset=0).replay is None
    assert replay_address_for("tcp://[::1]:5557", 2) == "tcp://[::1]:5559"
    assert parse_connect_spec("http://e:8000=tcp://e:65535").replay is None  # no port 65536: no replay socket
    for bad in ("tcp://e:5557", "e:8000=tcp://e:5557", "http://e:8000=", "http://e:8000=tcp://e",
                "http://e:8000=ipc:///x", "http://e:8000=tcp://e:1,udp://e:2", "http://e:8000=tcp://e:99999",
                "http://e:8000=tcp://e:0", "http://e:8000=tcp://e:5557,", "http://e:8000=tcp://e:1,tcp://e:70000"):
        with pytest.raises(ValueError):
            parse_connect_spec(bad)


# ---- the subscriber's sequence handling ----------------------------------------------------------
class FakeEngine:
    """An engine's published history and replay buffer (``keep`` newest batches), counting
    requests; ``available=False`` makes every replay fail as a missing socket would."""

    def __init__(self, keep: int = 100) -> None:
        self.batches: list[tuple[int, bytes]] = []
        self.keep = keep
        self.available = True
        self.asked: list[int] = []

    def publish(self, events) -> list[bytes]:
        seq = len(self.batches)
        self.batches.append((seq, payload(events)))
        return frames(seq, self.batches[-1][1])

    async def replay(self, address: str, start: int) -> list[tuple[int, bytes]]:
        self.asked.append(start)
        if not self.available:
            raise ReplayUnavailable("no socket")
        return [b for b in self.batches[-self.keep:] if b[0] >= start]


def run_with(engine: FakeEngine, body, model: str | None = "m", replay: str | None = "tcp://127.0.0.1:9"):
    """Run ``body(sub, index)`` with one connected source (its SUB socket connects to a port nobody
    serves; messages are fed with ``handle_source``)."""
    async def scenario():
        index = KVBlockIndex()
        source = KVEventSource(ENGINE, "tcp://127.0.0.1:9", replay, model)
        async with KVEventSubscriber(index, bind=None, sources=[source], replay=engine.replay) as sub:
            await asyncio.sleep(0.05)  # the connect replay
            return await body(sub, index)

    return asyncio.run(scenario())


def test_connect_replays_what_the_engine_published_before_and_skips_the_duplicates():
    engine = FakeEngine()
    a, b = prompt(1, 128), prompt(2, 128)
    early = [engine.publish([store(a[:64], 1)]), engine.publish([store(a[64:], 5, 4)])]

    async def body(sub, index):
        assert engine.asked == [0]
        assert index.longest_prefix("m", keys_of(a)) == {ENGINE: (2, "gpu")}
        await sub.handle_source(ENGINE, early[1])  # sent after the SUB joined: also replayed
        await sub.handle_source(ENGINE, engine.publish([store(b, 100)]))
        return sub.stats(), index.longest_prefix("m", keys_of(b))

    stats, found = run_with(engine, body)
    assert found == {ENGINE: (2, "gpu")}
    assert (stats["replays"], stats["replayed_batches"], stats["gaps"], stats["drops"], stats["restarts"]) == \
        (1, 2, 0, 0, 0)
    assert stats["sources"][ENGINE]["seq"] == 2 and stats["sources"][ENGINE]["synced"]


def test_a_gap_is_filled_from_the_replay_socket():
    engine = FakeEngine()
    a = prompt(3, 256)

    async def body(sub, index):
        await sub.handle_source(ENGINE, engine.publish([store(a[:64], 1)]))
        engine.publish([store(a[64:128], 5, 4)])  # lost on the way (ZMQ high-water mark)
        engine.publish([store(a[128:192], 9, 8)])  # lost
        await sub.handle_source(ENGINE, engine.publish([store(a[192:], 13, 12)]))
        return sub.stats(), index.longest_prefix("m", keys_of(a)), index.stats()["seq_gaps"]

    stats, found, seq_gaps = run_with(engine, body)
    assert engine.asked == [0, 1]
    assert found == {ENGINE: (4, "gpu")}
    assert (stats["gaps"], stats["replays"], stats["drops"], seq_gaps) == (2, 1, 0, 2)


def test_a_gap_the_buffer_no_longer_holds_drops_the_engine_and_relearns_what_came_back():
    engine = FakeEngine(keep=2)
    a, b, c = prompt(4, 128), prompt(5, 64), prompt(6, 64)

    async def body(sub, index):
        await sub.handle_source(ENGINE, engine.publish([store(a, 1)]))
        engine.publish([sim_events.BlockRemoved([1, 2, 3, 4, 5, 6, 7, 8])])  # lost, and gone from the buffer
        engine.publish([store(b, 50)])  # lost, still buffered
        await sub.handle_source(ENGINE, engine.publish([store(c, 60)]))
        return sub.stats(), [index.longest_prefix("m", keys_of(t)) for t in (a, b, c)]

    stats, found = run_with(engine, body)
    assert found == [{}, {ENGINE: (1, "gpu")}, {ENGINE: (1, "gpu")}]  # a's stale entries are gone
    assert (stats["gaps"], stats["replays"], stats["drops"]) == (2, 0, 1)


def test_without_replay_a_gap_drops_and_replay_is_not_asked_again_for_a_while():
    engine = FakeEngine()
    engine.available = False
    a, b, c = prompt(7, 64), prompt(8, 64), prompt(9, 64)

    async def body(sub, index):
        await sub.handle_source(ENGINE, engine.publish([store(a, 1)]))  # first seen is seq 0: nothing missed
        engine.publish([])
        await sub.handle_source(ENGINE, engine.publish([store(b, 10)]))
        engine.publish([])
        await sub.handle_source(ENGINE, engine.publish([store(c, 20)]))
        return sub.stats(), [index.longest_prefix("m", keys_of(t)) for t in (a, b, c)]

    stats, found = run_with(engine, body)
    assert engine.asked == [0]  # the connect replay failed: the gaps within replay_retry_s do not ask
    assert found == [{}, {}, {ENGINE: (1, "gpu")}]
    assert (stats["gaps"], stats["drops"], stats["replay_failures"]) == (2, 2, 1)


def test_a_reset_drops_the_engine_and_replays_the_new_streams_start():
    engine = FakeEngine()
    a, b, c = prompt(10, 64), prompt(11, 64), prompt(12, 64)

    async def body(sub, index):
        for _ in range(3):
            engine.publish([])
        await sub.handle_source(ENGINE, engine.publish([store(a, 1)]))
        engine.batches.clear()  # the engine restarts: its sequence starts again at 0
        engine.publish([store(b, 100)])  # missed (before the SUB reconnected)
        await sub.handle_source(ENGINE, engine.publish([store(c, 200)]))
        return sub.stats(), [index.longest_prefix("m", keys_of(t)) for t in (a, b, c)]

    stats, found = run_with(engine, body)
    assert found == [{}, {ENGINE: (1, "gpu")}, {ENGINE: (1, "gpu")}]
    assert (stats["restarts"], stats["drops"], stats["gaps"]) == (1, 1, 0)
    assert engine.asked == [0, 0, 0]  # connect (nothing yet), the first live batch (seq 3), the reset


def test_a_live_batch_that_differs_from_the_replayed_one_is_a_reset():
    engine = FakeEngine()
    a, b = prompt(13, 64), prompt(14, 64)
    engine.publish([store(a, 1)])
    engine.publish([])

    async def body(sub, index):
        engine.batches.clear()  # a quick restart: seq 1 comes again, with another batch
        engine.publish([])
        await sub.handle_source(ENGINE, engine.publish([store(b, 100)]))
        return sub.stats(), [index.longest_prefix("m", keys_of(t)) for t in (a, b)]

    stats, found = run_with(engine, body)
    assert found == [{}, {ENGINE: (1, "gpu")}]
    assert stats["restarts"] == 1


def test_resync_relearns_an_engine_from_its_buffer_after_its_entries_were_dropped():
    engine = FakeEngine()
    a, b = prompt(15, 64), prompt(16, 64)

    async def body(sub, index):
        await sub.handle_source(ENGINE, engine.publish([store(a, 1)]))
        index.remove_endpoint(ENGINE)  # the pool saw the engine down
        sub.resync(ENGINE)
        await sub.handle_source(ENGINE, engine.publish([store(b, 10)]))
        return sub.stats(), [index.longest_prefix("m", keys_of(t)) for t in (a, b)]

    stats, found = run_with(engine, body)
    assert found == [{ENGINE: (1, "gpu")}, {ENGINE: (1, "gpu")}]
    assert engine.asked == [0, 0] and stats["gaps"] == 0 and stats["drops"] == 0


def test_the_model_comes_from_the_fleet_topic_when_the_source_names_none():
    engine = FakeEngine()
    a = prompt(17, 128)
    engine.publish([store(a[:64], 1)])

    async def body(sub, index):
        assert engine.asked == []  # no model yet: the first live batch decides
        await sub.handle_source(ENGINE, engine.publish([store(a[64:], 5, 4)]))
        return index.longest_prefix("m", keys_of(a))

    assert run_with(engine, body, model=None) == {ENGINE: (2, "gpu")}
    assert engine.asked == [0]


def test_set_sources_adds_and_removes_engines():
    engine = FakeEngine()
    a = prompt(18, 64)

    async def scenario():
        index = KVBlockIndex()
        async with KVEventSubscriber(index, bind=None, allow_empty=True, replay=engine.replay) as sub:
            other = KVEventSource("http://10.0.0.8:8000", "tcp://127.0.0.1:9", None, "m")
            sub.set_sources([KVEventSource(ENGINE, "tcp://127.0.0.1:9", None, "m"), other])
            await sub.handle_source(ENGINE, engine.publish([store(a, 1)]))
            held = index.longest_prefix("m", keys_of(a))
            sub.set_sources([other])
            return held, index.longest_prefix("m", keys_of(a)), set(sub.sources)

    held, after, names = asyncio.run(scenario())
    assert held == {ENGINE: (1, "gpu")} and after == {} and names == {"http://10.0.0.8:8000"}
