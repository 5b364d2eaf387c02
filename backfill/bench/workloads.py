"""Seeded request traces for the router benchmarks, and the oracle-reusable tokens of a trace.

A trace is a list of :class:`TimedRequest` in nominal arrival order, generated from a seed (nothing
is stored but the generator and its parameters). Two workloads, as shared/PERFORMANCE.md describes:

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

Text is made of seeded random words, so distinct texts never share a 16-token block by accident.
Token counts are for the simulator's built-in tokenizer (4 UTF-8 bytes per token over the ChatML
rendering, :mod:`engine_twin.tokenizer`); the texts are ASCII, so ``n`` tokens are ``4 n`` bytes.

Times are model seconds: the replayer multiplies them by the engines' ``time_scale``.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
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
                     duration_s: float = 9.0, max_tokens: int = 16) -> list[TimedRequest]:
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

    Raises ``ValueError`` for a non-positive count or a share outside [0, 1).
    """
    if sessions < 1 or agents < 1 or system_tokens < 1 or duration_s <= 0:
        raise ValueError("sessions, agents, system_tokens and duration_s must be positive")
    if not 0 <= one_off_share < 1:
        raise ValueError("one_off_share must be in [0, 1)")
    rng = random.Random(seed)
    systems = [_text(rng, system_tokens, f"agent-{a} instructions and tools:") for a in range(agents)]
    out: list[TimedRequest] = []
    for s in range(sessions):
        sid = f"agent-{seed}-{s}"
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
            out.append(TimedRequest(t, sid, turn, pause, _body(messages, max_tokens), max_tokens, "agentic"))
    one_offs = round(len(out) * one_off_share / (1 - one_off_share))
    for k in range(one_offs):
        sid = f"one-off-{seed}-{k}"
        messages = [{"role": "user", "content": _text(rng, rng.randint(*one_off_tokens), f"{sid}:")}]
        out.append(TimedRequest(rng.uniform(0, duration_s), sid, 0, 0.0, _body(messages, max_tokens), max_tokens,
                                "agentic"))
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
