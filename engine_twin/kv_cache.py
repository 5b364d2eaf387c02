"""The simulated engine's prefix cache: vLLM's chained block hashes and GPU / CPU / disk tiers.

Hashing (vLLM ``vllm/v1/core/kv_cache_utils.py`` with ``--prefix-caching-hash-algo sha256_cbor``):

* ``sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True))`` (32 bytes);
* ``NONE_HASH = sha256_cbor(seed)`` where ``seed`` is the ``PYTHONHASHSEED`` string (our
  ``--hash-seed``, falling back to ``PYTHONHASHSEED``); 32 random bytes when neither is set;
* block ``i`` of a prompt (full blocks only) hashes ``(parent, tuple(tokens_i), extra_keys)`` with
  ``parent = NONE_HASH`` for block 0 and the previous block's hash after that;
* events carry ``int.from_bytes(h, "big") & (2**64 - 1)`` (the last 8 bytes), see :func:`external_hash`.

Tiers: ``num_gpu_blocks`` GPU blocks (pinned while a request runs; free cached blocks are evicted
LRU, the deepest block of a finished request first, as vLLM frees blocks in reverse order); an
optional CPU tier receiving GPU evictions (write-back offload), and an optional disk tier receiving
CPU evictions. A request reuses the longest run of blocks from block 0 found on GPU, then continues
the run on CPU or disk (loaded back, costing load time, and cached on GPU again). At most
``prompt_len - 1`` tokens count as cached, as vLLM always recomputes the last prompt token.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


@dataclass(slots=True)
class Allocation:
    """Blocks one running request holds. Hit counts are in blocks (multiply by block size)."""

    pinned: list[bytes]
    unhashed: int
    gpu_hits: int
    cpu_hits: int
    disk_hits: int
    released: bool = False

    @property
    def cached_blocks(self) -> int:
        return self.gpu_hits + self.cpu_hits + self.disk_hits


@dataclass
class CacheStats:
    """Counters since start (tokens), read by the metrics collector."""

    queries_tokens: int = 0
    hits_tokens: int = 0
    external_hits_tokens: int = 0
    gpu_evictions: int = 0
    cpu_evictions: int = 0


class TieredPrefixCache:
    """GPU blocks with LRU eviction plus optional CPU and disk tiers; emits KV events to ``sink``.

    ``sink(events)`` is called once per operation with the list of :mod:`kv_events` events (never
    with an empty list). Not thread-safe: call from the event loop only.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, cpu_blocks: int = 0, disk_blocks: int = 0,
                 sink: Callable[[list[KVEvent]], None] | None = None):
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.cpu_capacity = cpu_blocks
        self.disk_capacity = disk_blocks
        self._sink = sink
        self._gpu: dict[bytes, int] = {}  # block hash -> requests holding it
        self._free_lru: OrderedDict[bytes, None] = OrderedDict()
        self._unhashed = 0
        self._cpu: OrderedDict[bytes, None] = OrderedDict()
        self._disk: OrderedDict[bytes, None] = OrderedDict()
        self.stats = CacheStats()

    # ---- views -----------------------------------------------------------------------------
    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (vLLM's ``kv_cache_usage_perc`` numerator)."""
        return len(self._gpu) - len(self._free_lru) + self._unhashed

    @property
    def usage(self) -> float:
        """Share of GPU blocks held by running requests, 0..1."""
        return self.used_blocks / self.num_gpu_blocks

    def available(self) -> int:
        """GPU blocks a new request could get now (empty plus evictable)."""
        return self.num_gpu_blocks - self.used_blocks

    def tier_of(self, block_hash: bytes) -> str | None:
        """``"GPU"``, ``"CPU"``, ``"DISK"`` or None: the fastest tier holding the block."""
        if block_hash in self._gpu:
            return MEDIUM_GPU
        if block_hash in self._cpu:
            return MEDIUM_CPU
        if block_hash in self._disk:
            return MEDIUM_DISK
        return None

    def sizes(self) -> dict[str, int]:
        """Blocks per tier (GPU counts cached and in-use hashed blocks)."""
        return {MEDIUM_GPU: len(self._gpu), MEDIUM_CPU: len(self._cpu), MEDIUM_DISK: len(self._disk)}

    # ---- allocation ------------------------------------------------------------------------
    def allocate(self, hashes: list[bytes], tokens: Sequence[int], total_blocks: int,
                 prompt_len: int) -> Allocation | None:
        """Reserve ``total_blocks`` GPU blocks for a request whose full prompt blocks are ``hashes``.

        Returns None (nothing changed) when not enough blocks can be freed; the caller waits.
        ``tokens`` are the prompt tokens (for ``BlockStored.token_ids``); ``prompt_len`` caps hits
        at ``prompt_len - 1`` tokens. Emits ``BlockStored`` (GPU) for newly cached blocks, and
        ``BlockRemoved`` / offload events for the evictions this causes.
        """
        gpu_hits = 0
        for h in hashes:
            if h not in self._gpu:
                break
            gpu_hits += 1
        cpu_hits = disk_hits = 0
        for h in hashes[gpu_hits:]:
            if h in self._cpu:
                cpu_hits += 1
            elif h in self._disk:
                disk_hits += 1
            else:
                break
        present = [h in self._gpu for h in hashes]
        new_blocks = total_blocks - sum(present)
        pinned_free = sum(1 for h, p in zip(hashes, present) if p and self._gpu[h] == 0)
        if new_blocks > self.available() - pinned_free:
            return None
        events: list[KVEvent] = []
        for h, p in zip(hashes, present):
            if p:
                if self._gpu[h] == 0:
                    del self._free_lru[h]
                self._gpu[h] += 1
        empty = self.num_gpu_blocks - len(self._gpu) - self._unhashed
        for _ in range(new_blocks - empty):
            self._evict_one(events)
        run: list[int] = []
        for i, h in enumerate(hashes):
            if present[i]:
                self._store_run(run, hashes, tokens, events)
                run = []
                continue
            self._gpu[h] = 1
            for tier in (self._cpu, self._disk):
                if h in tier:
                    tier.move_to_end(h)
            run.append(i)
        self._store_run(run, hashes, tokens, events)
        self._unhashed += total_blocks - len(hashes)
        # vLLM recomputes at least the last prompt token: cap hits at prompt_len - 1 tokens.
        bs = self.block_size
        cap = (prompt_len - 1) // bs
        gpu_c = min(gpu_hits, cap)
        cpu_c = min(cpu_hits, cap - gpu_c)
        disk_c = min(disk_hits, cap - gpu_c - cpu_c)
        self.stats.queries_tokens += prompt_len
        self.stats.hits_tokens += gpu_c * bs
        self.stats.external_hits_tokens += (cpu_c + disk_c) * bs
        self._emit(events)
        return Allocation(list(hashes), total_blocks - len(hashes), gpu_c, cpu_c, disk_c)

    def release(self, alloc: Allocation) -> None:
        """Unpin a request's blocks (idempotent); they stay cached and become evictable, deepest first."""
        if alloc.released:
            return
        alloc.released = True
        for h in reversed(alloc.pinned):
            ref = self._gpu.get(h)
            if ref is None:
                continue
            self._gpu[h] = ref - 1
            if ref == 1:
                self._free_lru[h] = None
        self._unhashed -= alloc.unhashed

    def clear(self) -> bool:
        """Drop every cached block on every tier (vLLM ``/reset_prefix_cache``); emits
        ``AllBlocksCleared``. Returns False, changing nothing, while requests hold blocks."""
        if self.used_blocks:
            return False
        self._gpu.clear()
        self._free_lru.clear()
        self._cpu.clear()
        self._disk.clear()
        self._emit([AllBlocksCleared()])
        return True

    # ---- internals -------------------------------------------------------------------------
    def _store_run(self, run: list[int], hashes: list[bytes], tokens: Sequence[int],
                   events: list[KVEvent]) -> None:
        """One ``BlockStored`` (GPU) for a contiguous run of newly cached block indexes."""
        if not run:
            return
        bs, first = self.block_size, run[0]
        events.append(BlockStored(
            [external_hash(hashes[i]) for i in run],
            external_hash(hashes[first - 1]) if first else None,
            list(tokens[first * bs:(run[-1] + 1) * bs]),
            bs,
        ))

    def _evict_one(self, events: list[KVEvent]) -> None:
        h, _ = self._free_lru.popitem(last=False)
        del self._gpu[h]
        self.stats.gpu_evictions += 1
        events.append(BlockRemoved([external_hash(h)], MEDIUM_GPU))
        if self.cpu_capacity:
            self._offload(h, self._cpu, self.cpu_capacity, MEDIUM_CPU, events)

    def _offload(self, h: bytes, tier: OrderedDict[bytes, None], capacity: int, medium: str,
                 events: list[KVEvent]) -> None:
        if h in tier:
            tier.move_to_end(h)
            return
        if len(tier) >= capacity:
            old, _ = tier.popitem(last=False)
            events.append(BlockRemoved([external_hash(old)], medium))
            if tier is self._cpu:
                self.stats.cpu_evictions += 1
                if self.disk_capacity:
                    self._offload(old, self._disk, self.disk_capacity, MEDIUM_DISK, events)
        tier[h] = None
        events.append(BlockStored([external_hash(h)], None, [], self.block_size, medium))

    def _emit(self, events: list[KVEvent]) -> None:
        if events and self._sink is not None:
            self._sink(events)
