"""The simulated engine's prefix cache: vLLM's chained block hashes and GPU / CPU / disk tiers.

Hashing (vLLM ``vllm/v1/core/kv_cache_utils.py`` with ``--prefix-caching-hash-algo sha256_cbor``):

* ``sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True))`` (32 bytes);
* ``NONE_HASH = sha256_cbor(seed)`` where ``seed`` is the ``PYTHONHASHSEED`` string (our
  ``--hash-seed``, falling back to ``PYTHONHASHSEED``); 32 random bytes when neither is set;
* block ``i`` of a prompt (full blocks only) hashes ``(parent, tuple(tokens_i), extra_keys)`` with
  ``parent = NONE_HASH`` for block 0 and the previous block's hash after that;
* events carry ``int.from_bytes(h, "big") & (2**64 - 1)`` (the last 8 bytes), see :func:`external_hash`.

Blocks (vLLM's ``BlockPool`` / ``KVCacheManager``): a request holds a *block table*, one entry per
GPU block, the block's hash once it is cached (a full block of computed prompt tokens) or ``None``
(a block still filling, or holding generated tokens, which the twin does not cache). Blocks are
taken one at a time as the scheduler needs them (:meth:`TieredPrefixCache.grow`); a freed cached
block stays on the GPU as an *evictable* block until a new block needs its room. Eviction takes
the oldest-freed evictable block, and a request frees its blocks deepest first, as vLLM does.

Retention (the cache-pollution guard): every cached block carries a retention priority (0 … 100,
higher kept longer; :data:`DEFAULT_RETENTION` for ordinary requests). The rule: a block's retention
is the highest retention of the requests that computed it, computed a duplicate of it, hit it on
the GPU or loaded it back from a tier, for as long as some tier keeps it; a request never lowers
it (a block dropped from every tier forgets it). Evictable GPU blocks of the lowest retention go
first, oldest-freed first within one retention; the CPU and disk tiers keep each block's retention
and evict the same way, and a block offloaded into a full tier whose blocks all have a higher
retention goes down a tier (or is dropped) instead of pushing one of them out. So a batch request
at retention 0 evicts its own blocks before any interactive prefix, on every tier, while its hits
on shared prefixes leave those prefixes' retention alone, and an interactive request touching a
batch block raises it to its own. TensorRT-LLM's ``KvCacheRetentionConfig`` has the same range and
default and evicts by priority on both its memory levels; vLLM's block pool is plain LRU today
(docs/engine-simulator.md says what it offers).

Tiers: an optional CPU tier receiving GPU evictions (write-back offload) and an optional disk tier
receiving CPU evictions. A request reuses the longest run of blocks from block 0 found on GPU, then
continues the run on CPU or disk (loaded back, costing step time, and cached on GPU again; a block of
that run still cached on GPU, its parent evicted first, is loaded into an uncached duplicate, as
vLLM's offloading connector loads the whole run after the GPU prefix hit). At most
``num_tokens - 1`` tokens count as cached, as vLLM always recomputes the last token.

KV events are collected as the cache changes and sent as one batch per engine step
(:meth:`TieredPrefixCache.flush`), as vLLM publishes them.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2

from engine_twin.kv_events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


def sha256_cbor(value: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the canonical CBOR encoding of ``value`` (32 bytes)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(seed: str | None) -> bytes:
    """vLLM's ``NONE_HASH``: ``sha256_cbor(seed)``; ``PYTHONHASHSEED`` when ``seed`` is None; random
    32 bytes when both are missing (vLLM's behaviour, non-reproducible across processes)."""
    seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED")
    return sha256_cbor(seed) if seed is not None else os.urandom(32)


def hash_block_tokens(parent: bytes, tokens: Sequence[int], extra_keys: tuple | None = None) -> bytes:
    """Hash of one full block chained on ``parent`` (``NONE_HASH`` for block 0)."""
    return sha256_cbor((parent, tuple(tokens), extra_keys))


def block_hashes(tokens: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """Chained hashes of every full block of ``tokens`` (a trailing partial block is not hashed)."""
    out: list[bytes] = []
    parent = root
    dumps, sha = cbor2.dumps, hashlib.sha256
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = sha(dumps((parent, tuple(tokens[start:start + block_size]), None), canonical=True)).digest()
        out.append(parent)
    return out


def external_hash(block_hash: bytes) -> int:
    """The uint64 vLLM puts in KV events for a 32-byte hash: its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


DEFAULT_RETENTION = 35
"""Retention priority of ordinary requests: TensorRT-LLM's default (``KvCacheRetentionConfig``, 0 … 100)."""
LOWEST_RETENTION = 0

Block = bytes | None


class RetentionQueues:
    """Blocks grouped by retention, each group in least-recently-used order: :meth:`pop_lowest`
    takes the oldest block of the lowest retention. Membership and updates are O(1); the lowest
    retention is found among the few distinct levels in use."""

    def __init__(self) -> None:
        self._queues: dict[int, OrderedDict[bytes, None]] = {}
        self._level: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._level)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._level

    def level(self, block_hash: bytes) -> int | None:
        """Retention of a held block (None when not held)."""
        return self._level.get(block_hash)

    def put(self, block_hash: bytes, level: int) -> None:
        """Hold ``block_hash`` at ``level`` as the most recently used of that level (moving it there
        when already held)."""
        old = self._level.get(block_hash)
        if old is not None:
            del self._queues[old][block_hash]
        self._level[block_hash] = level
        queue = self._queues.get(level)
        if queue is None:
            queue = self._queues[level] = OrderedDict()
        queue[block_hash] = None

    def lowest(self) -> int | None:
        """The lowest retention held (None when empty)."""
        levels = [level for level, queue in self._queues.items() if queue]
        return min(levels) if levels else None

    def pop_lowest(self) -> tuple[bytes, int]:
        """Remove and return the oldest block of the lowest retention (raises KeyError when empty)."""
        level = self.lowest()
        if level is None:
            raise KeyError("no blocks held")
        block_hash, _ = self._queues[level].popitem(last=False)
        del self._level[block_hash]
        return block_hash, level

    def clear(self) -> None:
        self._queues.clear()
        self._level.clear()
"""One entry of a request's block table: the block hash when cached, None for an uncached block."""


@dataclass
class CacheStats:
    """Counters since start, read by the metrics collector and the step model. Tokens for queries
    and hits (first schedule of a request only, as vLLM's ``PrefixCacheStats`` counts them), blocks
    for the rest."""

    queries_tokens: int = 0
    hits_tokens: int = 0
    external_hits_tokens: int = 0
    gpu_evictions: int = 0
    cpu_evictions: int = 0
    cpu_stores: int = 0
    disk_stores: int = 0
    connector_queries_tokens: int = 0
    """Tokens a KV connector was asked for (NixlConnector: prompt tokens not cached locally), as vLLM's
    ``connector_prefix_cache_stats``."""
    connector_hits_tokens: int = 0
    """Tokens a KV connector supplied (NixlConnector: the tokens read from the prefill engine)."""


@dataclass(slots=True)
class Hits:
    """Cached blocks found for a request, from block 0: first on GPU, then on CPU or disk."""

    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    tier_hashes: list[bytes] = field(default_factory=list)

    @property
    def blocks(self) -> int:
        return self.gpu + self.cpu + self.disk


class TieredPrefixCache:
    """GPU blocks with retention-then-LRU eviction plus optional CPU and disk tiers.

    ``sink(events)`` receives each step's :mod:`kv_events` events (never an empty list) when
    :meth:`flush` is called. Pure and single-threaded: no I/O besides the sink, no clock.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, cpu_blocks: int = 0, disk_blocks: int = 0,
                 sink: Callable[[list[KVEvent]], None] | None = None):
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.cpu_capacity = cpu_blocks
        self.disk_capacity = disk_blocks
        self._sink = sink
        self._ref: dict[bytes, int] = {}  # cached GPU block -> requests holding it
        self._retention: dict[bytes, int] = {}
        self._free: dict[int, OrderedDict[bytes, None]] = {}  # evictable cached blocks by retention
        self._free_count = 0
        self._uncached = 0  # GPU blocks held without a hash
        self._cpu = RetentionQueues()
        self._disk = RetentionQueues()
        self._events: list[KVEvent] = []
        self.stats = CacheStats()

    # ---- views -----------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks held by requests (vLLM's ``kv_cache_usage_perc`` numerator)."""
        return len(self._ref) - self._free_count + self._uncached

    @property
    def usage(self) -> float:
        """Share of GPU blocks held by requests, 0..1."""
        return self.used_blocks / self.num_gpu_blocks

    def available(self) -> int:
        """GPU blocks a request could take now (empty plus evictable)."""
        return self.num_gpu_blocks - self.used_blocks

    def tier_of(self, block_hash: bytes) -> str | None:
        """``"GPU"``, ``"CPU"``, ``"DISK"`` or None: the fastest tier holding the block."""
        if block_hash in self._ref:
            return MEDIUM_GPU
        if block_hash in self._cpu:
            return MEDIUM_CPU
        if block_hash in self._disk:
            return MEDIUM_DISK
        return None

    def retention_of(self, block_hash: bytes) -> int | None:
        """Retention priority of a cached block: on GPU, else on CPU, else on disk (None when on none)."""
        level = self._retention.get(block_hash)
        if level is None:
            level = self._cpu.level(block_hash)
        if level is None:
            level = self._disk.level(block_hash)
        return level

    def sizes(self) -> dict[str, int]:
        """Blocks per tier (GPU counts cached blocks, held or evictable)."""
        return {MEDIUM_GPU: len(self._ref), MEDIUM_CPU: len(self._cpu), MEDIUM_DISK: len(self._disk)}

    # ---- scheduling ------------------------------------------------------------------------
    def find_hits(self, hashes: Sequence[bytes], max_blocks: int) -> Hits:
        """The longest run of cached blocks from block 0, at most ``max_blocks`` (no change made)."""
        hits = Hits()
        limit = min(len(hashes), max_blocks)
        ref = self._ref
        i = 0
        while i < limit and hashes[i] in ref:
            i += 1
        hits.gpu = i
        if self.cpu_capacity or self.disk_capacity:
            while i < limit:
                h = hashes[i]
                if h in self._cpu:
                    hits.cpu += 1
                elif h in self._disk:
                    hits.disk += 1
                else:
                    break
                hits.tier_hashes.append(h)
                i += 1
        return hits

    def admit(self, hashes: Sequence[bytes], hits: Hits, new_blocks: int, tokens: Sequence[int],
              retention: int) -> list[Block] | None:
        """Block table of a request being scheduled from the waiting queue: its GPU hits pinned, its
        CPU/disk hits loaded back (cached on GPU again, ``BlockStored`` GPU, at the higher of the
        tier's retention and ``retention``), ``new_blocks`` uncached blocks for the tokens it computes
        this step. None, changing nothing, when the room is short.

        A CPU/disk hit whose block is also cached on GPU (past the GPU prefix hit: its parent was
        evicted first) is loaded into a new block all the same, kept as an uncached duplicate
        whose cached copy's retention rises to the load's, as :meth:`commit` keeps a duplicate; the
        cached copy's reference count and evictable state are left alone. That is vLLM's order:
        ``KVCacheManager.get_computed_blocks`` takes the GPU prefix hit (``BlockPool.touch``
        pins it, taking evictable blocks off the free queue), then the offloading connector's
        ``get_num_new_matched_tokens`` looks up the blocks from there on in its store only, and the
        loaded tokens go to blocks newly allocated by ``allocate_slots``; ``BlockPool`` does not
        de-duplicate cached blocks (``vllm/v1/core/block_pool.py``,
        ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``)."""
        gpu = hashes[:hits.gpu]
        pinned_evictable = sum(1 for h in gpu if self._ref[h] == 0)
        if len(hits.tier_hashes) + new_blocks > self.available() - pinned_evictable:
            return None
        for h in gpu:
            self._pin(h, retention)
        table: list[Block] = list(gpu)
        for i, h in enumerate(hits.tier_hashes, hits.gpu):
            self._take_block()
            level = retention
            for tier in (self._cpu, self._disk):
                kept = tier.level(h)
                if kept is not None:
                    level = max(level, kept)
                    tier.put(h, level)  # most recently used there too
            if h in self._ref:  # cached on GPU too: the loaded block is an uncached duplicate
                if level > self._retention[h]:
                    self._raise(h, level)
                self._uncached += 1
                table.append(None)
                continue
            self._ref[h] = 1
            self._retention[h] = level
            self._stored(hashes, i, i + 1, tokens)
            table.append(h)
        self._uncached += new_blocks
        self._take_room(new_blocks)
        table.extend([None] * new_blocks)
        return table

    def grow(self, table: list[Block], blocks: int) -> bool:
        """Append ``blocks`` uncached blocks to ``table``; False, changing nothing, when short."""
        if blocks > self.available():
            return False
        self._uncached += blocks
        self._take_room(blocks)
        table.extend([None] * blocks)
        return True

    def commit(self, table: list[Block], start: int, end: int, hashes: Sequence[bytes], tokens: Sequence[int],
               retention: int) -> None:
        """Blocks ``start`` … ``end - 1`` of ``table`` now hold computed prompt tokens: cache them under
        their ``hashes`` (one ``BlockStored`` per contiguous run). A block another request cached
        meanwhile stays an uncached duplicate, as vLLM keeps the first copy; the cached copy's
        retention rises to ``retention`` when that is higher (this request computed it too)."""
        ref, keep = self._ref, self._retention
        run_start = -1
        for i in range(start, end):
            h = hashes[i]
            if table[i] is not None or h in ref:
                if table[i] is None and retention > keep[h]:
                    self._raise(h, retention)
                if run_start >= 0:
                    self._stored(hashes, run_start, i, tokens)
                    run_start = -1
                continue
            table[i] = h
            ref[h] = 1
            keep[h] = retention
            self._uncached -= 1
            if run_start < 0:
                run_start = i
        if run_start >= 0:
            self._stored(hashes, run_start, end, tokens)

    def free(self, table: list[Block]) -> None:
        """Release every block of ``table`` (deepest first) and empty it; cached blocks stay evictable."""
        for h in reversed(table):
            if h is None:
                self._uncached -= 1
                continue
            ref = self._ref[h] - 1
            self._ref[h] = ref
            if ref == 0:
                level = self._retention[h]
                queue = self._free.get(level)
                if queue is None:
                    queue = self._free[level] = OrderedDict()
                queue[h] = None
                self._free_count += 1
        table.clear()

    def record_query(self, tokens: int, gpu_hit_blocks: int, external_hit_blocks: int) -> None:
        """Count a first schedule's lookup (vLLM's prefix-cache queries and hits, in tokens)."""
        self.stats.queries_tokens += tokens
        self.stats.hits_tokens += gpu_hit_blocks * self.block_size
        self.stats.external_hits_tokens += external_hit_blocks * self.block_size

    def flush(self) -> None:
        """Send the events collected since the last flush as one batch (one engine step's)."""
        if self._events:
            events, self._events = self._events, []
            if self._sink is not None:
                self._sink(events)

    def clear(self) -> bool:
        """Drop every cached block on every tier (vLLM ``/reset_prefix_cache``); emits
        ``AllBlocksCleared``. Returns False, changing nothing, while requests hold blocks."""
        if self.used_blocks:
            return False
        self._ref.clear()
        self._retention.clear()
        self._free.clear()
        self._free_count = 0
        self._cpu.clear()
        self._disk.clear()
        self.flush()
        self._events.append(AllBlocksCleared())
        self.flush()
        return True

    # ---- internals -------------------------------------------------------------------------
    def _pin(self, h: bytes, retention: int) -> None:
        ref = self._ref[h]
        if ref == 0:
            del self._free[self._retention[h]][h]
            self._free_count -= 1
        self._ref[h] = ref + 1
        if retention > self._retention[h]:
            self._retention[h] = retention

    def _raise(self, h: bytes, retention: int) -> None:
        """Raise a cached GPU block's retention (an evictable one moves to its new level's queue, as
        the most recently freed there)."""
        old = self._retention[h]
        self._retention[h] = retention
        if self._ref[h] == 0:
            del self._free[old][h]
            queue = self._free.get(retention)
            if queue is None:
                queue = self._free[retention] = OrderedDict()
            queue[h] = None

    def _take_room(self, blocks: int) -> None:
        """Evict until ``blocks`` just-counted uncached blocks fit beside the cached ones."""
        over = len(self._ref) + self._uncached - self.num_gpu_blocks
        if over > 0:
            self._evict(over)

    def _take_block(self) -> None:
        """Make room for one more cached block."""
        if len(self._ref) + self._uncached >= self.num_gpu_blocks:
            self._evict(1)

    def _stored(self, hashes: Sequence[bytes], start: int, end: int, tokens: Sequence[int]) -> None:
        """``BlockStored`` (GPU) for blocks ``start`` … ``end - 1``, merged into the previous event when
        it continues it."""
        bs = self.block_size
        ext = [int.from_bytes(h[-8:], "big") for h in hashes[start:end]]
        parent = external_hash(hashes[start - 1]) if start else None
        block_tokens = list(tokens[start * bs:end * bs])
        last = self._events[-1] if self._events else None
        if (isinstance(last, BlockStored) and last.medium == MEDIUM_GPU and parent is not None
                and last.block_hashes[-1] == parent):
            last.block_hashes.extend(ext)
            last.token_ids.extend(block_tokens)
            return
        self._events.append(BlockStored(ext, parent, block_tokens, bs))

    def _evict(self, count: int) -> None:
        """Evict ``count`` evictable blocks: lowest retention first, oldest-freed first within one."""
        events, ref, keep = self._events, self._ref, self._retention
        for level in sorted(self._free):
            queue = self._free[level]
            while count and queue:
                h, _ = queue.popitem(last=False)
                count -= 1
                self._free_count -= 1
                del ref[h]
                del keep[h]
                self.stats.gpu_evictions += 1
                events.append(BlockRemoved([int.from_bytes(h[-8:], "big")], MEDIUM_GPU))
                if self.cpu_capacity:
                    self._offload(h, level, self._cpu, self.cpu_capacity, MEDIUM_CPU)
            if not count:
                return

    def _offload(self, h: bytes, level: int, tier: RetentionQueues, capacity: int, medium: str) -> None:
        """Write block ``h`` (retention ``level``) into ``tier``, evicting the tier's oldest block of the
        lowest retention when full (a CPU eviction goes on to disk). When every block there has a
        higher retention, ``h`` itself is the one that goes: on to disk from CPU, else dropped."""
        kept = tier.level(h)
        if kept is not None:
            tier.put(h, max(kept, level))
            return
        if len(tier) >= capacity:
            lowest = tier.lowest()
            if lowest is not None and level < lowest:
                if tier is self._cpu and self.disk_capacity:
                    self._offload(h, level, self._disk, self.disk_capacity, MEDIUM_DISK)
                return
            old, old_level = tier.pop_lowest()
            self._events.append(BlockRemoved([external_hash(old)], medium))
            if tier is self._cpu:
                self.stats.cpu_evictions += 1
                if self.disk_capacity:
                    self._offload(old, old_level, self._disk, self.disk_capacity, MEDIUM_DISK)
        tier.put(h, level)
        if tier is self._cpu:
            self.stats.cpu_stores += 1
        else:
            self.stats.disk_stores += 1
        self._events.append(BlockStored([external_hash(h)], None, [], self.block_size, medium))
