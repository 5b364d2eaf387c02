"""Retention in vLLM's GPU block pool: blocks only background requests wrote or read go first.

vLLM's ``BlockPool`` (``vllm/v1/core/block_pool.py``) keeps its free blocks, cached ones included, in
one ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``) and evicts from its head: plain
LRU (``free_blocks`` appends a freed request's cached blocks tail first; uncached blocks are
prepended, reused first). :class:`TwoClassFreeQueue` stands in for that queue (same methods, so the
pool's code is unchanged) and holds two of vLLM's own queues: *background-only* blocks, evicted
first, and blocks a foreground request wrote or read. Each keeps vLLM's LRU order.

The rule is the engine twin's retention rule (``engine_twin/kv_cache.py``, docs/engine-simulator.md
"KV retention") with two levels: a block is *foreground* once a foreground request held it (computed
it or hit it), for as long as it stays cached; no request lowers it; reuse of the block for new
content forgets it. The scheduler marks a request's blocks when the request frees them
(:meth:`TwoClassFreeQueue.mark_foreground`, called before vLLM's ``free``), so a block freed last by a
background request still goes to the foreground queue when a foreground request held it earlier.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

BACKGROUND = "background"
FOREGROUND = "foreground"


class TwoClassFreeQueue:
    """A drop-in ``FreeKVCacheBlockQueue``: background-only blocks ahead of foreground ones.

    ``num_blocks``: the pool's block count (block ids are ``0 … num_blocks − 1``). ``evictions``:
    cached blocks handed out for reuse, by class (``background`` / ``foreground``), since start."""

    def __init__(self, existing: FreeKVCacheBlockQueue, num_blocks: int) -> None:
        # vLLM's queue as built (every block free, none cached) becomes the background queue.
        self.background = existing
        self.foreground = FreeKVCacheBlockQueue([])
        self._marked = bytearray(num_blocks)  # 1: a foreground request wrote or read it
        self._in_foreground = bytearray(num_blocks)  # 1: the block sits in the foreground queue
        self.evictions = {BACKGROUND: 0, FOREGROUND: 0}

    # ---- marks ---------------------------------------------------------------------------------
    def mark_foreground(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Record that a foreground request held ``blocks`` (called as it frees them)."""
        marked = self._marked
        for block in blocks:
            if block.block_id >= 0 and not block.is_null:
                marked[block.block_id] = 1

    def is_foreground(self, block: KVCacheBlock) -> bool:
        """Whether a foreground request wrote or read ``block`` since it was last reused."""
        return bool(self._marked[block.block_id])

    # ---- FreeKVCacheBlockQueue's interface ------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Free blocks in both queues."""
        return self.background.num_free_blocks + self.foreground.num_free_blocks

    def _taken(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Blocks leaving the free queues for reuse: count cached ones as evictions, forget marks."""
        marked, in_fg = self._marked, self._in_foreground
        for block in blocks:
            bid = block.block_id
            if block.block_hash is not None:
                self.evictions[FOREGROUND if marked[bid] else BACKGROUND] += 1
            marked[bid] = 0
            in_fg[bid] = 0
        return blocks

    def popleft(self) -> KVCacheBlock:
        """The next block to reuse: the background queue's head, else the foreground queue's."""
        queue = self.background if self.background.num_free_blocks else self.foreground
        return self._taken([queue.popleft()])[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The next ``n`` blocks to reuse, background-only ones first (``n`` ≤ ``num_free_blocks``)."""
        from_bg = min(n, self.background.num_free_blocks)
        blocks = self.background.popleft_n(from_bg)
        if n > from_bg:
            blocks += self.foreground.popleft_n(n - from_bg)
        return self._taken(blocks)

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of its queue (a prefix hit on a free block); its mark stays."""
        if self._in_foreground[block.block_id]:
            self._in_foreground[block.block_id] = 0
            self.foreground.remove(block)
        else:
            self.background.remove(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail of its class's queue."""
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` (in order) at the tails of their classes' queues."""
        marked = self._marked
        fg = [b for b in blocks if marked[b.block_id]]
        if not fg:
            self.background.append_n(blocks)
            return
        self.background.append_n([b for b in blocks if not marked[b.block_id]])
        for block in fg:
            self._in_foreground[block.block_id] = 1
        self.foreground.append_n(fg)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Uncached blocks (vLLM reuses them first): the head of the background queue; nothing of
        theirs can be hit, so their marks are forgotten."""
        for block in blocks:
            self._marked[block.block_id] = 0
        self.background.prepend_n(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block in eviction order."""
        return self.background.get_all_free_blocks() + self.foreground.get_all_free_blocks()

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order after ``cursor`` (None: from the first)."""
        if cursor is not None and self._in_foreground[cursor.block_id]:
            return self.foreground.iter_blocks_after(cursor)
        return chain(self.background.iter_blocks_after(cursor), self.foreground.iter_blocks_after(None))


def install(block_pool: Any) -> TwoClassFreeQueue:
    """Replace ``block_pool.free_block_queue`` (a fresh vLLM ``BlockPool``) by a
    :class:`TwoClassFreeQueue` holding the same blocks in the same order; returns it."""
    current = block_pool.free_block_queue
    if isinstance(current, TwoClassFreeQueue):
        return current
    queue = TwoClassFreeQueue(current, len(block_pool.blocks))
    block_pool.free_block_queue = queue
    return queue
