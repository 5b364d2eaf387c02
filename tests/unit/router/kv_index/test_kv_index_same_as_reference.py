"""The hot-path KVBlockIndex answers exactly as the previous one (``reference_index.py``): the
same lookups (same dict order), the same stats, after every operation of randomized streams of
stores (GPU with tokens, offloaded copies without), removals, clears, speculative entries,
endpoint removals, LoRA / salt / sliding-window blocks and tight caps."""

from __future__ import annotations

import random

import pytest
from reference_index import ReferenceKVBlockIndex

from router.kv_index.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from router.kv_index.index import KVBlockIndex
from router.scheduling.hashing import chain_seed, chained_keys, tokens_to_bytes

MODEL = "m"
ENDPOINTS = [f"http://10.0.0.{i}:8000" for i in range(1, 7)]


class Stream:
    """Random prompts sharing prefixes, engine hashes by content (equal content, equal hash, on
    every endpoint, as vLLM's chained hashes), and what each endpoint was told it holds."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        pieces = [[rng.randrange(5000) for _ in range(rng.choice((40, 64, 100, 128, 200)))] for _ in range(8)]
        self.prompts = []
        for _ in range(10):
            tokens: list[int] = []
            for _ in range(rng.randint(1, 5)):
                tokens += rng.choice(pieces)
            tokens += [rng.randrange(5000) for _ in range(rng.randint(0, 90))]
            self.prompts.append(tokens)
        self.block_size = {ep: rng.choice((16, 16, 48, 64, 128)) for ep in ENDPOINTS}
        self.hash_ids: dict[tuple[int, tuple[int, ...]], int] = {}
        self.held: dict[str, list[int]] = {ep: [] for ep in ENDPOINTS}

    def engine_hash(self, size: int, content: tuple[int, ...]) -> int:
        return self.hash_ids.setdefault((size, content), self.rng.getrandbits(64))

    def store(self, ep: str) -> BlockStored:
        rng = self.rng
        size = self.block_size[ep]
        tokens = rng.choice(self.prompts)
        n_blocks = len(tokens) // size
        if n_blocks == 0:
            return BlockStored([self.engine_hash(size, (rng.random(),))], None, [], size, medium="CPU")  # type: ignore[arg-type]
        start = rng.choice((0, 0, rng.randrange(n_blocks)))
        count = rng.randint(1, n_blocks - start)
        hashes = [self.engine_hash(size, tuple(tokens[:(i + 1) * size])) for i in range(start, start + count)]
        parent = self.engine_hash(size, tuple(tokens[:start * size])) if start else None
        fields: dict[str, object] = {}
        roll = rng.random()
        if roll < 0.08:
            fields = {"lora_id": 3, "lora_name": "adapter"}
        elif roll < 0.11:
            fields = {"lora_id": 3}  # no name: skipped
        elif roll < 0.16:
            fields = {"extra_keys": [["salt-1"]] + [None] * (count - 1)}
        elif roll < 0.19:
            fields = {"extra_keys": [None] * (count - 1) + [["mm-hash", 7]]}
        elif roll < 0.22:
            fields = {"kv_cache_spec_kind": "sliding_window", "group_idx": 1}
        elif roll < 0.5:
            fields = {"extra_keys": [None] * count, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
        medium = rng.choice((None, "GPU", "GPU", "gpu", "GPU", "weird"))
        self.held[ep].extend(hashes)
        if rng.random() < 0.04:  # wrong token count: skipped
            return BlockStored(hashes, parent, tokens[start * size:(start + count) * size - 1], size, medium=medium)
        return BlockStored(hashes, parent, tokens[start * size:(start + count) * size], size, medium=medium,
                           **fields)  # type: ignore[arg-type]

    def known(self, ep: str) -> list[int]:
        held = self.held[ep]
        if not held:
            return [self.rng.getrandbits(64)]
        picks = [self.rng.choice(held) for _ in range(self.rng.randint(1, 6))]
        if self.rng.random() < 0.1:
            picks.append(self.rng.getrandbits(64))  # never stored
        return picks

    def copy(self, ep: str) -> BlockStored:
        return BlockStored(self.known(ep), None, [], self.block_size[ep], medium=self.rng.choice(("CPU", "DISK", "cpu")))

    def removal(self, ep: str) -> BlockRemoved:
        medium = self.rng.choice((None, "GPU", "CPU", "CPU", "DISK", "Cpu", "tape"))
        return BlockRemoved(self.known(ep), medium, self.rng.choice((None, 0, 0, 1)))

    def batch(self, ep: str) -> list[KVEvent]:
        events: list[KVEvent] = []
        for _ in range(self.rng.randint(1, 5)):
            roll = self.rng.random()
            if roll < 0.45:
                events.append(self.store(ep))
            elif roll < 0.65:
                events.append(self.copy(ep))
            elif roll < 0.98:
                events.append(self.removal(ep))
            else:
                events.append(AllBlocksCleared())
                self.held[ep].clear()
        return events

    def queries(self) -> list[list[int]]:
        seeds = [chain_seed(MODEL), chain_seed("adapter"), chain_seed(MODEL, "salt-1")]
        return [chained_keys(tokens_to_bytes(p), 256, seed) for p in self.prompts for seed in seeds]


def assert_same(new: KVBlockIndex, old: ReferenceKVBlockIndex, queries: list[list[int]]) -> None:
    for keys in queries:
        for n in (len(keys), 1, 3):
            assert list(new.longest_prefix_tiers(MODEL, keys[:n]).items()) == \
                list(old.longest_prefix_tiers(MODEL, keys[:n]).items())
            assert list(new.longest_prefix(MODEL, keys[:n]).items()) == list(old.longest_prefix(MODEL, keys[:n]).items())
    assert new.stats() == old.stats()


@pytest.mark.parametrize("seed", range(16))
def test_randomized_streams_give_the_same_answers_as_the_reference(seed):
    rng = random.Random(seed)
    stream = Stream(rng)
    now = [0.0]
    caps: dict[str, int] = {}
    if seed % 4 == 1:
        caps = {"max_blocks": rng.randint(5, 40)}
    elif seed % 4 == 2:
        caps = {"max_blocks": 1000, "max_engine_blocks": rng.randint(10, 60)}
    new = KVBlockIndex(clock=lambda: now[0], **caps)  # type: ignore[arg-type]
    old = ReferenceKVBlockIndex(clock=lambda: now[0], **caps)  # type: ignore[arg-type]
    queries = stream.queries()
    for step in range(250):
        ep = rng.choice(ENDPOINTS)
        roll = rng.random()
        if roll < 0.7:
            events = stream.batch(ep)
            new.apply(ep, MODEL, events)
            old.apply(ep, MODEL, events)
        elif roll < 0.9:
            keys = rng.choice(queries[:4])[:rng.randint(1, 12)]  # few prompts: endpoints share entries
            ttl = rng.choice((0.5, 1.0, 2.0, 10.0))
            new.add_speculative(MODEL, ep, keys, ttl)
            old.add_speculative(MODEL, ep, keys, ttl)
        elif roll < 0.98:
            now[0] += rng.choice((0.1, 0.6, 3.0))
            assert_same(new, old, queries)  # lookups first: lazy expiry before any sweep
        else:
            new.remove_endpoint(ep)
            old.remove_endpoint(ep)
            stream.held[ep].clear()
        if step % 5 == 0 or step > 240:
            assert_same(new, old, queries)
    assert new.stats()["blocks"] > 0 or caps  # the stream did index something


def test_a_lapsed_speculative_holder_stays_gone_on_later_lookups():
    now = [0.0]
    new = KVBlockIndex(clock=lambda: now[0])
    old = ReferenceKVBlockIndex(clock=lambda: now[0])
    keys = [11, 12, 13]
    for index in (new, old):
        index.add_speculative(MODEL, ENDPOINTS[0], keys, 1.0)
        index.add_speculative(MODEL, ENDPOINTS[1], keys, 10.0)
    now[0] = 2.0
    for _ in range(3):  # the first lookup clears the lapsed bit; the next ones must not see it
        assert new.longest_prefix_tiers(MODEL, keys) == old.longest_prefix_tiers(MODEL, keys) == {ENDPOINTS[1]: (3, 0, 0)}
        assert new.longest_prefix(MODEL, keys) == old.longest_prefix(MODEL, keys) == {ENDPOINTS[1]: (3, "gpu")}
    assert new.stats() == old.stats()
