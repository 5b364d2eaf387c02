"""Seeded request traces for the router benchmarks, and the oracle-reusable tokens of a trace.

A trace is a list of :class:`TimedRequest` in nominal arrival order, generated from a seed (nothing
is stored but the generator and its parameters, or a Mooncake trace file). The workloads:

* :func:`agentic_sessions`: multi-turn agent sessions. Every session starts with one of a few long
  system prompts (instructions plus the tool descriptions, rendered into the system message as agent
  frameworks do; the simulator renders only ``messages``), then turns: a user task, then (assistant
  tool call, tool result) pairs, the history growing by one pair a turn, with a tool pause between a
  turn's answer and the next turn. A small share of calls are one-off requests with a prompt of
  their own. Defaults give about 92 % of calls sharing a prefix with an earlier call, the figure
  PERFORMANCE.md quotes for published agentic traces.
* :func:`shared_prefix_groups`: llm-d's shared-prefix profile (150 prefixes × 5 users, a
  6,000-token prefix + 1,200-token question → 1,000 tokens out) scaled down by default to 12
  prefixes × 5 users, 3,000 + 600 tokens → 16 out, Poisson arrivals.
* :func:`tool_agents`: many parallel agents in long loops of short tool calls (see its docstring
  for how it differs from :func:`agentic_sessions`).
* :func:`shared_prefix_batch`: a batch in the OpenAI cookbook batch file's shape (one system
  prompt, one movie description per line), sent as a burst.
* Mooncake-format traces (:class:`MooncakeRecord`, :func:`read_mooncake`, :func:`write_mooncake`,
  :func:`mooncake_trace`), :func:`long_context_records`, a generator of long multi-turn
  conversations in that format, and :func:`conversation_records`, a window of a conversation
  service fitted to the public Mooncake conversation trace's statistics.

Text is made of seeded random words, so distinct texts never share a 16-token block by accident.
Token counts are for the simulator's built-in tokenizer (4 UTF-8 bytes per token over the ChatML
rendering, :mod:`engine_twin.tokenizer`); the texts are ASCII, so ``n`` tokens are ``4 n`` bytes.

Times are model seconds: the replayer multiplies them by the engines' ``time_scale``.
"""

from __future__ import annotations

import json
import math
import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import xxhash

from common.chatml import render_chat
from engine_twin.tokenizer import BuiltinTokenizer

MODEL = "sim-model"
"""The model name every generated body asks for (the simulator's default served name)."""

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber basil cedar dune ember "
          "fjord grove heath islet jade knoll larch moss nectar orchid pine quartz reed sage thistle umber "
          "vale willow yarrow zinnia").split()


@dataclass(frozen=True)
class TimedRequest:
    """One request of a trace.

    ``arrival_s``: nominal send time in model seconds from the start. The first turn of a session is
    sent then; a later turn is sent ``pause_s`` after the previous turn's answer ends (closed loop),
    and its ``arrival_s`` is the nominal time had every answer been instant (it orders the trace).
    ``session_id``: requests of one session run one after another, in ``turn`` order; a one-off
    request is a session of one turn. ``body``: the OpenAI chat body (``model``, ``messages``,
    ``max_tokens``; the replayer adds streaming options). ``workload``: the generator's name.
    """

    arrival_s: float
    session_id: str
    turn: int
    pause_s: float
    body: dict[str, Any]
    max_tokens: int
    workload: str


def _text(rng: random.Random, tokens: int, tag: str = "") -> str:
    """ASCII text of exactly ``4 * tokens`` bytes (``tokens`` built-in tokenizer tokens)."""
    want = 4 * tokens
    parts = [tag] if tag else []
    size = len(tag)
    while size < want:
        word = rng.choice(_WORDS)
        parts.append(word)
        size += len(word) + 1
    return " ".join(parts)[:want]


def _body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens}


def agentic_sessions(seed: int = 0, sessions: int = 24, agents: int = 2, system_tokens: int = 4000,
                     task_tokens: tuple[int, int] = (200, 600), call_tokens: tuple[int, int] = (30, 80),
                     result_tokens: tuple[int, int] = (300, 1000), turns: tuple[int, int] = (3, 8),
                     pause_s: float = 1.0, one_off_share: float = 0.06, one_off_tokens: tuple[int, int] = (1000, 4000),
                     duration_s: float = 9.0, max_tokens: int = 16, workload: str = "agentic") -> list[TimedRequest]:
    """Agent sessions (see the module docstring), in nominal arrival order.

    Args:
        seed: the only source of randomness.
        sessions: agent sessions; each picks one of ``agents`` system prompts at random.
        system_tokens: length of each system prompt (instructions + tools), tokens.
        task_tokens, call_tokens, result_tokens: inclusive ranges (tokens) of the first user task,
            each assistant tool call, each tool result.
        turns: inclusive range of calls per session.
        pause_s: mean tool pause between a turn's answer and the next call (exponential, capped at
            4 × the mean), model seconds.
        one_off_share: share of calls that are one-off requests with a prompt of their own.
        one_off_tokens: inclusive range of a one-off prompt's length, tokens.
        duration_s: session starts and one-off requests are spread uniformly over this window.
        max_tokens: output tokens of every call.
        workload: the requests' workload name; any name but ``agentic`` also prefixes the session
            ids (and so the texts), so two workloads of one seed never share a session prompt.

    Raises ``ValueError`` for a non-positive count or a share outside [0, 1).
    """
    if sessions < 1 or agents < 1 or system_tokens < 1 or duration_s <= 0:
        raise ValueError("sessions, agents, system_tokens and duration_s must be positive")
    if not 0 <= one_off_share < 1:
        raise ValueError("one_off_share must be in [0, 1)")
    rng = random.Random(seed)
    tag = "agent" if workload == "agentic" else workload
    systems = [_text(rng, system_tokens, f"{tag}-{a} instructions and tools:") for a in range(agents)]
    out: list[TimedRequest] = []
    for s in range(sessions):
        sid = f"{tag}-{seed}-{s}"
        start = rng.uniform(0, duration_s)
        messages = [{"role": "system", "content": rng.choice(systems)},
                    {"role": "user", "content": _text(rng, rng.randint(*task_tokens), f"task {sid}:")}]
        t = start
        for turn in range(rng.randint(*turns)):
            pause = 0.0
            if turn:
                messages = messages + [
                    {"role": "assistant", "content": _text(rng, rng.randint(*call_tokens), f"call {sid}.{turn}:")},
                    {"role": "user", "content": _text(rng, rng.randint(*result_tokens), f"result {sid}.{turn}:")},
                ]
                pause = min(rng.expovariate(1 / pause_s), 4 * pause_s) if pause_s > 0 else 0.0
                t += pause
            out.append(TimedRequest(t, sid, turn, pause, _body(messages, max_tokens), max_tokens, workload))
    one_offs = round(len(out) * one_off_share / (1 - one_off_share))
    for k in range(one_offs):
        sid = f"one-off-{seed}-{k}" if workload == "agentic" else f"{tag}-one-off-{seed}-{k}"
        messages = [{"role": "user", "content": _text(rng, rng.randint(*one_off_tokens), f"{sid}:")}]
        out.append(TimedRequest(rng.uniform(0, duration_s), sid, 0, 0.0, _body(messages, max_tokens), max_tokens,
                                workload))
    return sorted(out, key=lambda r: (r.arrival_s, r.session_id, r.turn))


def shared_prefix_groups(seed: int = 0, groups: int = 12, users: int = 5, questions_per_user: int = 2,
                         prefix_tokens: int = 3000, question_tokens: int = 600, max_tokens: int = 16,
                         rate_per_s: float = 14.0) -> list[TimedRequest]:
    """llm-d's shared-prefix profile, scaled down: ``groups`` long prefixes (system messages), each
    used by ``users`` users asking ``questions_per_user`` distinct questions; every request is its
    own session (open loop), arriving as a Poisson process of ``rate_per_s`` requests per model
    second in random order. Defaults scale llm-d's 150 × 5, 6,000 + 1,200 tokens → 1,000 out down
    by about 4 in length and 12 in prefixes. Raises ``ValueError`` for a non-positive argument."""
    if min(groups, users, questions_per_user, prefix_tokens, question_tokens, max_tokens) < 1 or rate_per_s <= 0:
        raise ValueError("every count and the rate must be positive")
    rng = random.Random(seed)
    prefixes = [_text(rng, prefix_tokens, f"shared context {g}:") for g in range(groups)]
    prompts = [(g, u, q) for g in range(groups) for u in range(users) for q in range(questions_per_user)]
    rng.shuffle(prompts)
    out: list[TimedRequest] = []
    t = 0.0
    for g, u, q in prompts:
        t += rng.expovariate(rate_per_s)
        messages = [{"role": "system", "content": prefixes[g]},
                    {"role": "user", "content": _text(rng, question_tokens, f"user {g}.{u} question {q}:")}]
        out.append(TimedRequest(t, f"shared-{seed}-{g}-{u}-{q}", 0, 0.0, _body(messages, max_tokens), max_tokens,
                                "shared-prefix"))
    return out


def merge(*traces: Sequence[TimedRequest], offsets: Sequence[float] | None = None) -> list[TimedRequest]:
    """One trace from several, in nominal arrival order; ``offsets`` (model seconds) shift each
    trace's arrivals. Session ids must differ between traces (the generators include their seed
    and workload in every id)."""
    offsets = offsets or [0.0] * len(traces)
    merged = [replace(r, arrival_s=r.arrival_s + off) for trace, off in zip(traces, offsets, strict=True)
              for r in trace]
    return sorted(merged, key=lambda r: (r.arrival_s, r.session_id, r.turn))


def chat_tokens(body: dict[str, Any]) -> list[int]:
    """Prompt token ids of a chat body exactly as the simulator computes them with its built-in
    tokenizer: ChatML rendering with the generation prompt, 4 bytes per token."""
    return _BUILTIN.encode(render_chat(body["messages"]), add_special_tokens=False)


_BUILTIN = BuiltinTokenizer()


@dataclass
class OracleResult:
    """Per request (trace order): prompt tokens and oracle-reusable tokens; plus the trace's
    distinct full blocks (its working set, in blocks) and the share of requests with any reuse."""

    prompt_tokens: list[int] = field(default_factory=list)
    reusable_tokens: list[int] = field(default_factory=list)
    distinct_blocks: int = 0

    @property
    def total_reusable(self) -> int:
        return sum(self.reusable_tokens)

    @property
    def sharing_share(self) -> float:
        """Share of requests whose oracle-reusable tokens are above 0 (0.0 for an empty trace)."""
        n = len(self.reusable_tokens)
        return sum(1 for r in self.reusable_tokens if r > 0) / n if n else 0.0


def oracle_reusable_tokens(trace: Sequence[TimedRequest], tokenize: Callable[[dict[str, Any]], list[int]] = chat_tokens,
                           block_size: int = 16) -> OracleResult:
    """Oracle-reusable tokens of every request (shared/PERFORMANCE.md): the longest prefix, in whole
    blocks of ``block_size`` tokens, that the request shares with any earlier request of the trace
    (trace order) — what one engine with an unbounded cache would reuse. As vLLM (and the
    simulator) always recomputes the last prompt token, at most ``prompt_len - 1`` tokens count,
    rounded down to whole blocks.

    ``tokenize`` maps a body to its prompt token ids (default :func:`chat_tokens`, the simulator's
    built-in tokenizer). Each block is identified by a 128-bit hash chained over all tokens before
    it, so a block matches only when the whole prefix up to it matches. Raises ``ValueError`` for a
    ``block_size`` below 1.
    """
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    seen: set[bytes] = set()
    result = OracleResult()
    for request in trace:
        tokens = tokenize(request.body)
        data = array("I", tokens).tobytes()
        step = 4 * block_size
        parent = b""
        hashes = []
        for start in range(0, (len(tokens) // block_size) * step, step):
            parent = xxhash.xxh3_128_digest(parent + data[start:start + step])
            hashes.append(parent)
        hit = 0
        for h in hashes:
            if h not in seen:
                break
            hit += 1
        hit = min(hit, (len(tokens) - 1) // block_size) if tokens else 0
        seen.update(hashes)
        result.prompt_tokens.append(len(tokens))
        result.reusable_tokens.append(hit * block_size)
    result.distinct_blocks = len(seen)
    return result


# ---- Mooncake-format traces ----------------------------------------------------------------------
MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block of a Mooncake trace (Mooncake's published traces: 512)."""

_CHAT_OVERHEAD_BYTES = len(render_chat([{"role": "user", "content": ""}]).encode())  # 50: ChatML framing


@dataclass(frozen=True)
class MooncakeRecord:
    """One line of a Mooncake-format trace (the FAST'25 Mooncake traces' JSONL schema).

    ``timestamp_ms``: arrival, milliseconds from the trace's start. ``input_length`` /
    ``output_length``: prompt and answer tokens. ``hash_ids``: one id per 512-token block of the
    prompt (the last one may be partial), block 0 first; equal ids mean equal block content.
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(path: str | Path) -> list[MooncakeRecord]:
    """Records of a Mooncake JSONL file (blank lines skipped), sorted by timestamp (stable).

    Raises ``ValueError`` naming the line for a line that is not a JSON object with integer
    ``timestamp``, ``input_length`` ≥ 1, ``output_length`` ≥ 0 and a non-empty list of integer
    ``hash_ids`` (fewer ids than blocks is accepted: :func:`mooncake_trace` fills the rest with text
    of the record's own)."""
    out: list[MooncakeRecord] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            record = MooncakeRecord(int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                                    tuple(int(h) for h in row["hash_ids"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a Mooncake record ({exc})") from exc
        if record.input_length < 1 or record.output_length < 0 or not record.hash_ids:
            raise ValueError(f"{path}:{number}: input_length must be ≥ 1, output_length ≥ 0, hash_ids non-empty")
        out.append(record)
    return sorted(out, key=lambda r: r.timestamp_ms)


def write_mooncake(records: Sequence[MooncakeRecord], path: str | Path) -> None:
    """Write ``records`` as Mooncake JSONL (keys ``timestamp``, ``input_length``,
    ``output_length``, ``hash_ids``), one line each."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


def _block_text(hash_id: int, cache: dict[int, str]) -> str:
    text = cache.get(hash_id)
    if text is None:
        text = cache[hash_id] = _text(random.Random(f"mooncake-block-{hash_id}"), MOONCAKE_BLOCK_TOKENS,
                                      f"block {hash_id}:")
    return text


def mooncake_trace(records: Sequence[MooncakeRecord], start_min: float = 0.0, minutes: float | None = None,
                   speed: float = 1.0, max_model_len: int | None = None, max_output_tokens: int | None = None,
                   workload: str = "mooncake") -> list[TimedRequest]:
    """Open-loop requests from Mooncake records: each record is a one-turn session sent at its
    timestamp.

    Args:
        records: the trace (:func:`read_mooncake`), any order.
        start_min, minutes: keep the records from ``start_min`` minutes after the first timestamp,
            for ``minutes`` minutes (None: to the end); arrivals are counted from ``start_min``.
        speed: arrivals are ``(timestamp − start) / speed`` (2 = twice the rate).
        max_model_len: cap a prompt at ``max_model_len − output − 1`` tokens by dropping its
            trailing blocks (what an engine with that context window could serve); None = no cap.
        max_output_tokens: cap every ``output_length`` (None = as the trace says).
        workload: the requests' workload name.

    The prompt is one user message whose ChatML rendering is exactly ``input_length`` tokens of the
    simulator's built-in tokenizer (:func:`chat_tokens`): the concatenated text of its blocks, each
    hash id a deterministic 512-token text (so equal ids give equal tokens, whatever the record), the
    last block cut to fit. Raises ``ValueError`` for a non-positive ``speed`` or ``minutes``.
    """
    if speed <= 0 or (minutes is not None and minutes <= 0):
        raise ValueError("speed and minutes must be positive")
    if not records:
        return []
    first = min(r.timestamp_ms for r in records)
    start_ms = first + start_min * 60_000
    end_ms = start_ms + minutes * 60_000 if minutes is not None else None
    cache: dict[int, str] = {}
    out: list[TimedRequest] = []
    for k, r in enumerate(sorted(records, key=lambda r: r.timestamp_ms)):
        if r.timestamp_ms < start_ms or (end_ms is not None and r.timestamp_ms >= end_ms):
            continue
        output = max(1, min(r.output_length, max_output_tokens) if max_output_tokens else r.output_length)
        tokens = r.input_length
        if max_model_len is not None:
            tokens = min(tokens, max_model_len - output - 1)
        content_bytes = 4 * tokens - _CHAT_OVERHEAD_BYTES
        if content_bytes < 4:
            continue
        parts: list[str] = []
        size = 0
        for h in r.hash_ids:
            if size >= content_bytes:
                break
            parts.append(_block_text(h, cache))
            size += 4 * MOONCAKE_BLOCK_TOKENS
        if size < content_bytes:  # fewer ids than blocks: the rest is the record's own text
            parts.append(_text(random.Random(f"mooncake-record-{k}"), (content_bytes - size) // 4 + 1, f"rec {k}:"))
        content = "".join(parts)[:content_bytes]
        body = _body([{"role": "user", "content": content}], output)
        out.append(TimedRequest((r.timestamp_ms - start_ms) / 1000 / speed, f"{workload}-{k}", 0, 0.0, body, output,
                                workload))
    return out


def reusable_share(records: Sequence[MooncakeRecord], window_s: float = 300.0) -> float:
    """Share of prompt tokens reusable within ``window_s`` seconds: per record, the leading
    ``hash_ids`` that some record at most ``window_s`` earlier also had at the same position after
    the same ids (a whole-prefix match, 512 tokens each, at most ``input_length − 1`` tokens), over
    all prompt tokens. 0.0 for no records."""
    last_seen: dict[tuple[int, ...], float] = {}
    reusable = total = 0
    for r in sorted(records, key=lambda r: r.timestamp_ms):
        t = r.timestamp_ms / 1000
        hit = 0
        for i in range(len(r.hash_ids)):
            seen = last_seen.get(r.hash_ids[:i + 1])
            if seen is None or t - seen > window_s:
                break
            hit += 1
        reusable += min(hit * MOONCAKE_BLOCK_TOKENS, r.input_length - 1)
        total += r.input_length
        for i in range(len(r.hash_ids)):
            last_seen[r.hash_ids[:i + 1]] = t
    return reusable / total if total else 0.0


def long_context_records(seed: int = 0, conversations: int = 64, duration_s: float = 24.0,
                         median_tokens: int = 5000, sigma: float = 1.0, max_tokens: int = 122_000,
                         tail_share: float = 0.03, multi_turn_share: float = 0.2, turns: tuple[int, int] = (2, 3),
                         turn_tokens: tuple[int, int] = (300, 1500), think_s: float = 8.0,
                         output_tokens: tuple[int, int] = (100, 600)) -> list[MooncakeRecord]:
    """Long multi-turn conversations in Mooncake form (the shape of Mooncake's conversation trace):
    mean prompt about 12k tokens, a long tail to ``max_tokens``, about 20 % of prompt tokens
    reusable within 5 minutes (:func:`reusable_share`), open-loop arrivals.

    Args:
        seed: the only source of randomness.
        conversations: started uniformly over ``duration_s`` model seconds.
        median_tokens, sigma: first prompt of a conversation, log-normal (median, log-space
            sigma), at least 512 tokens and at most ``max_tokens``.
        tail_share: share of conversations (rounded; drawn without replacement, so every trace
            has its tail) whose first prompt is instead uniform between ``max_tokens / 2`` and
            ``max_tokens`` (the long tail: documents, code bases).
        multi_turn_share: share of conversations (rounded, drawn without replacement) with more
            than one turn (``turns``, inclusive); the others are one request.
        turn_tokens: tokens a later turn adds (the previous answer plus the new user message).
        think_s: mean gap between turns (exponential), model seconds.
        output_tokens: inclusive range of ``output_length``.

    A later turn repeats all the previous turn's full 512-token blocks (same ids) and adds new
    ones, like a chat history. Raises ``ValueError`` for a non-positive count or duration, or a
    share outside [0, 1].
    """
    if conversations < 1 or duration_s <= 0 or median_tokens < 1 or max_tokens < MOONCAKE_BLOCK_TOKENS:
        raise ValueError("conversations, duration_s, median_tokens must be positive; max_tokens ≥ 512")
    if not (0 <= multi_turn_share <= 1 and 0 <= tail_share <= 1):
        raise ValueError("multi_turn_share and tail_share must be in [0, 1]")
    rng = random.Random(seed)
    tail = set(rng.sample(range(conversations), round(tail_share * conversations)))
    multi = set(rng.sample(range(conversations), round(multi_turn_share * conversations)))
    next_id = 0
    out: list[MooncakeRecord] = []
    for c in range(conversations):
        t = rng.uniform(0, duration_s)
        length = int(min(max_tokens, max(MOONCAKE_BLOCK_TOKENS, rng.lognormvariate(math.log(median_tokens), sigma))))
        if c in tail:
            length = rng.randint(max_tokens // 2, max_tokens)
        ids: list[int] = []
        n_turns = rng.randint(*turns) if c in multi else 1
        for turn in range(n_turns):
            if turn:
                t += rng.expovariate(1 / think_s)
                length = min(max_tokens, length + rng.randint(*turn_tokens))
                ids = ids[:(len(ids) - 1)] if out[-1].input_length % MOONCAKE_BLOCK_TOKENS else ids
            while len(ids) < -(-length // MOONCAKE_BLOCK_TOKENS):
                ids.append(next_id)
                next_id += 1
            out.append(MooncakeRecord(round(t * 1000), length, rng.randint(*output_tokens), tuple(ids)))
    return sorted(out, key=lambda r: r.timestamp_ms)


CONVERSATION_DEFAULTS: dict[str, float] = {"rate_per_s": 3.1, "mean_prompt_tokens": 14_000.0,
                                            "max_tokens": 121_000.0, "mean_output_tokens": 343.0}
"""The public conversation trace's figures :func:`conversation_records` is fitted to: 556 requests
in a 3-minute window (3.1/s), mean prompt about 14k tokens, the longest about 121k (issue 27's
held-back window of Mooncake's production conversation trace); mean answer 343 tokens (the Mooncake
FAST'25 paper's conversation trace: 12,031 requests in an hour, mean input 12,035, output 343)."""


def conversation_records(seed: int = 0, duration_s: float = 120.0, rate_per_s: float = 3.1,
                         first_median_tokens: int = 6500, sigma: float = 1.1, max_tokens: int = 121_000,
                         mean_turns: float = 2.6, turn_tokens: tuple[int, int] = (200, 2500),
                         think_s: float = 45.0, system_prompts: int = 4, system_tokens: int = 1024,
                         mean_output_tokens: float = 343.0, warmup_s: float = 300.0) -> list[MooncakeRecord]:
    """A window of a multi-turn conversation service in Mooncake form, fitted to the public
    conversation trace's statistics (:data:`CONVERSATION_DEFAULTS`): mean prompt about 14k tokens
    with a tail to ``max_tokens``, about 3.1 requests/s, later turns reusing their conversation's
    history after a think time, about 38 % of prompt tokens reusable within 5 minutes
    (:func:`reusable_share`; the Mooncake paper reports a cache ratio of about 40 % for its
    conversation trace). Deterministic for a seed.

    Model: conversations start as a Poisson process over ``[-warmup_s, duration_s)`` (rate
    ``rate_per_s / mean_turns``); only the records inside ``[0, duration_s)`` are kept, so the window
    opens mid-stream as a cut of a production trace does (conversations already under way, their
    earlier turns outside the window). Each conversation starts with one of ``system_prompts``
    shared system prompts (``system_tokens``, whole 512-token blocks shared by every conversation
    using it; 0 prompts: none), then its own first message: total first prompt log-normal (median
    ``first_median_tokens``, log-space ``sigma``), at least 512 tokens, at most ``max_tokens``. It
    has ``1 + Geometric`` turns (mean ``mean_turns``); a later turn comes an exponential think time
    (mean ``think_s``) after the previous one plus its answer's decode time at 30 tokens/s, and its
    prompt is the previous prompt plus the previous answer plus a new user message
    (``turn_tokens``, inclusive range), capped at ``max_tokens``: it repeats every full 512-token
    block of the previous prompt (same ids) and continues with new ids. ``output_length``:
    exponential with mean ``mean_output_tokens``, 1 to 4,096.

    Raises ``ValueError`` for a non-positive duration, rate, median, think time or
    ``mean_turns`` below 1, or ``max_tokens`` below 512.
    """
    if duration_s <= 0 or rate_per_s <= 0 or first_median_tokens < 1 or think_s <= 0 or mean_turns < 1:
        raise ValueError("duration_s, rate_per_s, first_median_tokens, think_s must be positive; mean_turns ≥ 1")
    if max_tokens < MOONCAKE_BLOCK_TOKENS or system_prompts < 0 or system_tokens < 0:
        raise ValueError("max_tokens must be ≥ 512; system_prompts and system_tokens ≥ 0")
    rng = random.Random(seed)
    system_blocks = system_tokens // MOONCAKE_BLOCK_TOKENS if system_prompts else 0
    systems = [list(range(s * system_blocks, (s + 1) * system_blocks)) for s in range(system_prompts)]
    next_id = system_prompts * system_blocks
    more_turn = 1 - 1 / mean_turns  # geometric: P(another turn)
    out: list[MooncakeRecord] = []
    t = -warmup_s
    while True:
        t += rng.expovariate(rate_per_s / mean_turns)
        if t >= duration_s:
            break
        ids = list(rng.choice(systems)) if systems else []
        length = int(min(max_tokens, max(MOONCAKE_BLOCK_TOKENS, len(ids) * MOONCAKE_BLOCK_TOKENS + 1,
                                         rng.lognormvariate(math.log(first_median_tokens), sigma))))
        at = t
        while True:
            if len(ids) * MOONCAKE_BLOCK_TOKENS > length:  # a previous partial block: new content now
                ids = ids[:length // MOONCAKE_BLOCK_TOKENS]
            while len(ids) < -(-length // MOONCAKE_BLOCK_TOKENS):
                ids.append(next_id)
                next_id += 1
            output = min(4096, max(1, round(rng.expovariate(1 / mean_output_tokens))))
            if 0 <= at < duration_s:
                out.append(MooncakeRecord(round(at * 1000), length, output, tuple(ids)))
            if rng.random() >= more_turn or length >= max_tokens:
                break
            ids = ids[:length // MOONCAKE_BLOCK_TOKENS]  # the partial last block grows: new content
            at += output / 30.0 + rng.expovariate(1 / think_s)
            length = min(max_tokens, length + output + rng.randint(*turn_tokens))
    return sorted(out, key=lambda r: r.timestamp_ms)


# ---- tool/agent traffic and the shared-prefix batch ----------------------------------------------
def tool_agents(seed: int = 0, sessions: int = 48, tool_sets: int = 6, system_tokens: int = 1500,
                turns: tuple[int, int] = (10, 24), pause_s: float = 0.25, duration_s: float = 4.0,
                max_tokens: int = 24) -> list[TimedRequest]:
    """Tool/agent traffic: many parallel agents in long loops of short tool calls.

    How it differs from :func:`agentic_sessions` (same closed-loop mechanics, other shape): about
    3× as many concurrent agents on 6 tool sets of 1,500-token system prompts (not 2 of 4,000), 3×
    as many calls per session (10–24, not 3–8), each adding only a short call (15–60 tokens) and a
    short result (40–300, not 300–1,000), with short tool pauses (mean 0.25 s, not 1 s) and no
    one-off calls. Consecutive calls of a session share about 95 % of their prompt, so reuse comes
    mostly from each session's own growing history rather than from a shared system prompt; the
    sessions' histories together outgrow a GPU cache while each stays small. Workload name
    ``tool-agent``.
    """
    return agentic_sessions(seed, sessions=sessions, agents=tool_sets, system_tokens=system_tokens,
                            task_tokens=(100, 300), call_tokens=(15, 60), result_tokens=(40, 300), turns=turns,
                            pause_s=pause_s, one_off_share=0.0, duration_s=duration_s, max_tokens=max_tokens,
                            workload="tool-agent")


_BATCH_SYSTEM = (
    "\nYou read one short film synopsis at a time and label it.\nReturn a JSON object with two fields "
    "and nothing else:\n\n{\n    genres: string[] // the genres the synopsis makes plain, lower case, "
    "at most four,\n    logline: string // the story in a single sentence\n}\n\nA genre is a broad kind "
    "of film such as \"drama\", \"thriller\", \"animation\" or \"western\"; prefer the common name of a "
    "genre to a niche one and list the strongest first. Several genres are fine when the synopsis "
    "supports each of them; never guess a genre the text gives no sign of. The logline names the lead "
    "character by role rather than by name, states the goal and the obstacle, and stays under "
    "thirty words.\n"
)
_ROLES = ("retired detective", "young pilot", "grieving widow", "small-town baker", "rogue android",
          "exiled prince", "nervous intern", "veteran smuggler", "gifted violinist", "stubborn farmer")
_GOALS = ("must clear a stolen fortune", "searches for a missing sister", "races to stop a plague",
          "plots one last heist", "fights to save a failing theatre", "crosses a frozen desert",
          "uncovers a family secret", "trains for a championship", "escapes a sinking city")
_TWISTS = ("while a storm closes every road", "before the election night ends", "with a rival on each step",
           "as old friends turn on each other", "while hiding a dangerous gift", "against a corrupt mayor",
           "under the eye of a curious journalist", "as memories start to fade")


def shared_prefix_batch(seed: int = 0, lines: int = 1000, rate_per_s: float = 80.0,
                        max_tokens: int = 32) -> list[TimedRequest]:
    """A shared-prefix batch in the shape of the OpenAI cookbook's batch example (one fixed system
    prompt of about 190 tokens asking for a JSON classification, then one 1–2 sentence movie
    description per line as the user message; the texts here are our own, of the same lengths),
    sent open loop as a Poisson burst of ``rate_per_s`` requests per model second. Every line is
    a one-turn session; workload name ``shared-prefix-batch``. Raises ``ValueError`` for a
    non-positive argument."""
    if lines < 1 or rate_per_s <= 0 or max_tokens < 1:
        raise ValueError("lines, rate_per_s and max_tokens must be positive")
    rng = random.Random(seed)
    out: list[TimedRequest] = []
    t = 0.0
    for k in range(lines):
        t += rng.expovariate(rate_per_s)
        sentence = f"A {rng.choice(_ROLES)} {rng.choice(_GOALS)} {rng.choice(_TWISTS)}."
        if rng.random() < 0.5:
            sentence += f" Line {k}: " + _text(rng, rng.randint(8, 24))
        messages = [{"role": "system", "content": _BATCH_SYSTEM}, {"role": "user", "content": f"{sentence} ({k})"}]
        out.append(TimedRequest(t, f"batch-{seed}-{k}", 0, 0.0, _body(messages, max_tokens), max_tokens,
                                "shared-prefix-batch"))
    return out
