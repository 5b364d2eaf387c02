"""The router's precise prefix index, fed by the engines' KV events (ROUTING.md).

* :mod:`router.kv_index.events` — decode one ZMQ message of vLLM's KV events (both layouts).
* :mod:`router.kv_index.index` — :class:`KVBlockIndex`: our block keys → endpoints and tiers
  (the scheduler's ``PrefixIndex`` port, with speculative entries).
* :mod:`router.kv_index.subscriber` — :class:`KVEventSubscriber`: the asyncio ZMQ consumer.
* its benchmark, :mod:`lab.bench.kv_index` (outside the router) — bytes per block and lookup latency.
"""

from router.kv_index.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    KVEventDecodeError,
    KVEventMessage,
    decode_message,
)
from router.kv_index.index import KVBlockIndex

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVBlockIndex",
    "KVEvent",
    "KVEventBatch",
    "KVEventDecodeError",
    "KVEventMessage",
    "decode_message",
]
