"""KVEventSubscriber: topic → endpoint resolution, sequence gaps and restarts, decode errors counted
(never raised), and real ZMQ sockets — a bound SUB that engines' PUB sockets connect to, and
connecting to an engine's bound PUB."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
from scheduling_helpers import prompt

from engine_twin import kv_events as sim_events
from engine_twin.settings import KVEventsConfig
from router.kv_index.index import KVBlockIndex
from router.kv_index.subscriber import KVEventSubscriber, parse_fleet_topic
from router.scheduling.hashing import chain_seed, chained_keys, tokens_to_bytes

TOPIC = "kv@10.0.0.7:8000@m"
ENDPOINT = "http://10.0.0.7:8000"


def keys_of(tokens, model="m"):
    return chained_keys(tokens_to_bytes(tokens), 256, chain_seed(model))


def message(events, seq: int, topic: str = TOPIC, rank: int = 0) -> list[bytes]:
    return [topic.encode(), seq.to_bytes(8, "big"), sim_events.encode_batch(events, "map", rank, ts=1.0)]


def store(tokens, first_hash=1, parent=None):
    n = len(tokens) // 16
    return sim_events.BlockStored(list(range(first_hash, first_hash + n)), parent, tokens, 16)


@pytest.mark.parametrize(("topic", "expected"), [
    ("kv@10.0.0.7:8000@m", ("http://10.0.0.7:8000", "m")),
    ("kv@[::1]:9000@org/model@v2", ("http://[::1]:9000", "org/model@v2")),
    ("kv@10.0.0.7@m", None),  # no port
    ("kv@10.0.0.7:80x@m", None),
    ("kv@10.0.0.7:8000@", None),  # no model
    ("", None),
    ("engine-3", None),
])
def test_parse_fleet_topic(topic, expected):
    assert parse_fleet_topic(topic) == expected


def test_explicit_mapping_wins_exact_first_then_the_longest_prefix():
    sub = KVEventSubscriber(KVBlockIndex(), endpoint_for_topic={
        "": ("http://solo:8000", "m0"),  # vLLM's default empty topic
        "kv@10.0.0.7:8000@m": "http://renamed:8000",
        "pool-a/": "http://a:8000",
        "pool-a/gpu-": ("http://a-gpu:8000", "m2"),
    }, default_model="m1")
    assert sub.resolve("") == ("http://solo:8000", "m0")
    assert sub.resolve("kv@10.0.0.7:8000@m") == ("http://renamed:8000", "m")  # model from the topic
    assert sub.resolve("pool-a/x") == ("http://a:8000", "m1")  # default model
    assert sub.resolve("pool-a/gpu-1") == ("http://a-gpu:8000", "m2")
    assert sub.resolve("kv@10.0.0.9:8000@m") == ("http://10.0.0.9:8000", "m")  # fleet topic, not mapped
    # "" catches the topics nothing else resolves
    assert sub.resolve("engine-3") == ("http://solo:8000", "m0")


def test_unresolvable_topics_are_dropped_and_counted():
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, endpoint_for_topic={"pool-a/": "http://a:8000"})  # no default model
    sub.handle(message([store(prompt(1, 64))], 0, topic="pool-a/1"))
    sub.handle(message([store(prompt(1, 64))], 0, topic="engine-3"))
    assert sub.stats()["unresolved"] == 2
    assert index.stats()["blocks"] == 0


def test_sequence_gaps_are_counted_per_topic_and_rank_and_drop_the_endpoints_entries():
    """Bind mode has no replay: a gap drops the endpoint's entries (removals were lost) and the
    index relearns from the next batches."""
    index = KVBlockIndex()
    sub = KVEventSubscriber(index)
    tokens, other = prompt(1, 256), prompt(2, 128)
    sub.handle(message([store(tokens[:64])], 5))  # the first seen: no gap whatever its number
    sub.handle(message([store(tokens[64:128], 5, 4)], 6))
    assert index.longest_prefix("m", keys_of(tokens)) == {ENDPOINT: (2, "gpu")}
    sub.handle(message([store(other, 100)], 9))  # 7 and 8 missed
    sub.handle(message([], 0, rank=1))  # another data-parallel rank has its own counter
    assert index.longest_prefix("m", keys_of(tokens)) == {}
    assert index.longest_prefix("m", keys_of(other)) == {ENDPOINT: (2, "gpu")}  # relearnt
    sub.handle(message([], 2, rank=1))  # 1 missed
    assert index.stats()["seq_gaps"] == 3
    assert sub.stats()["gaps"] == 3 and sub.stats()["drops"] == 2
    assert index.longest_prefix("m", keys_of(other)) == {}
    assert sub.stats()["topics"] == {TOPIC: 9}


def test_a_sequence_going_back_means_a_restarted_engine_whose_entries_are_dropped():
    index = KVBlockIndex()
    sub = KVEventSubscriber(index)
    first, second = prompt(1, 128), prompt(2, 64)
    sub.handle(message([store(first)], 41))
    sub.handle(message([store(second, 100)], 0))  # restarted publisher
    assert sub.stats()["restarts"] == 1
    assert index.longest_prefix("m", keys_of(first)) == {}
    assert index.longest_prefix("m", keys_of(second)) == {ENDPOINT: (1, "gpu")}


def test_malformed_messages_are_counted_on_the_index():
    index = KVBlockIndex()
    sub = KVEventSubscriber(index)
    sub.handle([b"only one frame"])
    sub.handle([TOPIC.encode(), (0).to_bytes(8, "big"), b"\xc1"])
    sub.handle([TOPIC.encode(), (1).to_bytes(8, "big"), msgpack.packb([1.0, [["BlockStored", "x"]], 0])])
    assert index.stats()["decode_errors"] == 3
    assert sub.stats()["messages"] == 3


def test_needs_a_bind_address_or_sources():
    with pytest.raises(ValueError):
        KVEventSubscriber(KVBlockIndex(), bind=None)


async def wait_for(condition, timeout: float = 10.0, tick=None) -> None:
    """Await ``condition()`` true, calling ``tick()`` (e.g. publish again) between checks."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met before the deadline")
        if tick is not None:
            tick()
        await asyncio.sleep(0.02)


def test_engines_connect_to_the_bound_sub_socket_and_their_events_reach_the_index():
    tokens = {7001: prompt(1, 128), 7002: prompt(2, 192)}

    async def scenario():
        index = KVBlockIndex()
        async with KVEventSubscriber(index, bind="tcp://127.0.0.1:*") as sub:
            assert sub.bound_address and sub.bound_address.startswith("tcp://127.0.0.1:")
            publishers = {port: sim_events.KVEventPublisher(
                KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=sub.bound_address,
                               topic=sim_events.fleet_topic("127.0.0.1", port, "m")), "array")
                for port in tokens}
            try:
                # a PUB that just connected drops messages until the SUB's subscription arrives:
                # publish a probe until one gets through, then the real events
                for port, pub in publishers.items():
                    topic = f"kv@127.0.0.1:{port}@m"
                    await wait_for(lambda t=topic: t in sub.stats()["topics"],
                                   tick=lambda p=pub: p.publish([sim_events.BlockRemoved([0], "GPU")]))
                    pub.publish([store(tokens[port], 1)])
                await wait_for(lambda: all(index.longest_prefix("m", keys_of(t)) for t in tokens.values()))
                return {port: index.longest_prefix("m", keys_of(t)) for port, t in tokens.items()}
            finally:
                for pub in publishers.values():
                    pub.close()

    found = asyncio.run(scenario())
    assert found == {7001: {"http://127.0.0.1:7001": (2, "gpu")}, 7002: {"http://127.0.0.1:7002": (3, "gpu")}}


def test_connecting_to_an_engines_bound_pub_socket_uses_the_configured_endpoint():
    tokens = prompt(3, 64)
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    seq = iter(range(10**6))

    def send(events):
        pub.send_multipart(message(events, next(seq), topic=""))  # vLLM's default: the empty topic

    async def scenario():
        index = KVBlockIndex()
        sources = {f"tcp://127.0.0.1:{port}": ("http://engine-a:8000", "m")}
        async with KVEventSubscriber(index, bind=None, sources=sources) as sub:
            await wait_for(lambda: sub.stats()["messages"] > 0, tick=lambda: send([]))
            send([store(tokens)])
            await wait_for(lambda: bool(index.longest_prefix("m", keys_of(tokens))))
            return index.longest_prefix("m", keys_of(tokens)), index.stats()["seq_gaps"]

    try:
        found, gaps = asyncio.run(scenario())
    finally:
        pub.close()
        context.term()
    assert found == {"http://engine-a:8000": (1, "gpu")}
    assert gaps == 0


def test_stop_is_idempotent_and_frees_the_address():
    async def scenario():
        sub = KVEventSubscriber(KVBlockIndex(), bind="tcp://127.0.0.1:*")
        sub.start()
        address = sub.bound_address
        with pytest.raises(RuntimeError):
            sub.start()
        await sub.stop()
        await sub.stop()
        again = KVEventSubscriber(KVBlockIndex(), bind=address)
        again.start()  # the same address binds again
        await again.stop()

    asyncio.run(scenario())
