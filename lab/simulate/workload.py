"""What the simulator replays: requests whose prompts are built lazily from shared pieces.

A prompt is either a sequence of **pieces** — each a deterministic run of token ids named by an id
(a Mooncake ``hash_ids`` entry: one 512-token block, equal ids = equal content; the synthetic mix
uses the same form) — or, for the text generators of :mod:`lab.toolkit.workloads`, the token ids
of its chat body (:func:`~lab.toolkit.workloads.chat_tokens`). Pieces are what make a million
requests fit in memory: no prompt's token list is kept; token ids are built only when an engine's
KV event needs them, and the engine block hashes and router block keys of a piece are memoised per
*path* (the piece and every piece before it), so a shared system prompt is hashed once for the
whole run (:class:`PromptMemo`).

Path key of piece ``i``: ``hash((key of piece i-1, xxh64(id space), piece id, tokens))`` over
Python ints (stable across runs: ints and tuples of ints do not take ``PYTHONHASHSEED``). Equal path keys mean equal
token ids up to the end of the piece (up to 64-bit collisions), the property prefix caching needs.

Arrivals are iterators in arrival order (:func:`mooncake_requests`, :func:`synthetic_requests`,
:func:`text_requests`, :func:`batch_file_requests`, merged by :func:`merge_arrivals`). A session's
later turn is not an arrival: it is ``SimRequest.next_turn()``, sent ``pause_s`` after the previous
turn's answer ends (closed loop, as :class:`lab.toolkit.workloads.TimedRequest` defines it).
"""

from __future__ import annotations

import heapq
import json
import math
import random
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import xxhash

from engine_twin.kv_cache import block_hashes
from lab.toolkit.workloads import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRecord,
    TimedRequest,
    chat_tokens,
    oracle_reusable_tokens,
)
from router.scheduling.hashing import chain_seed, chained_keys, tokens_to_bytes

if TYPE_CHECKING:
    from lab.toolkit.pd_mix import PdOptions

K = TypeVar("K")

#: Token ids of a piece are 16-bit (0 … 65,535), drawn from a seeded generator per piece id.
_TOKEN_TYPECODE = "H"
_ROOT_PATH = 0x5EED


class PieceTokens:
    """Deterministic token ids of piece ids, with a small LRU of recently built pieces.

    ``namespace`` separates id spaces (two traces' id 7 are different texts). Building one
    512-token piece costs about 5 µs (``random.Random.randbytes``)."""

    def __init__(self, namespace: str = "", cache_pieces: int = 4096) -> None:
        self.namespace = namespace
        self.cache_pieces = cache_pieces
        self._cache: OrderedDict[tuple[str, int], array] = OrderedDict()

    def tokens(self, space: str, piece_id: int, count: int) -> array:
        """The first ``count`` token ids of piece ``piece_id`` of id space ``space``."""
        key = (space, piece_id)
        full = self._cache.get(key)
        if full is None or len(full) < count:
            size = max(count, MOONCAKE_BLOCK_TOKENS)
            full = array(_TOKEN_TYPECODE, random.Random(f"{self.namespace}/{space}/{piece_id}").randbytes(2 * size))
            self._cache[key] = full
            if len(self._cache) > self.cache_pieces:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return full[:count] if count < len(full) else full


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of a prompt: ``tokens`` ids of piece ``piece_id`` in id space ``space``."""

    space: str
    piece_id: int
    tokens: int


class LazyTokens(Sequence[int]):
    """A prompt's token ids, built on demand from its pieces (``len`` is free; a slice builds only
    the pieces it spans). What the engine core and the router's request hold instead of a list."""

    __slots__ = ("pieces", "source", "_len", "_starts")

    def __init__(self, pieces: Sequence[Piece], source: PieceTokens) -> None:
        self.pieces = tuple(pieces)
        self.source = source
        starts = [0]
        for p in self.pieces:
            starts.append(starts[-1] + p.tokens)
        self._starts = starts
        self._len = starts[-1]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return list(self)[index]
            out: list[int] = []
            if stop <= start:
                return out
            i = max(0, _bisect_right(self._starts, start) - 1)
            while i < len(self.pieces) and self._starts[i] < stop:
                p = self.pieces[i]
                toks = self.source.tokens(p.space, p.piece_id, p.tokens)
                lo = max(0, start - self._starts[i])
                hi = min(p.tokens, stop - self._starts[i])
                out.extend(toks[lo:hi])
                i += 1
            return out
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(index)
        i = _bisect_right(self._starts, index) - 1
        p = self.pieces[i]
        return self.source.tokens(p.space, p.piece_id, p.tokens)[index - self._starts[i]]

    def __iter__(self) -> Iterator[int]:
        for p in self.pieces:
            yield from self.source.tokens(p.space, p.piece_id, p.tokens)


def _bisect_right(a: list[int], x: int) -> int:
    lo, hi = 0, len(a)
    while lo < hi:
        mid = (lo + hi) // 2
        if x < a[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request of a simulated workload.

    ``arrival_s``: when the client sends it (model seconds; a later turn's is set when it is
    sent). ``pieces`` (None for a text request) or ``tokens``: the prompt. ``objective``: the band /
    lane (``interactive``, ``async``, ``batch``). ``via_queue``: it goes through the async
    processor (queue → lanes → gates → router) rather than straight to the router. ``tenant``:
    its fairness id. ``follow``: builds the session's next turn (None: the last turn).
    """

    arrival_s: float
    input_tokens: int
    max_tokens: int
    pieces: tuple[Piece, ...] | None = None
    tokens: list[int] | None = None
    session_id: str | None = None
    turn: int = 0
    pause_s: float = 0.0
    objective: str = "interactive"
    via_queue: bool = False
    tenant: str = ""
    batch_id: str = ""
    workload: str = ""
    oracle_tokens: int | None = None
    """Oracle-reusable tokens when known up front (text traces: :func:`oracle_reusable_tokens`)."""
    follow: Callable[[SimRequest], SimRequest | None] | None = field(default=None, repr=False)

    def next_turn(self) -> SimRequest | None:
        """The session's next turn (its ``arrival_s`` still to be set), or None."""
        return self.follow(self) if self.follow is not None else None


class PromptMemo:
    """Engine block hashes, router block keys and the oracle's seen prefixes, per piece path.

    Memo entries are kept in LRUs of ``max_paths`` paths (a path no live request uses is rebuilt
    if it comes back after eviction: same values, only time lost). The oracle's ``seen`` map keeps
    every path ever seen (one int → int entry per distinct piece: the trace's working set)."""

    def __init__(self, block_size: int, root_hash: bytes, model: str, source: PieceTokens,
                 max_paths: int = 50_000) -> None:
        self.block_size = block_size
        self.root_hash = root_hash
        self.model = model
        self.source = source
        self.max_paths = max_paths
        self._engine: OrderedDict[int, tuple[list[bytes], bytes]] = OrderedDict()
        self._router: dict[int, OrderedDict[int, tuple[list[int], int]]] = {}
        self._seen: dict[int, int] = {}  # hash((parent path, space, piece id)) -> most tokens seen
        self._seed = chain_seed(model)

    # ---- keys ------------------------------------------------------------------------------
    @staticmethod
    def paths(pieces: Sequence[Piece]) -> list[int]:
        """Path key of every piece (module docstring)."""
        out = []
        key = _ROOT_PATH
        for p in pieces:
            key = hash((key, _space_key(p.space), p.piece_id, p.tokens))
            out.append(key)
        return out

    def engine_hashes(self, req: SimRequest) -> list[bytes]:
        """vLLM's chained block hashes of the prompt's full ``block_size`` blocks (as the twin
        computes them from the tokens, :func:`engine_twin.kv_cache.block_hashes`)."""
        if req.pieces is None:
            assert req.tokens is not None
            return block_hashes(req.tokens, self.block_size, self.root_hash)
        bs = self.block_size

        def chain(p: Piece, parent: bytes) -> list[bytes]:
            return _chain_hashes(self.source.tokens(p.space, p.piece_id, p.tokens).tolist(), bs, parent)

        return self._chained(req.pieces, self._engine, self.root_hash, bs, chain)

    def router_keys(self, req: SimRequest, block_tokens: int, max_blocks: int) -> list[int]:
        """The router's block keys of the prompt (:func:`router.scheduling.hashing.request_block_keys`
        over the whole prompt gives the same list: pieces are whole blocks but the last)."""
        if req.pieces is None:
            assert req.tokens is not None
            return chained_keys(tokens_to_bytes(req.tokens), 4 * block_tokens, self._seed, max_blocks)

        def chain(p: Piece, seed: int) -> list[int]:
            data = tokens_to_bytes(array("I", self.source.tokens(p.space, p.piece_id, p.tokens)))
            return chained_keys(data, 4 * block_tokens, seed)

        memo = self._router.setdefault(block_tokens, OrderedDict())
        out = self._chained(req.pieces, memo, self._seed, block_tokens, chain, max_blocks)
        return out[:max_blocks] if max_blocks else out

    def _chained(self, pieces: Sequence[Piece], memo: OrderedDict[int, tuple[list[K], K]], root: K,
                 block_tokens: int, chain: Callable[[Piece, K], list[K]], max_blocks: int = 0) -> list[K]:
        """The chained keys of ``pieces`` (each piece's keys from ``chain(piece, parent)``, the
        parent the last key so far, ``root`` at first), memoised per piece path in the LRU ``memo``
        (at most ``max_paths``). Stops after a piece that ends in a partial block of
        ``block_tokens`` (the rest is not hashable) or once ``max_blocks`` keys are out (0: no cap)."""
        out: list[K] = []
        parent = root
        for p, path in zip(pieces, self.paths(pieces)):
            hit = memo.get(path)
            if hit is None:
                keys = chain(p, parent)
                hit = (keys, keys[-1] if keys else parent)
                memo[path] = hit
                if len(memo) > self.max_paths:
                    memo.popitem(last=False)
            else:
                memo.move_to_end(path)
            out.extend(hit[0])
            parent = hit[1]
            if p.tokens % block_tokens or (max_blocks and len(out) >= max_blocks):
                break
        return out

    def oracle(self, req: SimRequest) -> int:
        """Oracle-reusable tokens of ``req`` given every request seen before (shared/PERFORMANCE.md;
        the same rule as :func:`lab.toolkit.workloads.oracle_reusable_tokens`: the longest prefix
        shared with an earlier request, whole blocks, at most ``prompt − 1`` tokens); records it."""
        if req.pieces is None:
            return req.oracle_tokens or 0
        seen = self._seen
        reused = 0
        matching = True
        parent = _ROOT_PATH
        for p, path in zip(req.pieces, self.paths(req.pieces)):
            key = hash((parent, _space_key(p.space), p.piece_id))
            before = seen.get(key, 0)
            if matching:
                reused += min(before, p.tokens)
                matching = before >= p.tokens
            if p.tokens > before:
                seen[key] = p.tokens
            parent = path
        bs = self.block_size
        return min(reused // bs, (req.input_tokens - 1) // bs) * bs

    def lazy_tokens(self, req: SimRequest) -> Sequence[int]:
        """The prompt's token ids (lazy for pieces)."""
        if req.pieces is None:
            assert req.tokens is not None
            return req.tokens
        return LazyTokens(req.pieces, self.source)


_SPACE_KEYS: dict[str, int] = {}


def _space_key(space: str) -> int:
    """A stable int for an id space (``hash`` of a str changes with ``PYTHONHASHSEED``)."""
    key = _SPACE_KEYS.get(space)
    if key is None:
        key = _SPACE_KEYS[space] = xxhash.xxh64_intdigest(space.encode())
    return key


def _chain_hashes(tokens: list[int], block_size: int, parent: bytes) -> list[bytes]:
    """Chained hashes of ``tokens``' full blocks continuing from ``parent`` (block_hashes with a
    root of ``parent``)."""
    return block_hashes(tokens, block_size, parent)


# ---- sources ---------------------------------------------------------------------------------
def pieces_of(space: str, hash_ids: Sequence[int], input_length: int, own: int) -> tuple[Piece, ...]:
    """Pieces of a Mooncake record: one per ``hash_ids`` entry (512 tokens, the last cut to
    ``input_length``); ids missing for the rest of the prompt become the record's own piece
    (``own``: a unique id in space ``space + "/own"``)."""
    out: list[Piece] = []
    left = input_length
    for h in hash_ids:
        if left <= 0:
            break
        n = min(MOONCAKE_BLOCK_TOKENS, left)
        out.append(Piece(space, int(h), n))
        left -= n
    while left > 0:
        n = min(MOONCAKE_BLOCK_TOKENS, left)
        out.append(Piece(space + "/own", own * 1024 + len(out), n))
        left -= n
    return tuple(out)


def mooncake_requests(records: Iterable[MooncakeRecord], start_min: float = 0.0, minutes: float | None = None,
                      speed: float = 1.0, max_model_len: int | None = None, max_output_tokens: int | None = None,
                      tenant: str = "", space: str = "mooncake") -> Iterator[SimRequest]:
    """Open-loop requests of Mooncake records, the window and speed rules of
    :func:`lab.toolkit.workloads.mooncake_trace` (records sorted by timestamp; arrivals counted
    from ``start_min``; prompts capped to ``max_model_len − output − 1`` tokens). Raises
    ``ValueError`` for a non-positive ``speed`` or ``minutes``."""
    if speed <= 0 or (minutes is not None and minutes <= 0):
        raise ValueError("speed and minutes must be positive")
    records = sorted(records, key=lambda r: r.timestamp_ms)
    if not records:
        return
    start_ms = records[0].timestamp_ms + start_min * 60_000
    end_ms = start_ms + minutes * 60_000 if minutes is not None else None
    for k, r in enumerate(records):
        if r.timestamp_ms < start_ms or (end_ms is not None and r.timestamp_ms >= end_ms):
            continue
        output = max(1, min(r.output_length, max_output_tokens) if max_output_tokens else r.output_length)
        tokens = r.input_length if max_model_len is None else min(r.input_length, max_model_len - output - 1)
        if tokens < 2:
            continue
        yield SimRequest((r.timestamp_ms - start_ms) / 1000 / speed, tokens, output,
                         pieces=pieces_of(space, r.hash_ids, tokens, k), session_id=f"{space}-{k}",
                         tenant=tenant, workload=space)


def text_requests(trace: Sequence[TimedRequest], tenant: str = "", objective: str = "interactive",
                  block_size: int = 16,
                  tenant_of: Callable[[TimedRequest], str] | None = None) -> Iterator[SimRequest]:
    """Requests of a :mod:`lab.toolkit.workloads` text trace: token ids of each chat body
    (:func:`chat_tokens`), oracle-reusable tokens from :func:`oracle_reusable_tokens` (trace order),
    sessions closed loop (a later turn is sent ``pause_s`` after the previous one ends). The
    tenant of each request is ``tenant_of(request)`` when given, else ``tenant``."""
    oracle = oracle_reusable_tokens(trace, block_size=block_size).reusable_tokens
    by_session: dict[str, list[tuple[TimedRequest, int]]] = {}
    for r, reusable in zip(trace, oracle):
        by_session.setdefault(r.session_id, []).append((r, reusable))
    firsts = []
    for turns in by_session.values():
        turns.sort(key=lambda x: x[0].turn)
        firsts.append(turns)
    firsts.sort(key=lambda ts: (ts[0][0].arrival_s, ts[0][0].session_id))

    def build(turns: list[tuple[TimedRequest, int]], i: int, arrival: float) -> SimRequest:
        r, reusable = turns[i]
        toks = chat_tokens(r.body)
        nxt = (lambda prev: build(turns, i + 1, 0.0)) if i + 1 < len(turns) else None
        return SimRequest(arrival, len(toks), r.max_tokens, tokens=toks, session_id=r.session_id, turn=r.turn,
                          pause_s=turns[i + 1][0].pause_s if i + 1 < len(turns) else 0.0, objective=objective,
                          tenant=tenant if tenant_of is None else tenant_of(r), workload=r.workload,
                          oracle_tokens=reusable, follow=nxt)

    for turns in firsts:
        yield build(turns, 0, turns[0][0].arrival_s)


def pd_mix_requests(opts: PdOptions) -> Iterator[SimRequest]:
    """``backfill bench pd``'s long-prompt + chat mix (:func:`lab.toolkit.pd_mix.pd_trace` of
    ``opts``, the same generator and seed, so the same requests), its three tenants
    (:func:`lab.toolkit.pd_mix.tenant_of`: ``docs`` the documents, ``chat-1`` / ``chat-2`` the
    sessions), workloads ``long-prompt`` and ``chat``; chat sessions closed loop as the bench's
    client runs them. Raises ``ValueError`` as :func:`~lab.toolkit.pd_mix.pd_trace`."""
    from lab.toolkit.pd_mix import pd_trace, tenant_of

    trace = pd_trace(opts)
    return text_requests(trace, block_size=opts.block_size, tenant_of=lambda r: tenant_of(r, opts.tenants))


def batch_file_requests(path: str | Path, tenant: str = "batch", arrival_s: float = 0.0,
                        default_max_tokens: int = 64, block_size: int = 16) -> Iterator[SimRequest]:
    """An OpenAI batch input file (JSONL: ``custom_id``, ``method``, ``url``, ``body``) as a backlog
    on the ``batch`` lane, all queued at ``arrival_s``, through the processor; ``/v1/chat/completions``
    bodies are tokenised with :func:`chat_tokens`, ``/v1/completions`` prompts as text.

    Raises ``ValueError`` naming the line for a line that is not such an object."""
    lines = Path(path).read_text().splitlines()
    reqs: list[SimRequest] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            body = row["body"]
            if "messages" in body:
                toks = chat_tokens(body)
            else:
                prompt = body["prompt"]
                toks = list(prompt.encode()[::4]) if isinstance(prompt, str) else list(prompt)
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or default_max_tokens)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}:{number}: not an OpenAI batch request line ({exc})") from exc
        if len(toks) < 2:
            raise ValueError(f"{path}:{number}: the prompt is empty")
        reqs.append(SimRequest(arrival_s, len(toks), max(1, max_tokens), tokens=toks, objective="batch",
                               via_queue=True, tenant=tenant, batch_id=Path(path).stem,
                               session_id=f"batch-{number}", workload="batch-file"))
    if not reqs:
        raise ValueError(f"{path}: no request lines")
    trace = [TimedRequest(0.0, r.session_id or "", 0, 0.0, {"ids": r.tokens}, r.max_tokens, "batch-file")
             for r in reqs]
    oracle = oracle_reusable_tokens(trace, tokenize=lambda body: body["ids"], block_size=block_size)
    for r, reusable in zip(reqs, oracle.reusable_tokens):
        r.oracle_tokens = reusable
    yield from reqs


def synthetic_requests(n: int, seed: int = 0, rate_per_s: float = 40.0, tenants: int = 4,
                       groups: int = 48, system_pieces: tuple[int, int] = (2, 8),
                       output_tokens: tuple[int, int] = (16, 256), batch_share: float = 0.15,
                       async_share: float = 0.05, session_share: float = 0.4,
                       turns: tuple[int, int] = (2, 6), think_s: float = 5.0) -> Iterator[SimRequest]:
    """A realistic mix of ``n`` requests (first turns and later turns together), Poisson arrivals
    of ``rate_per_s`` first turns per second, over ``tenants`` tenants (tenant ``t0`` twice as busy
    as each other one):

    * interactive, straight to the router: shared-prefix requests (one of ``groups`` system
      prompts of ``system_pieces`` 512-token pieces, plus a question of 1-2 pieces) and multi-turn
      chat sessions (``session_share`` of first turns; ``turns`` turns, the history growing 1-2
      pieces a turn, a think time of mean ``think_s`` between an answer and the next turn);
    * ``async_share`` and ``batch_share`` of first turns go through the processor on the ``async``
      and ``batch`` lanes: document jobs sharing a per-tenant instruction prefix.

    Output lengths are log-uniform in ``output_tokens``. Generated lazily: memory does not grow with
    ``n``. Raises ``ValueError`` for non-positive counts or shares outside [0, 1]."""
    if n < 1 or rate_per_s <= 0 or tenants < 1 or groups < 1:
        raise ValueError("n, rate_per_s, tenants and groups must be positive")
    if not all(0 <= s <= 1 for s in (batch_share, async_share, session_share)) or batch_share + async_share > 1:
        raise ValueError("shares must lie in [0, 1] and batch + async at most 1")
    rng = random.Random(seed)
    tenant_names = [f"t{i}" for i in range(tenants)]
    tenant_weights = [2.0] + [1.0] * (tenants - 1)
    group_len = [rng.randint(*system_pieces) for _ in range(groups)]
    lo, hi = math.log(output_tokens[0]), math.log(output_tokens[1])
    counter = [0]
    space = f"syn{seed}"

    def out_len(r: random.Random) -> int:
        return int(math.exp(r.uniform(lo, hi)))

    def unique(r: random.Random, count: int, last: int) -> list[Piece]:
        base = counter[0]
        counter[0] += count
        return [Piece(space + "/u", base + i, MOONCAKE_BLOCK_TOKENS if i < count - 1 else last) for i in range(count)]

    def turn_follow(prefix: tuple[Piece, ...], left: int, tenant: str, sid: str, turn: int, r_seed: int):
        def follow(prev: SimRequest) -> SimRequest | None:
            if left <= 0:
                return None
            r = random.Random(r_seed)
            full = tuple(p for p in prev.pieces or () if p.tokens == MOONCAKE_BLOCK_TOKENS)
            pieces = full + tuple(unique(r, r.randint(1, 2), r.randint(32, MOONCAKE_BLOCK_TOKENS)))
            tokens = sum(p.tokens for p in pieces)
            req = SimRequest(0.0, tokens, out_len(r), pieces=pieces, session_id=sid, turn=turn,
                             pause_s=min(r.expovariate(1 / think_s), 6 * think_s), tenant=tenant,
                             workload="chat-session")
            req.follow = turn_follow(prefix, left - 1, tenant, sid, turn + 1, r.getrandbits(64))
            return req
        return follow

    made = 0
    t = 0.0
    k = 0
    while made < n:
        t += rng.expovariate(rate_per_s)
        k += 1
        tenant = rng.choices(tenant_names, tenant_weights)[0]
        u = rng.random()
        if u < batch_share + async_share:
            lane = "batch" if u < batch_share else "async"
            prefix = (Piece(space + "/jobs", tenant_names.index(tenant), MOONCAKE_BLOCK_TOKENS),)
            pieces = prefix + tuple(unique(rng, rng.randint(1, 6), rng.randint(16, MOONCAKE_BLOCK_TOKENS)))
            made += 1
            yield SimRequest(t, sum(p.tokens for p in pieces), out_len(rng), pieces=pieces, objective=lane,
                             via_queue=True, tenant=tenant, batch_id=f"{tenant}-{lane}-{k // 5000}",
                             session_id=f"job-{k}", workload=f"{lane}-jobs")
            continue
        g = rng.randrange(groups)
        system = tuple(Piece(space + "/sys", g * 64 + i, MOONCAKE_BLOCK_TOKENS) for i in range(group_len[g]))
        if rng.random() < session_share:
            n_turns = rng.randint(*turns)
            sid = f"chat-{k}"
            pieces = system + tuple(unique(rng, 1, rng.randint(64, MOONCAKE_BLOCK_TOKENS)))
            req = SimRequest(t, sum(p.tokens for p in pieces), out_len(rng), pieces=pieces, session_id=sid,
                             tenant=tenant, workload="chat-session")
            left = min(n_turns - 1, n - made - 1)
            req.follow = turn_follow(system, left, tenant, sid, 1, rng.getrandbits(64))
            made += 1 + max(0, left)
            yield req
            continue
        pieces = system + tuple(unique(rng, rng.randint(1, 2), rng.randint(32, MOONCAKE_BLOCK_TOKENS)))
        made += 1
        yield SimRequest(t, sum(p.tokens for p in pieces), out_len(rng), pieces=pieces, session_id=f"q-{k}",
                         tenant=tenant, workload="shared-prefix")


def merge_arrivals(*sources: Iterable[SimRequest]) -> Iterator[SimRequest]:
    """One arrival stream from several, each already in arrival order (lazily)."""
    return heapq.merge(*sources, key=lambda r: r.arrival_s)
