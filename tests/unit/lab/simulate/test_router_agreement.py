"""The router and the simulator take the same decisions.

One decision sequence — endpoint states (scrapes), KV events, requests with prompts, sessions and
lanes, on an injected clock — runs through both:

* **router**: :func:`router.assembly.build_router` as ``router/app.py`` calls it (the endpoints
  joined and marked up as its probes do), each request through :meth:`Director.forward` with a
  transport that holds every leg open (a prompt too long for the engine gets its 400 at once);
* **simulator**: :class:`lab.simulate.sim.Simulation` with the same router settings
  (:func:`lab.simulate.sim.router_settings`), each request through :meth:`Simulation.dispatch`.

Both must give the same picks (every ``pre_request``: endpoint per request, the P/D legs and
prefill retries included), the same requests still running (so the same make-room victims), the
same refusals and the same in-flight counters per endpoint (read before every endpoint goes).
The simulator's engines run no step (its events are not processed), so nothing ends but by a
rule. The last tests change one of the simulator's rules and show the comparison fails.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

import lab.simulate.sim as sim_module
from lab.simulate.sim import MODEL, POLICIES, SimConfig, Simulation, router_settings, uses_kv_events
from lab.simulate.workload import SimRequest
from router.assembly import RouterParts, build_router
from router.director import Admitted, Attempt, Interruption, PrefillAnswer, Rejected
from router.kv_index.events import BlockStored
from router.pool import EndpointState, EngineMetrics
from router.scheduling.types import Endpoint, LLMRequest

BLOCK = 16  # the engines' block size (SimConfig's default)
GPU_BLOCKS = 512  # 8,192 tokens per engine: a prompt above it is too long for every engine


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(n)]


def _req(prefix: int, prefix_len: int, tail: int, tail_len: int, *, objective: str = "interactive",
         session: str | None = None, max_tokens: int = 8) -> SimRequest:
    tokens = _tokens(prefix, prefix_len) + _tokens(tail, tail_len)
    return SimRequest(0.0, len(tokens), max_tokens, tokens=tokens, session_id=session, objective=objective,
                      tenant="t0")


@dataclass
class Scrape:
    """A scrape of engine ``index`` (in the settings' engine order)."""

    index: int
    running: int
    waiting: int
    kv: float = 0.1


@dataclass
class Stored:
    """Engine ``index`` announces it holds the first ``blocks`` blocks of ``tokens``."""

    index: int
    tokens: list[int]
    blocks: int


@dataclass
class Tick:
    seconds: float


@dataclass
class AllDown:
    """Every endpoint is taken out (the requests still held end first: their clients went away)."""


Step = SimRequest | Scrape | Stored | Tick | AllDown


def _metrics(s: Scrape) -> EngineMetrics:
    return EngineMetrics(num_requests_waiting=s.waiting, num_requests_running=s.running, kv_cache_usage_perc=s.kv,
                         block_size=BLOCK, num_gpu_blocks=GPU_BLOCKS)


def _stored(s: Stored) -> list[BlockStored]:
    n = s.blocks
    return [BlockStored(list(range(1000 * (s.index + 1), 1000 * (s.index + 1) + n)), None, s.tokens[:n * BLOCK],
                        BLOCK, None, "GPU", None, [None] * n, 0, "full_attention")]


@dataclass
class Outcome:
    """What one side decided: the comparison."""

    picks: list[tuple[str, str]] = field(default_factory=list)
    outcomes: list[tuple[str | None, Any, Any]] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    ended: Counter[str] = field(default_factory=Counter)
    counters: dict[str, tuple[int, int, int]] = field(default_factory=dict)


AFFINITY_OUTCOME = "affinity-outcome/prefix-cache-affinity-filter"
SESSION_OUTCOME = "session-affinity-outcome/session-affinity-filter"


def _spy_picks(parts_scheduler: Any, picks: list[tuple[str, str]],
               outcomes: list[tuple[str | None, Any, Any]] | None = None) -> None:
    real = parts_scheduler.pre_request

    def pre_request(request: LLMRequest, result: Any) -> None:
        picks.append((request.request_id, result.endpoint.name))
        if outcomes is not None:  # the move rule's and the session filter's outcome of the decision
            outcomes.append((request.session_id, result.state.read(AFFINITY_OUTCOME),
                             result.state.read(SESSION_OUTCOME)))
        real(request, result)

    parts_scheduler.pre_request = pre_request


def _counters(states: dict[str, EndpointState]) -> dict[str, tuple[int, int, int]]:
    return {name: (s.endpoint.in_flight_requests, s.endpoint.in_flight_uncached_tokens, s.endpoint.in_flight_sheddable)
            for name, s in states.items()}


# ---- the simulator's side -------------------------------------------------------------------------
def _simulator(config: SimConfig, policy: str, steps: list[Step]) -> Outcome:
    sim = Simulation(config, policy, iter([]))
    out = Outcome()
    _spy_picks(sim.scheduler, out.picks, out.outcomes)
    names = sim.router_settings.all_engines
    for step in steps:
        if isinstance(step, SimRequest):
            sim.dispatch(step)
        elif isinstance(step, Scrape):
            sim.pool.record_metrics(sim.pool.states[names[step.index]], _metrics(step))
        elif isinstance(step, Stored):
            assert sim.index is not None
            sim.index.apply(names[step.index], MODEL, _stored(step))
        elif isinstance(step, Tick):
            sim.clock.now += step.seconds
        else:
            out.running, out.counters = set(sim.live), _counters(sim.pool.states)
            sim.live.clear()  # clients gone (the counters go with the endpoints)
            for name in names:
                sim.pool.mark_down(name)
    out.ended = Counter(sim.dropped)
    return out


# ---- the router's side ----------------------------------------------------------------------------
class _NullObserver:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class _Transport:
    """One request's transport (a ``PDForwarder``): a prompt too long for the engine gets a 400 at
    once (the prefill leg's ``client_error``, the decode engine's answer passed to the client);
    every other leg holds open (the simulator's engines run no step in these sequences)."""

    disaggregable = True
    not_disaggregable_reason = "not_generation"

    def __init__(self, too_long: bool, held: asyncio.Event) -> None:
        self.too_long = too_long
        self.held = held
        self.ended: str | None = None

    async def send(self, attempt: Attempt, retry: bool) -> str | None:
        if self.too_long:
            self.ended = "too_long"
            return "400"
        await self.held.wait()
        return "200"

    async def interrupted(self, attempt: Attempt, interruption: Interruption) -> str:
        self.ended = interruption.code
        return interruption.code

    def rejected(self, rejected: Rejected) -> str:
        self.ended = rejected.code
        return rejected.code

    async def prefill(self, attempt: Attempt) -> PrefillAnswer:
        if self.too_long:
            return PrefillAnswer(None, "client_error")
        await self.held.wait()  # the simulator's prefill leg ends with its engine's step: not here
        return PrefillAnswer({"remote_engine_id": attempt.endpoint.name}, cached_tokens=0)

    def use_kv_transfer(self, params: dict[str, Any] | None, prefill_cached_tokens: int | None = None) -> None:
        return None


async def _settle() -> None:
    """Let the forwards run to where they wait (in-process tasks only: no I/O, no timers)."""
    for _ in range(20):
        await asyncio.sleep(0)


def _app_router(config: SimConfig, policy: str, clock: Callable[[], float]) -> RouterParts:
    """The router as ``router/app.py`` builds it, with the settings the simulator derives."""
    path, profile = (None, None) if policy == "pd" else POLICIES[policy]
    settings = router_settings(config, path, profile)
    parts = build_router(settings, clock, observer=_NullObserver(),  # type: ignore[arg-type]
                         flow_config=sim_module.bench_flow_control(config.total_engines),
                         kv_index=uses_kv_events(settings.scheduling_config), rng=random.Random(config.seed))
    roles = settings.engine_roles
    for name in settings.all_engines:  # joined and marked up as the probes do, in the settings' order
        parts.pool.add(EndpointState(Endpoint(name, role=roles.get(name, "both"))))
        parts.pool.mark_up(name)
        parts.pool.set_models(name, [MODEL])
    return parts


async def _router_async(config: SimConfig, policy: str, steps: list[Step]) -> Outcome:
    now = [0.0]
    parts = _app_router(config, policy, lambda: now[0])
    director = parts.director
    out = Outcome()
    _spy_picks(parts.scheduler, out.picks, out.outcomes)
    names = parts.settings.all_engines
    held = asyncio.Event()
    transports: dict[str, _Transport] = {}
    tasks: dict[str, asyncio.Task[Any]] = {}
    limit = GPU_BLOCKS * BLOCK
    for step in steps:
        if isinstance(step, SimRequest):
            rid = f"req-{len(transports) + 1}"  # the simulator's request ids
            assert step.tokens is not None
            llm = LLMRequest(request_id=rid, model=MODEL, prompt_token_ids=step.tokens, session_id=step.session_id,
                             objective=step.objective, priority=director.objective_priority[step.objective],
                             sheddable=step.objective in director.sheddable_objectives)
            transports[rid] = transport = _Transport(step.input_tokens + 1 > limit, held)
            tasks[rid] = asyncio.create_task(director.forward(llm, step.objective, Admitted(None), transport))
            await _settle()
        elif isinstance(step, Scrape):
            parts.pool.record_metrics(parts.pool.states[names[step.index]], _metrics(step))
        elif isinstance(step, Stored):
            assert parts.index is not None
            parts.index.apply(names[step.index], MODEL, _stored(step))
        elif isinstance(step, Tick):
            now[0] += step.seconds
        else:
            out.running = {rid for rid, t in tasks.items() if not t.done()}
            out.counters = _counters(parts.pool.states)
            running = [t for t in tasks.values() if not t.done()]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            for name in names:
                parts.pool.mark_down(name)
    out.ended = Counter(t.ended for rid, t in transports.items() if t.ended is not None and not tasks[rid].cancelled())
    held.set()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    return out


def _router(config: SimConfig, policy: str, steps: list[Step]) -> Outcome:
    return asyncio.run(_router_async(config, policy, steps))


# ---- the sequences --------------------------------------------------------------------------------
def _aggregated_steps(precise: bool) -> list[Step]:
    """Three engines: shared prefixes, sessions, batch requests, scrapes that teach the engines'
    slots (full with requests waiting), then interactive requests that make room, and a refusal
    when every engine is gone."""
    doc_b = _tokens(2, 1024)
    steps: list[Step] = [Scrape(i, 0, 0) for i in range(3)]
    if precise:
        steps += [Stored(2, doc_b + _tokens(99, 64), 64)]  # engine 2 holds doc_b's 1,024 tokens
    steps += [
        _req(1, 1024, 10, 40, session="s1"),
        Tick(0.01), _req(1, 1024, 11, 40),
        Tick(0.01), _req(2, 1024, 12, 40, session="s2"),
        Tick(0.01), _req(3, 600, 13, 20, objective="batch"),  # one shared document: mostly one engine
        Tick(0.01), _req(3, 600, 14, 20, objective="batch"),
        Tick(0.01), _req(3, 600, 15, 20, objective="batch"),
        Tick(0.01), _req(6, 600, 16, 20, objective="batch"),
        Tick(0.05), *[Scrape(i, 3, 1) for i in range(3)],  # full with requests waiting, twice in a row
        Tick(0.05), *[Scrape(i, 3, 1) for i in range(3)],  # (router.pool.slots): 3 slots learned
        Tick(0.01), _req(1, 1024, 17, 40, session="s1"),
        Tick(0.01), _req(3, 600, 18, 30),
        Tick(0.01), _req(2, 1024, 19, 40, session="s2"),
        Tick(0.01), _req(8, 300, 20, 30),
        Tick(0.5), *[Scrape(i, 1, 0) for i in range(3)],
        Tick(0.01), _req(9, 200, 21, 10, objective="batch"),
        # every engine saturated alike: the session filter releases s1 to the move rule, which
        # keeps it on its engine (a move would add its recompute to another full queue)
        Tick(0.5), *[Scrape(i, 4, 6) for i in range(3)],
        Tick(0.01), _req(1, 1024, 23, 40, session="s1"),
        AllDown(), _req(1, 1024, 22, 10),
    ]
    return steps


def _pd_steps() -> list[Step]:
    """Two prefill and two decode engines: long prompts disaggregated, short ones not, a prompt too
    long for every engine (the prefill leg's 400: not retried, aggregated, refused), batch beside."""
    return [
        *[Scrape(i, 0, 0) for i in range(4)],
        _req(1, 2048, 10, 100, session="s1"),
        Tick(0.01), _req(2, 64, 11, 20),
        Tick(0.01), _req(1, 2048, 12, 100),
        Tick(0.01), _req(3, 9000, 13, 10),  # > 8,192 tokens: too long for the prefill engine
        Tick(0.01), _req(4, 3000, 14, 50, objective="batch"),
        Tick(0.01), _req(5, 3000, 15, 50, objective="batch"),
        Tick(0.05), *[Scrape(i, 2, 1) for i in range(4)],
        Tick(0.01), _req(6, 4096, 16, 10),
        Tick(0.01), _req(1, 2048, 17, 100, session="s1"),
        AllDown(), _req(2, 64, 18, 10),
    ]


def _config(policy: str) -> SimConfig:
    if policy == "pd":
        return SimConfig(engines=0, prefill_engines=2, decode_engines=2, gpu_blocks=GPU_BLOCKS, seed=7)
    return SimConfig(engines=3, gpu_blocks=GPU_BLOCKS, seed=7)


def _steps(policy: str) -> list[Step]:
    return _pd_steps() if policy == "pd" else _aggregated_steps(policy == "precise")


@pytest.mark.parametrize("policy", ["approximate", "precise", "pd"])
def test_the_router_and_the_simulator_take_the_same_decisions(policy: str) -> None:
    config, steps = _config(policy), _steps(policy)
    router, simulated = _router(config, policy, steps), _simulator(config, policy, steps)
    assert simulated.picks == router.picks
    assert simulated.outcomes == router.outcomes
    assert simulated.running == router.running
    assert simulated.ended == router.ended
    assert simulated.counters == router.counters
    # the sequence reaches the rules it is meant to compare
    assert router.ended["no_healthy_endpoints"] == 1
    assert len({endpoint for _, endpoint in router.picks}) >= 3
    if policy == "pd":
        assert router.ended["too_long"] == 1
        assert len(router.picks) > len({rid for rid, _ in router.picks})  # prefill and decode picks
    else:
        assert router.ended["evicted"] >= 1  # make-room evicted a batch request
        # the session filter handed s1's saturated engine to the move rule, which kept it there
        s1 = [(endpoint, session) for (sid, _, session), (_, endpoint) in zip(router.outcomes, router.picks,
                                                                            strict=True) if sid == "s1"]
        assert [session for _, session in s1][-1] == "released"
        assert len({endpoint for endpoint, _ in s1}) == 1


def test_the_comparison_catches_a_drift_of_the_prefill_retry_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's old rule (every refused prefill tried again) against the director's (never
    after a client error): the picks differ."""
    config, steps = _config("pd"), _steps("pd")
    router = _router(config, "pd", steps)
    monkeypatch.setattr(sim_module, "should_retry_prefill", lambda failure, tries: tries < 2)
    simulated = _simulator(config, "pd", steps)
    assert simulated.picks != router.picks


def test_the_comparison_catches_a_drift_of_the_make_room_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """A simulator that evicts the oldest sheddable request instead of the newest."""
    config, steps = _config("approximate"), _steps("approximate")
    router = _router(config, "approximate", steps)
    monkeypatch.setattr(sim_module, "pick_victim", lambda victims: min(victims, key=lambda v: v.started_at))
    simulated = _simulator(config, "approximate", steps)
    assert (simulated.picks, simulated.running) != (router.picks, router.running)
