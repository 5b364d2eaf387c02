"""The precise prefix index: which endpoint holds which prompt blocks, from the engines' KV events.

llm-d's dual-key design (its ``kvcache/kvblock`` index): the engine's block hashes are not
reproduced; each ``BlockStored`` carries its ``token_ids``, from which the index computes OUR block
keys (:mod:`router.scheduling.hashing`, the keys the scheduler hashes prompts into) and keeps an
engine-hash → our-keys map per endpoint to apply later removals and offloaded copies.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import Any

from router.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from router.scheduling.hashing import MIN_BLOCK_SIZE_TOKENS, chain_seed, chained_keys, tokens_to_bytes
from router.scheduling.interfaces import TIER_CPU, TIER_DISK, TIER_GPU

#: Tier names by position in an index entry, fastest first.
TIERS = (TIER_GPU, TIER_CPU, TIER_DISK)
_TIER_OF_MEDIUM = {TIER_GPU: 0, TIER_CPU: 1, TIER_DISK: 2}
_SPEC = 3  # position of the speculative bits in an entry
#: An index entry, ``(gpu, cpu, disk, speculative)`` bitsets over endpoint slots: a tuple of ints,
#: replaced on change, so the garbage collector does not track it (see ``_EngineBlock``).
_Entry = tuple[int, int, int, int]
_EMPTY: _Entry = (0, 0, 0, 0)
_NO_KEYS: tuple[int, ...] = ()

#: Default cap on our block keys, 2**18 = 262,144 (16 Mi tokens at 64 per key): room for 16
#: engines with the simulator's default 8192 GPU blocks of 16 tokens plus a CPU tier 4 times that
#: (16 x 5 x 8192 x 16 / 64 = 163,840 keys). At most 43 MiB of keys plus 257 MiB of engine block
#: states at the default engine cap (see :class:`KVBlockIndex` for the per-block cost).
DEFAULT_MAX_BLOCKS = 1 << 18
#: Engine block states kept per our-key allowed by ``max_blocks`` when ``max_engine_blocks`` is not
#: given: 64-token keys over 16-token engine blocks (GPU vLLM's default block size) = 4.
ENGINE_BLOCKS_PER_BLOCK = 4

#: Engine blocks kept per endpoint after they left every tier, so that a ``BlockStored`` (CPU, no
#: tokens) arriving after its GPU ``BlockRemoved`` — the simulator's order, and possible across
#: vLLM's scheduler and offload-connector events — still finds the block, as does a child stored
#: on it. 4096 = 8 engine steps of vLLM's default 8192 batched tokens in 16-token blocks.
REMOVED_BLOCKS_KEPT = 4096

#: Bytes per our-key entry and per engine block state, measured with tracemalloc by
#: :func:`lab.bench.kv_index.measure_bytes` (CPython 3.11, 16 endpoints, 64-token keys; engine
#: blocks of 16 tokens, whose average includes the pending tokens of 3 in 4 blocks: 170-175 bytes
#: with 64- or 128-token engine blocks); used for ``stats()["approx_bytes"]``.
BYTES_PER_BLOCK = 173
BYTES_PER_ENGINE_BLOCK = 257


#: One engine block on one endpoint, a plain tuple ``(chain, pending, keys, tiers)``: ``chain``,
#: our key of the last full chunk at or before the block's end (the chain seed when none);
#: ``pending``, bytes of the tokens after that chunk (fewer than one chunk); ``keys``, our keys of
#: the chunks this block completes; ``tiers``, bit t set when the block is in ``TIERS[t]``. A tuple
#: of ints and bytes, not an object: the garbage collector stops tracking it, where hundreds of
#: thousands of slotted objects made every full collection walk them (a third of a simulated
#: precise run's wall time was the collector's).
_EngineBlock = tuple[int, bytes, tuple[int, ...], int]

class _BlockTable(dict[int, _EngineBlock]):
    """Engine block hash → state. A dict subclass on purpose: CPython untracks an exact dict
    whose values are all untracked (in full collections) and tracks it again, as a young object,
    on the next insert, so every young collection would walk the whole table; a subclass is never
    untracked and stays in the old generation."""

    __slots__ = ()


class _KeyTable(dict[int, "_Entry"]):
    """Our key → entry, least recently stored first; a dict subclass for :class:`_BlockTable`'s reason."""

    __slots__ = ()


#: Tier position of each medium as sent (exact spellings first; :func:`_tier_of` lowers the rest).
_TIER_OF_SENT: dict[str | None, int] = {None: 0, "": 0, "GPU": 0, "CPU": 1, "DISK": 2, "gpu": 0, "cpu": 1, "disk": 2}


def _tier_of(medium: str | None) -> int | None:
    """Tier position of an event's ``medium`` (None or empty: GPU), None for an unknown medium."""
    tier = _TIER_OF_SENT.get(medium)
    if tier is None:
        tier = _TIER_OF_MEDIUM.get((medium or TIER_GPU).lower())
    return tier


class _Endpoint:
    __slots__ = ("name", "slot", "bit", "blocks", "removed", "counts", "skip_groups")

    def __init__(self, name: str, slot: int) -> None:
        self.name = name
        self.slot = slot
        self.bit = 1 << slot
        self.blocks: dict[int, _EngineBlock] = _BlockTable()
        self.removed: dict[int, _EngineBlock] = _BlockTable()  # recently left every tier, oldest first
        self.counts = [0, 0, 0]  # our keys held per tier
        self.skip_groups: set[int] = set()


class KVBlockIndex:
    """Our block keys → the endpoints holding them, per tier; fed by :meth:`apply`.

    Implements :class:`~router.scheduling.interfaces.PrefixIndex` and ``add_speculative`` of
    :class:`~router.scheduling.plugins.prefix.SpeculativePrefixIndex`. Not thread-safe: use it from
    one event loop (the subscriber and the scheduler share the router's loop).

    Layout: ``key → [gpu, cpu, disk, speculative]``, four bitsets over endpoint slots (one bit per
    endpoint), so :meth:`longest_prefix` costs a few integer operations per block whatever the
    number of endpoints. Per endpoint: engine block hash → its state (``_EngineBlock``).

    Mapping engine blocks (``block_size`` tokens, 16 on GPU vLLM, 128 on its CPU build) to our
    chunks (``block_size_tokens``): the chain of a stored block continues from its parent's state
    (last key, tokens since the last chunk boundary); a block completes 0, 1 or several chunks, and
    each chunk follows the engine block that completes it: its tiers are that block's tiers. (vLLM
    frees a request's blocks deepest first, so the completing block goes before the chunk's earlier
    blocks; if an earlier one goes first the index over-reports that chunk until its completing
    block goes too.)

    * Seed of the chain: ``chain_seed(lora_name or model, cache_salt)``: a LoRA request names the
      adapter in its ``model`` field, so the router hashes it with the adapter's name. The salt is
      read from block 0's ``extra_keys`` (the one string that is not the LoRA name). Blocks whose
      extra keys hold anything else (multimodal hashes), or with a ``lora_id`` but no
      ``lora_name``, cannot be keyed like the router's prompts and are skipped (``skipped``).
    * A ``BlockStored`` for a known engine hash adds its medium's tier; without tokens for an
      unknown hash it is skipped; with tokens and an unknown parent it counts ``unknown_parents``
      and indexes nothing for that block and the rest of the event. "Known" includes the last
      :data:`REMOVED_BLOCKS_KEPT` blocks of the endpoint that left every tier, so an offloaded
      copy announced after the GPU removal (or a child stored on such a block) still resolves.
    * Mediums ``GPU``/``CPU``/``DISK`` (any case; None = GPU, as older vLLM had GPU only); others
      are skipped. Blocks of a KV cache group whose ``kv_cache_spec_kind`` is not
      ``full_attention`` (hybrid models' sliding-window groups) are skipped, and removals in those
      groups ignored.
    * Two engine blocks of one endpoint completing the same key (same tokens, extra keys we do not
      hash) share its bits: removing either clears them.

    Bounds: at most ``max_blocks`` keys — the least recently stored key is evicted (for every
    endpoint) past it; at most ``max_engine_blocks`` engine block states — past it the endpoint
    holding the most loses its least recently stored block, as if removed from every tier. With
    complete event streams the engines' own evictions keep the index at the fleet's cache size;
    the caps guard against missed removals (``seq_gaps``).

    Memory (tracemalloc, :func:`lab.bench.kv_index.measure_bytes`, CPython 3.11, 16
    endpoints): 173 bytes per our key (:data:`BYTES_PER_BLOCK`) plus 257 bytes per 16-token engine
    block state (:data:`BYTES_PER_ENGINE_BLOCK`; 175 with 128-token engine blocks), i.e. about
    1.2 KB per 64-token key held by one GPU-vLLM endpoint (4 engine blocks per key) and 0.26 KB
    per key with the CPU build's 128-token blocks (half an engine block per key). A key held by
    several endpoints costs its 173 bytes once, plus each endpoint's engine blocks.

    Speculative entries (:meth:`add_speculative`) count as GPU until their TTL (adding an entry
    again sets its TTL anew, shorter or longer); a real store, or removal, of the key on that
    endpoint replaces them. Expiry is lazy (checked on lookup) plus a sweep on each
    :meth:`apply` / :meth:`add_speculative`.

    :meth:`remove_endpoint` and ``AllBlocksCleared`` cost O(the endpoint's engine blocks).
    """

    def __init__(self, block_size_tokens: int = MIN_BLOCK_SIZE_TOKENS, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 max_engine_blocks: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        """Args:
            block_size_tokens: tokens per our block; must equal the precise producer's
                ``blockSizeTokens`` (default 64, ROUTING.md's minimum).
            max_blocks: cap on our keys (≥ 1).
            max_engine_blocks: cap on engine block states (≥ 1); default
                ``max_blocks × ENGINE_BLOCKS_PER_BLOCK``.
            clock: monotonic seconds, for speculative TTLs.

        Raises:
            ValueError: a size below 1.
        """
        if block_size_tokens < 1 or max_blocks < 1 or (max_engine_blocks is not None and max_engine_blocks < 1):
            raise ValueError("block_size_tokens, max_blocks and max_engine_blocks must be >= 1")
        self.block_size_tokens = block_size_tokens
        self.max_blocks = max_blocks
        self.max_engine_blocks = max_engine_blocks or max_blocks * ENGINE_BLOCKS_PER_BLOCK
        self._clock = clock
        self._chunk_bytes = block_size_tokens * 4  # hashing packs 4 bytes per token
        self._keys = _KeyTable()
        self._endpoints: dict[str, _Endpoint] = {}
        self._slot_names: list[str | None] = []
        self._free_slots: list[int] = []
        self._engine_blocks = 0
        self._spec_expiry: dict[int, dict[int, float]] = {}  # key -> slot -> expiry (clock seconds)
        self._spec_heap: list[tuple[float, int, int]] = []
        self._spec_heap_base = 0  # heap size after the last compaction
        self._seeds: dict[tuple[str, str | None], int] = {}
        self.decode_errors = 0
        self.unknown_parents = 0
        self.seq_gaps = 0
        self.skipped = 0
        self.evicted = 0

    # ---- lookups --------------------------------------------------------------------------
    def longest_prefix(self, model: str, block_keys: Sequence[int]) -> Mapping[str, tuple[int, str]]:
        """Per endpoint holding block 0: (consecutive blocks from block 0 it holds in any tier,
        the slowest tier along that run — ``"gpu"`` < ``"cpu"`` < ``"disk"``; a block on GPU and
        CPU counts as GPU). ``model`` is unused: the keys are seeded with it already."""
        if not block_keys:
            return {}
        get = self._keys.get
        entry = get(block_keys[0])
        if entry is None:
            return {}
        gpu, cpu, disk, spec = entry
        if spec:
            spec = self._live_spec(block_keys[0], entry)
        fast = gpu | spec
        alive = fast | cpu | disk
        slow_cpu = cpu & ~fast
        slow_disk = disk & ~fast & ~cpu
        out: dict[str, tuple[int, str]] = {}
        n = 1
        for key in islice(block_keys, 1, None):
            entry = get(key)
            if entry is None:
                break
            gpu, cpu, disk, spec = entry
            if spec:
                spec = self._live_spec(key, entry)
            fast = gpu | spec
            held = alive & (fast | cpu | disk)
            if held != alive:
                self._report(out, alive & ~held, n, slow_cpu, slow_disk)
                alive = held
                if not alive:
                    return out
            slow_cpu |= alive & cpu & ~fast
            slow_disk |= alive & disk & ~fast & ~cpu
            n += 1
        self._report(out, alive, n, slow_cpu, slow_disk)
        return out

    def longest_prefix_tiers(self, model: str, block_keys: Sequence[int]) -> Mapping[str, tuple[int, int, int]]:
        """Per endpoint holding block 0: its run of consecutive blocks from block 0 (the run of
        :meth:`longest_prefix`), counted by each block's fastest tier: ``(gpu, cpu, disk)`` blocks,
        a live speculative entry counting as GPU. So a 100-block run whose last block was offloaded
        is ``(99, 1, 0)``, where :meth:`longest_prefix` says ``(100, "cpu")``. ``model`` is unused."""
        out: dict[str, tuple[int, int, int]] = {}
        if not block_keys:
            return out
        get = self._keys.get
        names = self._slot_names
        counts: dict[int, list[int]] = {}  # slot -> [gpu, cpu, disk]
        alive = -1
        run = 0  # keys in a row with the same tier masks ``masks``
        masks = (0, 0, 0)
        for key in block_keys:
            entry = get(key)
            if entry is None:
                break
            gpu, cpu, disk, spec = entry
            if spec:
                spec = self._live_spec(key, entry)
            fast = gpu | spec
            held = fast | cpu | disk
            alive = held if alive == -1 else alive & held
            if not alive:
                break
            run_masks = (alive & fast, alive & cpu & ~fast, alive & disk & ~fast & ~cpu)
            if run_masks == masks:
                run += 1
                continue
            if run:
                _count_run(counts, masks, run)
            masks, run = run_masks, 1
        if run:
            _count_run(counts, masks, run)
        for slot, (g, c, d) in counts.items():
            out[names[slot]] = (g, c, d)  # type: ignore[index]  # live slots have names
        return out

    def _report(self, out: dict[str, tuple[int, str]], bits: int, n: int, slow_cpu: int, slow_disk: int) -> None:
        names = self._slot_names
        while bits:
            low = bits & -bits
            tier = TIER_DISK if slow_disk & low else TIER_CPU if slow_cpu & low else TIER_GPU
            out[names[low.bit_length() - 1]] = (n, tier)  # type: ignore[index]  # live slots have names
            bits ^= low

    def _live_spec(self, key: int, entry: _Entry) -> int:
        """The entry's speculative bits still within their TTL; expired ones are cleared (the
        entry of ``key``, which is in the index, is replaced, or dropped when no bit is left)."""
        gpu, cpu, disk, bits = entry
        expiry = self._spec_expiry.get(key)
        if expiry is None:
            self._keys[key] = (gpu, cpu, disk, 0)
            return 0
        now = self._clock()
        for slot, until in list(expiry.items()):
            if until <= now:
                del expiry[slot]
                bits &= ~(1 << slot)
        if not expiry:
            del self._spec_expiry[key]
        if not (bits or gpu or cpu or disk):
            del self._keys[key]
        elif bits != entry[_SPEC]:
            self._keys[key] = (gpu, cpu, disk, bits)
        return bits

    # ---- speculative entries --------------------------------------------------------------
    def add_speculative(self, model: str, endpoint_name: str, block_keys: Sequence[int], ttl_s: float) -> None:
        """Mark ``block_keys`` (our keys, block 0 first) as on ``endpoint_name``'s GPU for
        ``ttl_s`` seconds, unless real events say so first. ``model`` is unused (keys are seeded)."""
        ep = self._endpoint(endpoint_name)
        now = self._clock()
        until = now + ttl_s
        self._sweep_spec(now)
        bit, slot = ep.bit, ep.slot
        for key in block_keys:
            gpu, cpu, disk, spec = self._entry(key)
            if gpu & bit:
                continue  # already confirmed on GPU
            self._keys[key] = (gpu, cpu, disk, spec | bit)
            self._spec_expiry.setdefault(key, {})[slot] = until
            heapq.heappush(self._spec_heap, (until, key, slot))
        if len(self._spec_heap) > 2 * self._spec_heap_base + 4096:
            self._compact_spec_heap()

    def _compact_spec_heap(self) -> None:
        """Rebuild the expiry heap from the live expiries: a re-added entry (a hold shortened when
        its response completes) leaves its earlier heap item behind, so without this the heap
        would grow with every request held, not with the entries alive."""
        heap = [(until, key, slot) for key, slots in self._spec_expiry.items() for slot, until in slots.items()]
        heapq.heapify(heap)
        self._spec_heap = heap
        self._spec_heap_base = len(heap)

    def _sweep_spec(self, now: float) -> None:
        heap = self._spec_heap
        while heap and heap[0][0] <= now:
            _, key, slot = heapq.heappop(heap)
            expiry = self._spec_expiry.get(key)
            if expiry is not None and expiry.get(slot, now + 1) <= now:
                self._drop_spec(key, slot)

    def _drop_spec(self, key: int, slot: int) -> None:
        expiry = self._spec_expiry.get(key)
        if expiry is not None:
            expiry.pop(slot, None)
            if not expiry:
                del self._spec_expiry[key]
        entry = self._keys.get(key)
        if entry is not None:
            gpu, cpu, disk, spec = entry
            spec &= ~(1 << slot)
            if not (gpu or cpu or disk or spec):
                del self._keys[key]
            else:
                self._keys[key] = (gpu, cpu, disk, spec)

    # ---- events ---------------------------------------------------------------------------
    def apply(self, endpoint_name: str, model: str, events: Iterable[KVEvent]) -> None:
        """Apply one batch of ``endpoint_name``'s events, in order; ``model`` seeds the chain of
        blocks stored without a LoRA adapter. Never raises for event content (see the class
        docstring for what is skipped and counted)."""
        ep = self._endpoint(endpoint_name)
        for event in events:
            if isinstance(event, BlockStored):
                self._store(ep, model, event)
            elif isinstance(event, BlockRemoved):
                self._remove(ep, event)
            elif isinstance(event, AllBlocksCleared):
                self._clear(ep)
        if self._spec_heap:
            self._sweep_spec(self._clock())

    def remove_endpoint(self, endpoint_name: str) -> None:
        """Forget everything about ``endpoint_name`` (it died or left the pool); unknown names are
        ignored."""
        ep = self._endpoints.pop(endpoint_name, None)
        if ep is None:
            return
        self._clear(ep)
        self._slot_names[ep.slot] = None
        self._free_slots.append(ep.slot)

    def record_decode_error(self) -> None:
        """Count one message that could not be decoded (the subscriber calls this)."""
        self.decode_errors += 1

    def record_seq_gap(self, missed: int) -> None:
        """Count ``missed`` batches lost between two sequence numbers of one publisher."""
        self.seq_gaps += missed

    def _endpoint(self, name: str) -> _Endpoint:
        ep = self._endpoints.get(name)
        if ep is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_names[slot] = name
            else:
                slot = len(self._slot_names)
                self._slot_names.append(name)
            ep = self._endpoints[name] = _Endpoint(name, slot)
        return ep

    def _seed(self, model: str, salt: str | None) -> int:
        seed = self._seeds.get((model, salt))
        if seed is None:
            seed = self._seeds[(model, salt)] = chain_seed(model, salt)
        return seed

    def _store(self, ep: _Endpoint, model: str, event: BlockStored) -> None:
        tier = _tier_of(event.medium)
        hashes = event.block_hashes
        if tier is None or not _full_attention(ep, event):
            self.skipped += len(hashes)
            return
        tier_bit = 1 << tier
        blocks = ep.blocks
        removed = ep.removed
        tokens = event.token_ids
        size = event.block_size
        if tokens and (size <= 0 or len(tokens) != size * len(hashes)):
            self.skipped += len(hashes)
            return
        data = tokens_to_bytes(tokens) if tokens else b""
        chain: int | None = None
        pending = b""
        parent = event.parent_block_hash
        if tokens:
            if event.lora_id is not None and event.lora_name is None:
                self.skipped += len(hashes)
                return
            if parent is None:
                salt = _root_salt(event.extra_keys, event.lora_name)
                if salt is not False:
                    chain = self._seed(event.lora_name or model, salt)  # type: ignore[arg-type]
            else:
                state = blocks.get(parent) or removed.get(parent)
                if state is None:
                    self.unknown_parents += 1
                else:
                    chain, pending = state[0], state[1]
        step = size * 4
        chunk_bytes = self._chunk_bytes
        extra = event.extra_keys
        for i, engine_hash in enumerate(hashes):
            block = blocks.pop(engine_hash, None)
            if block is None and (block := removed.pop(engine_hash, None)) is not None:
                self._engine_blocks += 1
            if block is not None:  # known block: a copy in another tier, or stored again
                chain, pending, keys, tiers = block
                tiers |= tier_bit
                blocks[engine_hash] = (chain, pending, keys, tiers)  # most recently stored last
                if keys:
                    self._set_bits(ep, keys, tiers, touch=True)
                continue
            if chain is None or (extra is not None and (i or parent is not None)
                                 and not _plain_extra(extra, i, event.lora_name)):
                self.skipped += 1
                chain = None
                continue
            chunk = pending + data[i * step:(i + 1) * step]
            if len(chunk) >= chunk_bytes:
                key_list = chained_keys(chunk, chunk_bytes, chain)
                chain = key_list[-1]
                pending = chunk[len(key_list) * chunk_bytes:]
                key_tuple = tuple(key_list)
                blocks[engine_hash] = (chain, pending, key_tuple, tier_bit)
                self._engine_blocks += 1
                self._set_bits(ep, key_tuple, tier_bit, touch=True)
            else:
                pending = chunk
                blocks[engine_hash] = (chain, pending, _NO_KEYS, tier_bit)
                self._engine_blocks += 1
        if self._engine_blocks > self.max_engine_blocks:
            self._evict_engine_blocks()

    def _remove(self, ep: _Endpoint, event: BlockRemoved) -> None:
        tier = _tier_of(event.medium)
        if tier is None or (event.group_idx is not None and event.group_idx in ep.skip_groups):
            return
        tier_bit = 1 << tier
        blocks = ep.blocks
        for engine_hash in event.block_hashes:
            block = blocks.get(engine_hash)
            if block is None or not block[3] & tier_bit:
                continue
            chain, pending, keys, tiers = block
            tiers &= ~tier_bit
            if keys:
                self._set_bits(ep, keys, tiers)
            if tiers:
                blocks[engine_hash] = (chain, pending, keys, tiers)  # keeps its place in the order
            else:
                del blocks[engine_hash]
                self._engine_blocks -= 1
                removed = ep.removed
                removed[engine_hash] = (chain, pending, keys, 0)
                if len(removed) > REMOVED_BLOCKS_KEPT:
                    del removed[next(iter(removed))]

    def _clear(self, ep: _Endpoint) -> None:
        for block in ep.blocks.values():
            self._set_bits(ep, block[2], 0)
        self._engine_blocks -= len(ep.blocks)
        ep.blocks.clear()
        ep.removed.clear()
        ep.skip_groups.clear()
        for key in [k for k, slots in self._spec_expiry.items() if ep.slot in slots]:
            self._drop_spec(key, ep.slot)

    def _evict_engine_blocks(self) -> None:
        while self._engine_blocks > self.max_engine_blocks:
            ep = max(self._endpoints.values(), key=lambda e: len(e.blocks))
            engine_hash = next(iter(ep.blocks))
            block = ep.blocks.pop(engine_hash)
            self._set_bits(ep, block[2], 0)
            self._engine_blocks -= 1

    # ---- entries --------------------------------------------------------------------------
    def _entry(self, key: int) -> _Entry:
        """The entry of ``key``, created (evicting the least recently stored key past
        ``max_blocks``) or moved to most recently stored."""
        entry = self._keys.pop(key, None)
        if entry is None:
            entry = _EMPTY
            if len(self._keys) >= self.max_blocks:
                self._evict_key()
        self._keys[key] = entry
        return entry

    def _evict_key(self) -> None:
        key = next(iter(self._keys))
        entry = self._keys.pop(key)
        for tier in range(3):
            bits = entry[tier]
            while bits:
                low = bits & -bits
                self._endpoints[self._slot_names[low.bit_length() - 1]].counts[tier] -= 1  # type: ignore[index]
                bits ^= low
        self._spec_expiry.pop(key, None)
        self.evicted += 1

    def _set_bits(self, ep: _Endpoint, keys: tuple[int, ...], tiers: int, touch: bool = False) -> None:
        """Make ``ep``'s bits of each key equal ``tiers`` (bit t = ``TIERS[t]``); a key left with
        no bit anywhere leaves the index. ``touch`` (a store): create missing keys and make them
        the most recently stored; it also drops ``ep``'s speculative bit (confirmed)."""
        bit = ep.bit
        index = self._keys
        want_gpu, want_cpu, want_disk = tiers & 1, tiers & 2, tiers & 4
        d_gpu = d_cpu = d_disk = 0  # changes of ep's counts per tier
        for key in keys:
            if touch:  # self._entry(key), inlined
                entry = index.pop(key, None)
                if entry is None:
                    entry = _EMPTY
                    if len(index) >= self.max_blocks:
                        self._evict_key()
                index[key] = entry
            else:
                entry = index.get(key)
                if entry is None:
                    continue
            gpu, cpu, disk, spec = entry
            if want_gpu:
                if not gpu & bit:
                    gpu |= bit
                    d_gpu += 1
            elif gpu & bit:
                gpu ^= bit
                d_gpu -= 1
            if want_cpu:
                if not cpu & bit:
                    cpu |= bit
                    d_cpu += 1
            elif cpu & bit:
                cpu ^= bit
                d_cpu -= 1
            if want_disk:
                if not disk & bit:
                    disk |= bit
                    d_disk += 1
            elif disk & bit:
                disk ^= bit
                d_disk -= 1
            if spec & bit:
                index[key] = (gpu, cpu, disk, spec)
                self._drop_spec(key, ep.slot)
            elif gpu or cpu or disk or spec:
                if entry[0] != gpu or entry[1] != cpu or entry[2] != disk:
                    index[key] = (gpu, cpu, disk, spec)
            else:
                del index[key]
        counts = ep.counts  # a sum: _evict_key's decrements meanwhile commute with these
        counts[0] += d_gpu
        counts[1] += d_cpu
        counts[2] += d_disk

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Sizes and counters: ``blocks`` (our keys), ``engine_blocks`` (engine block states held
        in a tier), ``approx_bytes`` (from the measured per-entry costs, recently removed engine
        blocks included), per endpoint the keys held per
        tier, ``decode_errors``, ``unknown_parents``, ``seq_gaps`` (missed batches), plus
        ``skipped`` (blocks not indexable), ``evicted`` (keys dropped by the cap) and
        ``speculative`` (live speculative (key, endpoint) pairs; expired ones are swept first)."""
        if self._spec_heap:
            self._sweep_spec(self._clock())
        blocks, engine = len(self._keys), self._engine_blocks
        kept = sum(len(ep.removed) for ep in self._endpoints.values())
        return {
            "blocks": blocks,
            "engine_blocks": engine,
            "approx_bytes": blocks * BYTES_PER_BLOCK + (engine + kept) * BYTES_PER_ENGINE_BLOCK,
            "endpoints": {name: dict(zip(TIERS, ep.counts)) for name, ep in self._endpoints.items()},
            "decode_errors": self.decode_errors,
            "unknown_parents": self.unknown_parents,
            "seq_gaps": self.seq_gaps,
            "skipped": self.skipped,
            "evicted": self.evicted,
            "speculative": sum(len(slots) for slots in self._spec_expiry.values()),
        }


def _count_run(counts: dict[int, list[int]], masks: tuple[int, int, int], run: int) -> None:
    """Add ``run`` (keys in a row) to ``counts[slot][tier]`` for each slot bit of ``masks[tier]``."""
    for tier, bits in enumerate(masks):
        while bits:
            low = bits & -bits
            counts.setdefault(low.bit_length() - 1, [0, 0, 0])[tier] += run
            bits ^= low


def _full_attention(ep: _Endpoint, event: BlockStored) -> bool:
    """False (and the group remembered as skipped) for blocks of a non-full-attention group."""
    kind = event.kv_cache_spec_kind
    if kind is None or kind == "full_attention":
        return True
    if event.group_idx is not None:
        ep.skip_groups.add(event.group_idx)
    return False


def _root_salt(extra_keys: list[Any] | None, lora_name: str | None) -> str | None | bool:
    """The cache salt in block 0's extra keys: None when there is none, False when the extra keys
    hold something we cannot hash (more than one string besides the LoRA name, or non-strings)."""
    if not extra_keys or extra_keys[0] is None:
        return None
    first = extra_keys[0]
    items = [x for x in (first if isinstance(first, list | tuple) else [first]) if x != lora_name]
    if not items:
        return None
    if len(items) == 1 and isinstance(items[0], str):
        return items[0]
    return False


def _plain_extra(extra_keys: list[Any], i: int, lora_name: str | None) -> bool:
    """True when block ``i``'s extra keys hold nothing but the LoRA name."""
    if i >= len(extra_keys) or extra_keys[i] is None:
        return True
    item = extra_keys[i]
    items = item if isinstance(item, list | tuple) else [item]
    return all(x == lora_name for x in items)
