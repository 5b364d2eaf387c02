"""One simulated run: the whole fleet in virtual time with the production router and processor code.

What runs (the same classes as production, never copies):

* **Router**: built by :func:`router.assembly.build_router` — the one assembly ``router/app.py``
  calls — from the router's settings for this fleet (:func:`router_settings`: its engines by role,
  the policy's scheduling config and profile, flow control off) with the virtual clock, a seeded
  rng and the KV index when the config reads it; no I/O attached. Decisions through
  :meth:`router.director.Director.decide` (schedule → ``pre_request``) and the director's rules of
  :mod:`router.decisions` (the decode share, make-room's reason and victim, the P/D legs' retries
  and fallback); the pool's in-flight counters (:meth:`~router.pool.PoolState.started`,
  ``first_chunk``, ``finished``), ``response_complete`` with the engine's cached tokens; admission
  by the pure :class:`~router.flow_control.core.FlowControlCore` gated on
  ``RouterRuntime.gate_saturation`` / ``unreserved_gate_saturation``.
* **Processor** (requests with ``via_queue``): per-lane queues read into the processor's
  :class:`~async_processor.lanes.LaneBuffer` (fair shares per tenant and batch) and popped through
  :class:`~async_processor.gates.AllGates` of the :class:`~async_processor.gates.ConcurrencyGate`,
  an optional :class:`~async_processor.gates.TenantQuotaGate` and the real
  :class:`~async_processor.gates.SaturationGate`, whose ``GET /admin/state`` is answered in process
  with the simulated router's ``gate_saturation``. A router refusal (429) goes back to the lane
  after ``Retry-After``, as the processor retries it.
* **Engines**: :class:`~lab.simulate.fleet.FleetEngine` (the twin's pure core); a step starts
  when the previous one ends, its duration from the twin's step model; its KV events reach the
  index when it ends (plus ``kv_event_delay_s``); "scrapes" every ``scrape_interval_s`` go through
  :meth:`~router.pool.PoolState.record_metrics`.

The per-request flow is in one place: :meth:`Simulation._arrive` → (processor) →
:meth:`Simulation._admit` (flow control) → :meth:`Simulation._forward` (schedule, pool, engine) →
:meth:`Simulation._end_step` (tokens) → :meth:`Simulation._finish` (hooks, release, next turn).

**Prefill/decode disaggregation** (``prefill_engines`` > 0: the shipped ``pd-config.yaml`` unless
a config is given, as ``router/settings.py`` picks it; engines of role ``prefill`` / ``decode``
beside ``engines`` of role ``both``), as :meth:`router.director.Director.forward` runs it with a
P/D transport: :meth:`Director.decide <router.director.Director.decide>` (``Scheduler.decide``,
``pre_request`` for both picks); the decode pick's pool share starts at the decision with no
prefill tokens; the prefill leg (its own pool share of the prefill pick's uncached tokens) runs
on the prefill engine as vLLM's NixlConnector prefill does: ``max_tokens`` 1 and
``remote_decode`` (``do_remote_decode``), so its blocks stay in ``EngineCore.held`` after its one
token (:meth:`Simulation._prefill_done`: the leg's share ends, ``response_complete`` with the
prefill engine's cached tokens); then the decode engine gets the request by
``EngineCore.add_remote``; each :class:`~engine_twin.core.KVLoad` of its steps arrives the
modelled transfer time after the step's start (:meth:`Simulation._kv_arrived`:
``kv_arrived`` on the decode engine, ``release_held`` on the prefill engine: the notification);
the decode engine then computes the last prompt token and streams every output token, so TTFT is
arrival → the decode engine's first token and ITL its gaps. The client's ``cached_tokens`` is the
prefill leg's (:class:`router.disagg.ClientUsage`), the decode pick's ``response_complete`` gets
the decode engine's. A prefill leg the prefill engine refuses (too long for it: vLLM's 400,
``client_error``) is not tried on another prefill engine
(:func:`router.decisions.should_retry_prefill`): the decode engine runs the request whole
(``PoolState.add_prefill`` of :func:`router.decisions.fallback_prefill_tokens`), as the director
falls back.

**Make-room** (:attr:`SimConfig.make_room`, the router's default on): :meth:`Simulation._make_room`.

Nothing here sleeps or reads ``time.monotonic``: the only real clock read is ``perf_counter``
around each decision (the director's own timing, reported as ``decision_p50_ms``) and the run's
wall time.
"""

from __future__ import annotations

import contextlib
import gc
import random
import resource
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from async_processor.backends.base import Delivery
from async_processor.gates import AllGates, ConcurrencyGate, Gate, SaturationGate, TenantQuotaGate
from async_processor.lanes import LaneBuffer, Work
from async_processor.router_client import Answer
from common.contracts.queue import LANE_PRIORITIES, RequestMessage
from engine_twin.core import CoreRequest, KVLoad, StepOutcome
from engine_twin.kv_cache import DEFAULT_RETENTION, none_hash
from engine_twin.launch import BACKGROUND_PRIORITY_THRESHOLD, FLEET_RETENTION_PRIORITY_THRESHOLD
from engine_twin.retention import request_retention
from engine_twin.settings import EngineSimSettings, build_settings
from lab.simulate.clock import EventQueue, VirtualClock
from lab.simulate.fleet import FleetEngine, to_router_events
from lab.simulate.workload import PieceTokens, PromptMemo, SimRequest
from lab.toolkit.stats import LogHistogram, percentile
from router.assembly import build_router
from router.decisions import (
    MAX_PREFILL_TRIES,
    PREFILL_CLIENT_ERROR,
    decode_share_tokens,
    fallback_prefill_tokens,
    make_room_reason,
    pick_victim,
    should_retry_prefill,
    uncached_tokens,
)
from router.director import Director
from router.flow_control import FlowControlConfig, FlowControlCore, FlowItem, RequestDropped, Ticket
from router.parsing import engine_priority
from router.runtime import RouterRuntime
from router.scheduling import DEFAULT_CONFIG_PATH
from router.scheduling.config import load_config
from router.scheduling.plugins.disagg import PDReason
from router.scheduling.scheduler import Scheduler
from router.scheduling.types import LLMRequest, PDDecision, SchedulingResult
from router.settings import RouterSettings
from router.settings import build_settings as build_router_settings

PRECISE_CONFIG_PATH = DEFAULT_CONFIG_PATH.with_name("precise-config.yaml")

#: Policy name → (scheduling config, profile). ``round-robin`` is the baseline profile of the shipped
#: default config (the benchmarks' round-robin baseline).
POLICIES: dict[str, tuple[Path, str | None]] = {
    "round-robin": (DEFAULT_CONFIG_PATH, "round-robin"),
    "approximate": (DEFAULT_CONFIG_PATH, "default"),
    "precise": (PRECISE_CONFIG_PATH, "default"),
}

PD_POLICY = "pd"
"""The policy of a fleet with prefill engines: the shipped ``pd-config.yaml`` (its P/D profile
handler; what the router runs when given ``--prefill-engine`` and no ``--config``)."""

#: The P/D flow's NIXL connector on every engine (what ``backfill up`` / ``bench pd`` launch:
#: ``engine_twin/launch.py``; ``recompute`` so a failed KV read recomputes on the decode engine).
PD_KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}

MODEL = "sim-model"


def bench_flow_control(engines: int = 4) -> FlowControlConfig:
    """The shipped flow-control defaults without the interactive band's per-tenant limits (what
    ``backfill bench prefix`` runs our router with, ``lab/toolkit/launch.py``: a trace replayer
    is one client, its requests would otherwise share one tenant's 16 in flight), and the
    interactive bypass bound ``max_in_flight`` at the larger of the default 64 and 5 × ``engines``
    (the sizing rule of ``router/flow_control/config.py``: "set it near 5 × the number of engines")."""
    data = FlowControlConfig().model_dump(mode="json")
    for band in data["bands"]:
        if band["objective"] == "interactive":
            band["tenant_max_in_flight"] = band["tenant_max_queued"] = None
            band["max_in_flight"] = max(band["max_in_flight"] or 0, 5 * engines)
    return FlowControlConfig.model_validate(data)


@dataclass
class SimConfig:
    """The fleet and the knobs of one run. Sizes in blocks of ``block_size`` tokens; defaults are
    the twin's (``engine_twin/settings.py``: vLLM's on an H100-class GPU) and the router's
    (``router/settings.py``) unless said otherwise.

    ``scheduling_policy`` ``priority``: the router sends vLLM's ``priority`` (``-objective
    priority``, :func:`router.parsing.engine_priority`) and the engines run the fleet's background
    and retention thresholds (``engine_twin/launch.py``), as ``backfill up`` runs them.
    ``kv_event_delay_s``: from a step's end to its events reaching the index (0: at once).
    ``processor_*``: :mod:`async_processor.settings`' defaults (64 in flight, 8 / 4 reserved for
    interactive / async, tenant gate off, saturation gate on here, polled every 0.25 s).
    """

    engines: int = 4
    """Engines of role ``both`` (prefill and decode, as without disaggregation)."""
    prefill_engines: int = 0
    """Engines of role ``prefill`` (disaggregation: the P/D config; needs ``decode_engines``)."""
    decode_engines: int = 0
    """Engines of role ``decode``."""
    gpu_blocks: int = 8192
    cpu_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    scheduling_policy: str = "priority"
    seed: int = 0
    scrape_interval_s: float = 0.05
    kv_event_delay_s: float = 0.0
    kv_transfer_bandwidth_gb_s: float | None = None
    """The P/D link's GB/s (None: the twin's ``--kv-transfer-bandwidth`` default, 50)."""
    gc_threshold: int | None = 100_000
    """The garbage collector's young-generation threshold during a run, allocations (None:
    CPython's default, 700); :func:`_collect_rarely` says why."""
    flow_control: FlowControlConfig | None = None
    """None: :func:`bench_flow_control` for :attr:`total_engines`."""
    processor_concurrency: int = 64
    processor_reserved: dict[str, int] = field(default_factory=lambda: {"interactive": 8, "async": 4})
    processor_tenant_limit: int = 0
    processor_saturation_poll_s: float = 0.25
    processor_buffer: int = 1024
    retry_after_s: float = 1.0
    make_room: bool = True
    """The router's make-room (``router/settings.py``, on by default): a non-sheddable request
    bound for an engine with no free slot evicts a sheddable one there (:meth:`Simulation._make_room`)."""
    evict_on_wait: bool = False
    """The router's ``evict_on_wait`` (off by default): make-room also when the request would wait."""

    @property
    def total_engines(self) -> int:
        """Engines of every role."""
        return self.engines + self.prefill_engines + self.decode_engines

    @property
    def disaggregated(self) -> bool:
        """The fleet has prefill engines (prefill/decode disaggregation)."""
        return self.prefill_engines > 0

    def engine_settings(self) -> EngineSimSettings:
        """The twin's settings of every engine (raises ``pydantic.ValidationError`` for bad sizes);
        with prefill engines, every engine runs :data:`PD_KV_TRANSFER_CONFIG`."""
        priority = self.scheduling_policy == "priority"
        return build_settings(
            kv_transfer_config=dict(PD_KV_TRANSFER_CONFIG) if self.disaggregated else None,
            kv_transfer_bandwidth_gb_s=self.kv_transfer_bandwidth_gb_s,
            num_gpu_blocks=self.gpu_blocks, cpu_offload_blocks=self.cpu_blocks, block_size=self.block_size,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.model_len(), scheduling_policy=self.scheduling_policy, hash_seed=str(self.seed),
            served_model_name=[MODEL],
            background_priority_threshold=BACKGROUND_PRIORITY_THRESHOLD if priority else None,
            retention_priority_threshold=FLEET_RETENTION_PRIORITY_THRESHOLD if priority else None)

    def model_len(self) -> int:
        """``max_model_len``: as given, else what the GPU cache holds (at most 131,072 tokens)."""
        return self.max_model_len or min(131_072, self.gpu_blocks * self.block_size)


def router_settings(config: SimConfig, config_path: Path | None, profile: str | None) -> RouterSettings:
    """The router's settings for a simulated fleet, the rest from the environment and the defaults
    (``router/settings.py``): its engines by role (``http://sim-<i>:8000``, ``http://sim-p<i>:8000``,
    ``http://sim-d<i>:8000``), the scheduling config ``config_path`` (None: the router's choice, the
    P/D config when prefill engines are given) and ``profile``, the scrape interval, the engines'
    token budget, make-room, and flow control off (the simulation steps its own
    :class:`~router.flow_control.FlowControlCore`, :func:`router.assembly.build_router`).

    Raises:
        pydantic.ValidationError: a value the router's settings refuse.
    """
    return build_router_settings(
        engines=[f"http://sim-{i}:8000" for i in range(config.engines)],
        prefill_engines=[f"http://sim-p{i}:8000" for i in range(config.prefill_engines)],
        decode_engines=[f"http://sim-d{i}:8000" for i in range(config.decode_engines)],
        config=config_path, profile=profile, scrape_interval_s=config.scrape_interval_s,
        max_num_batched_tokens=config.max_num_batched_tokens, make_room=config.make_room,
        evict_on_wait=config.evict_on_wait, flow_control_enabled=False)


def uses_kv_events(config_path: Path) -> bool:
    """The scheduling config reads the KV-event index (it has a ``precise-prefix-cache-producer``).

    Raises:
        router.scheduling.errors.ConfigError, OSError: a bad or unreadable config.
    """
    return any(p.type == "precise-prefix-cache-producer" for p in load_config(config_path).plugins)


@dataclass(eq=False, slots=True)
class _Live:
    """One request between its arrival and its end."""

    req: SimRequest
    rid: str
    arrival: float
    oracle: int
    work: Work | None = None
    ticket: Ticket | None = None
    llm: LLMRequest | None = None
    result: SchedulingResult | None = None
    share: Any = None
    core: CoreRequest | None = None
    engine: FleetEngine | None = None
    first_token: float | None = None
    last_token: float = 0.0
    itl: Any = None
    # the prefill leg of a disaggregated request (P/D)
    prefill: SchedulingResult | None = None
    prefill_share: Any = None
    prefill_core: CoreRequest | None = None
    prefill_engine: FleetEngine | None = None
    client_cached: int | None = None

    @property
    def priority(self) -> int:
        """Its band's priority (make-room's victim order, :func:`router.decisions.pick_victim`)."""
        assert self.llm is not None
        return self.llm.priority

    @property
    def started_at(self) -> float:
        """When its decode pick's share started (the pool's clock)."""
        return self.share.started_at


class _Observer:
    """The director's observer: keeps each decision's ``perf_counter`` seconds; the rest is ignored."""

    def __init__(self) -> None:
        self.decision_s = array("d")
        self.prefix_hits = 0

    def scheduled(self, seconds: float, prefix_hit: bool) -> None:
        self.decision_s.append(seconds)
        self.prefix_hits += prefix_hit

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class _StateClient:
    """The processor's router client for the saturation gate: ``GET /admin/state`` answered in
    process with the simulated router's ``gate_saturation`` (the contract's field)."""

    def __init__(self, runtime: RouterRuntime) -> None:
        self.runtime = runtime

    async def get(self, url: str, timeout_s: float) -> Answer:
        return Answer(200, orjson.dumps({"gate_saturation": self.runtime.gate_saturation()}))

    async def post(self, *args: Any, **kwargs: Any) -> Answer:
        """Never called: the saturation gate only reads the state. Raises RuntimeError."""
        raise RuntimeError("the simulated router state answers GET /admin/state only")

    async def aclose(self) -> None:
        return None


def _run_now(coro: Any) -> None:
    """Run a coroutine that never awaits anything pending (the in-process client) to its end."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("a simulated coroutine tried to wait")


class Simulation:
    """One run of ``arrivals`` through the fleet under one policy (module docstring).

    Args:
        config: the fleet and knobs.
        policy: a key of :data:`POLICIES`, :data:`PD_POLICY` (the fleet must have prefill engines),
            or any name with ``config_path`` given.
        arrivals: requests in arrival order (an iterator is consumed lazily).
        config_path, profile: a scheduling config YAML and its profile (None: the first; with a
            P/D profile handler in the config and no profile, its P/D decision).

    Raises:
        KeyError: an unknown policy without ``config_path``.
        ValueError: prefill engines without decode-capable ones, no engine at all, or a fleet
            with prefill engines under a shipped policy other than :data:`PD_POLICY`; a
            ``profile`` not in the config (:func:`router.assembly.build_router`).
        router.scheduling.errors.ConfigError, OSError: a bad or unreadable config.
    """

    def __init__(self, config: SimConfig, policy: str, arrivals: Iterable[SimRequest],
                 config_path: Path | None = None, profile: str | None = None) -> None:
        self.config = config
        self.policy = policy
        if config.total_engines < 1:
            raise ValueError("the fleet needs at least one engine")
        if config.prefill_engines and not (config.engines or config.decode_engines):
            raise ValueError("prefill engines need decode engines (or engines of role both) to decode")
        if config_path is None:
            if policy == PD_POLICY:
                if not config.disaggregated:
                    raise ValueError(f"policy {PD_POLICY!r} needs prefill engines")
                profile = None  # the router's settings pick the P/D config (prefill engines given)
            else:
                config_path, profile = POLICIES[policy]
                if config.disaggregated:
                    raise ValueError(f"a fleet with prefill engines runs policy {PD_POLICY!r} (the P/D config) "
                                     "or a config of its own")
        self.clock = VirtualClock()
        self.events = EventQueue(self.clock)
        settings = config.engine_settings()
        self.settings = settings
        self.priority_policy = settings.scheduling_policy == "priority"
        fc = config.flow_control or bench_flow_control(config.total_engines)
        self.observer = _Observer()
        self.router_settings = router_settings(config, config_path, profile)
        self.parts = build_router(self.router_settings, self.clock, observer=self.observer,
                                  flow_config=fc, kv_index=uses_kv_events(self.router_settings.scheduling_config),
                                  rng=random.Random(config.seed))
        self.pool, self.runtime, self.index = self.parts.pool, self.parts.runtime, self.parts.index
        self.scheduler: Scheduler = self.parts.scheduler
        self.director: Director = self.parts.director
        self.profile = profile or self.scheduler.default_profile
        #: the P/D decision (the config's profile handler, no profile named), as the router runs it
        self.pd = self.scheduler.profile_handler is not None and profile is None
        self.key_shapes = sorted({(p.block_size_tokens, p.max_blocks) for p in self.plugins()
                                  if hasattr(p, "block_size_tokens") and hasattr(p, "max_blocks")})
        self.flow = FlowControlCore(fc)
        self.runtime.flow = self.flow  # type: ignore[assignment]  # reads in_flight_requests only
        self.objective_priority = self.director.objective_priority
        self.engines: list[FleetEngine] = []
        roles = self.router_settings.engine_roles
        for name in self.router_settings.all_engines:
            engine = FleetEngine.build(name, settings, MODEL, role=roles.get(name, "both"),  # type: ignore[arg-type]
                                       collect_events=self.index is not None)
            self.engines.append(engine)
            self.pool.add(engine.state)
        self.by_name = {e.name: e for e in self.engines}
        self.memo = PromptMemo(config.block_size, none_hash(settings.hash_seed), MODEL, PieceTokens(str(config.seed)))
        # processor
        lanes = list(LANE_PRIORITIES)
        self.lanes = LaneBuffer(lanes, config.processor_buffer)
        self.queues: dict[str, deque[_Live]] = {lane: deque() for lane in lanes}
        gates: list[Gate] = [ConcurrencyGate(config.processor_concurrency, config.processor_reserved)]
        if config.processor_tenant_limit:
            gates.append(TenantQuotaGate(config.processor_tenant_limit))
        self.saturation_gate = SaturationGate(_StateClient(self.runtime), "http://router", clock=self.clock)
        gates.append(self.saturation_gate)
        self.gates = AllGates(gates)
        self.held: dict[Work, _Live] = {}
        # run state
        self._arrivals: Iterator[SimRequest] = iter(arrivals)
        self._pending_arrivals = 0
        self.live: dict[str, _Live] = {}
        self.sheddable_on: dict[str, dict[_Live, None]] = {}  # endpoint → sheddable requests running there
        self._tickets: dict[int, _Live] = {}
        self._ids = 0
        self._flow_wake = False
        self._pump_at: float | None = None
        # results
        self.ttft = array("d")
        self.cached = array("q")
        self.oracle = array("q")
        self.prompt_tokens = array("q")
        self.finished_at = array("d")
        self.groups: list[tuple[str, str]] = []
        self.group_of = array("H")
        self.itl = LogHistogram()
        self.itl_by_workload: dict[str, LogHistogram] = {}
        self.ttft_by_workload: dict[str, array[float]] = {}
        # P/D
        self.pd_reasons: Counter[str] = Counter()
        self.prefill_legs = 0
        self.prefill_generated = 0
        self.prefill_retries = 0
        self.pd_fallbacks = 0
        self.kv_transfers = 0
        self.kv_transfer_bytes = 0
        self.kv_transfer_blocks = 0
        self.kv_transfer_s = array("d")
        self.held_released = 0
        self.held_expired = 0
        self.dropped: Counter[str] = Counter()
        self.make_room_evictions = 0
        self.retries = 0
        self.arrived = 0
        self.first_arrival: float | None = None
        self.wall_s = 0.0

    # ---- introspection -----------------------------------------------------------------------
    def plugins(self) -> list[object]:
        """Every plugin instance of the scheduler, each once (the objects the decisions call)."""
        return self.parts.plugins()

    # ---- driving -----------------------------------------------------------------------------
    def run(self, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Run to the end (every request answered or dropped); the figures (:meth:`figures`).
        ``progress(requests ended)`` is called every 1,000 ended requests."""
        started = time.perf_counter()
        self._next_arrival()
        self.events.at(0.0, self._scrape, background=True)
        self.events.at(0.0, self._refresh_gate, background=True)
        step = [0]

        def tick() -> None:
            n = len(self.ttft) + sum(self.dropped.values())
            if progress is not None and n - step[0] >= 1000:
                step[0] = n
                progress(n)

        with _collect_rarely(self.config.gc_threshold):
            self.events.run(lambda: bool(self.live) or self._pending_arrivals > 0, on_event=tick if progress else None)
        self.wall_s = time.perf_counter() - started
        return self.figures()

    def _next_arrival(self) -> None:
        req = next(self._arrivals, None)
        if req is None:
            return
        self._pending_arrivals += 1
        self.events.at(req.arrival_s, self._arrive, req, True)

    # ---- the per-request flow ----------------------------------------------------------------
    def _arrive(self, req: SimRequest, from_stream: bool = False) -> None:
        if from_stream:
            self._pending_arrivals -= 1
            self._next_arrival()
        live = self._new_live(req)
        if req.via_queue:
            self.queues[req.objective if req.objective in self.queues else "batch"].append(live)
            self._pump()
        else:
            self._admit(live)

    def _new_live(self, req: SimRequest) -> _Live:
        now = self.clock.now
        if self.first_arrival is None:
            self.first_arrival = now
        self.arrived += 1
        self._ids += 1
        live = _Live(req, f"req-{self._ids}", now, self.memo.oracle(req))
        self.live[live.rid] = live
        return live

    def dispatch(self, req: SimRequest) -> str:
        """Forward ``req`` now, as if flow control had just released it (no processor, no
        admission): the director's decision, make-room, the pool's shares and the engines'
        requests (:meth:`_forward`); its request id (``req-<n>``). The steps it starts end only
        when :meth:`run` processes the events. The agreement test of the router's and the
        simulator's decisions (``tests/unit/lab/simulate/test_router_agreement.py``) drives it."""
        live = self._new_live(req)
        self._forward(live)
        return live.rid

    def _admit(self, live: _Live) -> None:
        """Flow control: enqueue and step (the router's admission)."""
        req = live.req
        item = FlowItem(request_id=live.rid, fairness_id=req.tenant, objective=req.objective,
                        byte_size=4 * req.input_tokens, session_id=req.session_id)
        try:
            ticket = self.flow.enqueue(item, self.clock.now)
        except RequestDropped as drop:
            self._refused(live, drop.reason.value, drop.retry_after_s)
            return
        live.ticket = ticket
        self._tickets[id(ticket)] = live
        self._flow_step()

    def _flow_step(self) -> None:
        if not self.flow.queued_requests:
            return
        result = self.flow.step(self.clock.now, self.runtime.gate_saturation, self.runtime.unreserved_gate_saturation)
        for ticket in result.dispatched:
            self._forward(self._tickets.pop(id(ticket)))
        for ticket, drop in result.expired:
            self._refused(self._tickets.pop(id(ticket)), drop.reason.value, drop.retry_after_s)
        if self.flow.queued_requests and not self._flow_wake:
            self._flow_wake = True
            self.events.at(self.clock.now + self.flow.config.poll_interval_s, self._flow_poll)

    def _flow_poll(self) -> None:
        self._flow_wake = False
        self._flow_step()

    def _forward(self, live: _Live) -> None:
        """The director's forward: decide (:meth:`Director.decide <router.director.Director.decide>`),
        make room for a non-sheddable request, count the decode pick in the pool
        (:func:`~router.decisions.decode_share_tokens`), then hand it to the engine (P/D: the
        prefill leg first, :meth:`_forward_pd`)."""
        req = live.req
        priority = self.objective_priority.get(req.objective, 0)
        tokens = self.memo.lazy_tokens(req)
        llm = LLMRequest(request_id=live.rid, model=MODEL, prompt_token_ids=tokens, session_id=req.session_id,
                         objective=req.objective, priority=priority,
                         sheddable=req.objective in self.director.sheddable_objectives)
        for shape in self.key_shapes:  # the memo hashes each shared block once for the whole run
            llm.block_key_cache[shape] = self.memo.router_keys(req, *shape)
        decision = self.director.decide(llm, set())
        if decision is None:
            self._refused(live, "no_healthy_endpoints", self.config.retry_after_s)
            return
        result = decision.decode
        live.llm, live.result, live.engine = llm, result, self.by_name[result.endpoint.name]
        if not llm.sheddable and (self.director.make_room_enabled or self.director.evict_on_wait):
            self._make_room(result.endpoint.name)
        if self.pd:
            self.pd_reasons[decision.reason] += 1
            live.share = self.pool.started(result.endpoint, decode_share_tokens(decision, llm), sheddable=llm.sheddable)
            self._running(live)
            self._forward_pd(live, decision)
            return
        live.share = self.pool.started(result.endpoint, decode_share_tokens(decision, llm), sheddable=llm.sheddable)
        core = self._core_request(live, req.max_tokens)
        try:
            live.engine.core.add(core, self.clock.now)
        except ValueError:  # the engine's 400 (too long): an answer, so the try ends completed, as the director counts it
            self.pool.finished(live.share, completed=True)
            self.scheduler.response_complete(llm, result, None)
            self._end(live, "too_long")
            return
        live.core = core
        self._running(live)
        if not live.engine.busy:
            self._start_step(live.engine)

    # ---- make-room (the director's rule, router.decisions) ------------------------------------
    def _running(self, live: _Live) -> None:
        """``live``'s decode pick holds its endpoint's slot: a sheddable one may be evicted there."""
        if live.llm is not None and live.llm.sheddable:
            assert live.engine is not None
            self.sheddable_on.setdefault(live.engine.name, {})[live] = None

    def _stopped(self, live: _Live) -> None:
        """``live``'s decode pick ended (answered, refused or evicted): no longer a victim."""
        if live.engine is not None:
            self.sheddable_on.get(live.engine.name, {}).pop(live, None)

    def _make_room(self, name: str) -> None:
        """:meth:`Director.make_room <router.director.Director.make_room>` for a non-sheddable request
        bound for endpoint ``name``: :func:`~router.decisions.make_room_reason` over the sheddable
        requests running there (in the order they started), :func:`~router.decisions.pick_victim`,
        then :meth:`_evict`."""
        running = self.sheddable_on.get(name)
        if not running:
            return
        found = make_room_reason(self.by_name[name].state.endpoint, list(running),
                                 make_room=self.director.make_room_enabled,
                                 evict_on_wait=self.director.evict_on_wait, prefilling=self._in_prefill)
        if found is not None:
            self._evict(pick_victim(found[1]))

    def _in_prefill(self, victims: Sequence[_Live]) -> list[_Live]:
        """The requests among ``victims`` still counted as in prefill (expired ones first dropped)."""
        self.pool.expire_prefills()
        return [v for v in victims if self.pool.in_prefill(v.share)]

    def _evict(self, live: _Live) -> None:
        """Evict ``live`` as the director does: its ticket counted ``evicted`` by flow control, its
        engine requests aborted (the prefill leg too, or its held blocks freed), its pool shares and
        hooks ended with no cached tokens; its client gets 429 ``evicted`` (the processor re-sends
        it after ``Retry-After``). It takes a new request id, so the steps running now ignore it."""
        assert live.llm is not None and live.result is not None
        self.make_room_evictions += 1
        self._stopped(live)
        if live.core is None and live.prefill_core is not None:  # still in its prefill leg
            assert live.prefill_engine is not None and live.prefill is not None
            live.prefill_engine.core.abort(live.rid)
            self.pool.finished(live.prefill_share, completed=False)
            self.scheduler.response_complete(live.llm, live.prefill, None)
        if live.core is not None and live.engine is not None:
            live.engine.core.abort(live.rid)
        self._release_held(live)
        self.pool.finished(live.share, completed=False)
        self.scheduler.response_complete(live.llm, live.result, None)
        if live.ticket is not None and not self.flow.evict(live.ticket):
            self.flow.release(live.ticket, self.clock.now)
        live.ticket = None
        del self.live[live.rid]
        live.rid = f"{live.rid}.{self.make_room_evictions}"
        self.live[live.rid] = live
        live.llm = live.result = live.share = live.core = live.engine = live.itl = None
        live.prefill = live.prefill_share = live.prefill_core = live.prefill_engine = live.client_cached = None
        live.first_token = None
        live.last_token = 0.0
        self._refused(live, "evicted", self.config.retry_after_s)

    def _core_request(self, live: _Live, max_tokens: int) -> CoreRequest:
        """The engine's request for ``live`` (vLLM priority and retention from its band)."""
        req = live.req
        retention = DEFAULT_RETENTION
        vllm_priority = 0
        if self.priority_policy:
            vllm_priority = engine_priority(self.objective_priority.get(req.objective, 0))
            retention = request_retention(vllm_priority, self.settings.retention_priority_threshold)
        return CoreRequest(live.rid, self.memo.lazy_tokens(req), max_tokens,  # type: ignore[arg-type]
                           self.memo.engine_hashes(req), vllm_priority, retention)

    # ---- prefill/decode disaggregation (module docstring) ------------------------------------
    def _forward_pd(self, live: _Live, decision: PDDecision) -> None:
        """The director's P/D legs after the decision: the prefill leg, tried on another prefill pick
        while :func:`~router.decisions.should_retry_prefill` says so, else (or without a prefill
        pick) the decode engine alone, the prompt's tokens joining its share
        (:func:`~router.decisions.fallback_prefill_tokens`)."""
        assert live.llm is not None
        llm = live.llm
        prefill = decision.prefill
        excluded = [decision.decode.endpoint.name]
        for number in range(MAX_PREFILL_TRIES):
            if prefill is None:
                break
            failure = self._start_prefill(live, prefill)
            if failure is None:
                return
            excluded.append(prefill.endpoint.name)
            if not should_retry_prefill(failure, number + 1):
                break
            prefill = self.scheduler.schedule_prefill(llm, self.pool.candidates_for(llm.model), excluded)
            if prefill is not None:
                self.prefill_retries += 1
                self.scheduler.pre_request(llm, prefill)
        if decision.prefill is not None:  # aggregated after all: the decode engine computes the prompt
            self.pd_fallbacks += 1
            self.pool.add_prefill(live.share, fallback_prefill_tokens(decision))
        self._start_decode(live, remote=False)

    def _start_prefill(self, live: _Live, prefill: SchedulingResult) -> str | None:
        """The prefill leg on ``prefill``'s engine: ``max_tokens`` 1, blocks held for the decode
        engine (``remote_decode``), counted in that endpoint's pool share until its answer. None when
        it started; the leg's failure when the engine refuses it (too long for it: vLLM's 400,
        ``client_error``; its hooks run, nothing stays counted)."""
        assert live.llm is not None
        llm = live.llm
        engine = self.by_name[prefill.endpoint.name]
        share = self.pool.started(prefill.endpoint, uncached_tokens(prefill, llm), sheddable=llm.sheddable)
        core = self._core_request(live, 1)
        core.remote_decode = True  # kv_transfer_params.do_remote_decode, length-capped at 1 token
        try:
            engine.core.add(core, self.clock.now)
        except ValueError:
            self.pool.finished(share, completed=False)
            self.scheduler.response_complete(llm, prefill, None)
            return PREFILL_CLIENT_ERROR
        self.prefill_legs += 1
        live.prefill, live.prefill_share, live.prefill_core, live.prefill_engine = prefill, share, core, engine
        if not engine.busy:
            self._start_step(engine)
        return None

    def _start_decode(self, live: _Live, remote: bool) -> None:
        """The decode engine's request: its prompt's KV read from the prefill engine (``remote``:
        ``add_remote``) or computed there (the whole request on one engine)."""
        assert live.llm is not None and live.result is not None and live.engine is not None
        engine = live.engine
        core = self._core_request(live, live.req.max_tokens)
        try:
            if remote:
                engine.core.add_remote(core, self.clock.now)
            else:
                engine.core.add(core, self.clock.now)
        except ValueError:  # the engine's 400 (too long): an answer, the try ends completed (the director's count)
            self._stopped(live)
            self.pool.finished(live.share, completed=True)
            self.scheduler.response_complete(live.llm, live.result, None)
            self._release_held(live)
            self._end(live, "too_long")
            return
        live.core = core
        if not engine.busy:
            self._start_step(engine)

    def _prefill_done(self, live: _Live) -> None:
        """The prefill answer (its one token): the leg's share and hooks end, the client's cached
        tokens are the prefill engine's, and the decode engine gets the request to read the KV."""
        assert live.llm is not None and live.prefill is not None and live.prefill_core is not None
        self.pool.finished(live.prefill_share, completed=True)
        cached = max(live.prefill_core.num_cached_tokens, 0)
        self.scheduler.response_complete(live.llm, live.prefill, cached)
        live.client_cached = cached
        engine = live.prefill_engine
        assert engine is not None
        deadline = engine.core.next_expiry()
        if deadline is not None:
            self.events.at(deadline, self._expire_held, engine, background=True)
        self._start_decode(live, remote=True)

    def _kv_arrived(self, engine: FleetEngine, load: KVLoad) -> None:
        """The decode engine read the KV of ``load`` (its modelled transfer time after the step's
        start): it decodes next; the prefill engine frees the held blocks (NIXL's notification)."""
        if not engine.core.kv_arrived(load.request_id, self.clock.now):
            return
        self.kv_transfers += 1
        self.kv_transfer_bytes += load.bytes
        self.kv_transfer_blocks += load.blocks
        self.kv_transfer_s.append(load.seconds)
        live = self.live.get(load.request_id)
        if live is not None:
            self._release_held(live)
        if not engine.busy:
            self._start_step(engine)

    def _release_held(self, live: _Live) -> None:
        engine = live.prefill_engine
        if engine is None or live.prefill_core is None:
            return
        live.prefill_core = None
        if engine.core.release_held(live.rid):
            self.held_released += 1
            if not engine.busy and engine.core.has_work():  # the freed blocks may let a prefill in
                self._start_step(engine)

    def _expire_held(self, engine: FleetEngine) -> None:
        """``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` passed for blocks no decode engine read."""
        gone = engine.core.expire_held(self.clock.now)
        self.held_expired += len(gone)
        if gone and not engine.busy and engine.core.has_work():
            self._start_step(engine)

    def _start_step(self, engine: FleetEngine) -> None:
        now = self.clock.now
        outcome = engine.step(now)
        for load in outcome.kv_loads:
            self.events.at(now + load.seconds, self._kv_arrived, engine, load)
        if not outcome.scheduled:
            engine.busy = False
            engine.take_events()
            return
        engine.busy = True
        self.events.at(now + outcome.duration, self._end_step, engine, outcome)

    def _end_step(self, engine: FleetEngine, outcome: StepOutcome) -> None:
        now = self.clock.now
        if self.index is not None:
            events = engine.take_events()
            if events:
                if self.config.kv_event_delay_s > 0:
                    self.events.at(now + self.config.kv_event_delay_s, self._apply_events, engine, events)
                else:
                    self._apply_events(engine, events)
        live_of = self.live
        steady = 0
        itl = self.itl
        started = now - outcome.duration - 1e-12  # a token of the previous step ended at this step's start
        by_workload: Counter[Any] = Counter()
        for rid in outcome.sampled:
            live = live_of.get(rid)
            if live is None:  # evicted while the step ran
                continue
            if live.prefill_engine is engine and live.core is None:  # the prefill leg's one token
                self.prefill_generated += 1
                continue
            if live.first_token is None:
                live.first_token = now
                self.pool.first_chunk(live.share)
                live.itl = self._itl_of(live.req.workload)
            elif live.last_token >= started:
                steady += 1
                by_workload[live.itl] += 1
            else:
                itl.add(now - live.last_token)
                live.itl.add(now - live.last_token)
            live.last_token = now
        if steady:
            itl.add_many(outcome.duration, steady)
            for hist, n in by_workload.items():
                hist.add_many(outcome.duration, n)
        for rid in outcome.finished:
            live = live_of.get(rid)
            if live is None:
                continue
            if live.prefill_engine is engine and live.core is None:
                self._prefill_done(live)
            else:
                self._finish(live)
        if engine.core.has_work():
            self._start_step(engine)
        else:
            engine.busy = False
        self._flow_step()

    def _apply_events(self, engine: FleetEngine, events: list[Any]) -> None:
        assert self.index is not None
        self.index.apply(engine.name, MODEL, to_router_events(events))

    def _finish(self, live: _Live) -> None:
        """The answer ended: the pool's counters and EWMAs, the plugins' hooks, flow control and the
        processor's slots, the figures, and the session's next turn."""
        assert live.llm is not None and live.result is not None and live.core is not None
        self._stopped(live)
        self.pool.finished(live.share, completed=True)
        engine_cached = max(live.core.num_cached_tokens, 0)
        self.scheduler.response_complete(live.llm, live.result, engine_cached)
        self._release_held(live)  # no-op unless its KV never arrived
        # the client's cached tokens: the prefill leg's when disaggregated (router.disagg.ClientUsage)
        cached = engine_cached if live.client_cached is None else live.client_cached
        if live.ticket is not None:
            self.flow.release(live.ticket, self.clock.now)
        if live.work is not None:
            self.gates.release(live.work)
            self._schedule_pump(self.clock.now)
        assert live.first_token is not None
        self.ttft.append(live.first_token - live.arrival)
        self.ttft_by_workload.setdefault(live.req.workload, array("d")).append(live.first_token - live.arrival)
        self.cached.append(cached)
        self.oracle.append(live.oracle)
        self.prompt_tokens.append(live.req.input_tokens)
        self.finished_at.append(self.clock.now)
        self.group_of.append(self._group(live.req))
        self._end(live, None)

    def _end(self, live: _Live, dropped: str | None) -> None:
        if live.ticket is not None:
            self.flow.release(live.ticket, self.clock.now)
        if dropped is not None:
            self.dropped[dropped] += 1
            if live.work is not None:
                self.gates.release(live.work)
        del self.live[live.rid]
        nxt = live.req.next_turn()
        if nxt is not None:
            nxt.arrival_s = self.clock.now + nxt.pause_s
            self.events.at(nxt.arrival_s, self._arrive, nxt)

    def _refused(self, live: _Live, reason: str, retry_after_s: float) -> None:
        """The router refused the request: a client's is dropped; the processor's goes back to its
        lane and is tried again after ``Retry-After`` (the gate closes until its next reading)."""
        work = live.work
        if work is None:
            self._end(live, reason)
            return
        self.retries += 1
        self.gates.refused(work)
        self.gates.release(work)
        work.attempts += 1
        work.not_before = self.clock.now + retry_after_s
        live.work = work
        live.ticket = None
        self.lanes.push(work)
        self.held[work] = live
        self._schedule_pump(work.not_before)

    # ---- the processor -----------------------------------------------------------------------
    def _pump(self) -> None:
        """The processor's loop body: read queued messages into free lane room, then start what the
        lanes and gates allow."""
        now = self.clock.now
        for lane, queue in self.queues.items():
            free = self.lanes.free(lane)
            while queue and free > 0:
                live = queue.popleft()
                req = live.req
                message = RequestMessage(id=live.rid, deadline=2**40, payload={},
                                         metadata={"tenant": req.tenant, "objective": lane, "batch_id": req.batch_id})
                work = Work(message, Delivery(lane, b"", 1, live.rid, received_at=now, extended_at=now), lane)
                live.work = work
                self.held[work] = live
                self.lanes.push(work)
                free -= 1
        while True:
            ready = self.lanes.pop(now, self.gates.admits)
            if ready is None:
                break
            self.gates.acquire(ready)
            self._admit(self.held.pop(ready))
        nxt = self.lanes.next_ready_at(now)
        if nxt is not None:
            self._schedule_pump(nxt)

    def _schedule_pump(self, when: float) -> None:
        if self._pump_at is not None and self._pump_at <= when and self._pump_at >= self.clock.now:
            return
        self._pump_at = when
        self.events.at(when, self._pump_event)

    def _pump_event(self) -> None:
        self._pump_at = None
        self._pump()

    def _refresh_gate(self) -> None:
        _run_now(self.saturation_gate.refresh())
        if self.held or any(self.queues.values()):
            self._pump()
        self.events.at(self.clock.now + self.config.processor_saturation_poll_s, self._refresh_gate, background=True)

    # ---- scrapes -----------------------------------------------------------------------------
    def _scrape(self) -> None:
        record = self.pool.record_metrics
        for engine in self.engines:
            record(engine.state, engine.metrics())
        self._flow_step()
        self.events.at(self.clock.now + self.config.scrape_interval_s, self._scrape, background=True)

    # ---- figures -----------------------------------------------------------------------------
    def _itl_of(self, workload: str) -> LogHistogram:
        hist = self.itl_by_workload.get(workload)
        if hist is None:
            hist = self.itl_by_workload[workload] = LogHistogram()
        return hist

    def _group(self, req: SimRequest) -> int:
        key = (req.objective, req.tenant)
        try:
            return self.groups.index(key)
        except ValueError:
            self.groups.append(key)
            return len(self.groups) - 1

    def index_bytes(self) -> int:
        """Memory of the router's prefix index: the KV-event index's own estimate (precise), the
        approximate producer's LRU entries at the index's per-key cost (approximate), else 0."""
        if self.index is not None:
            return int(self.index.stats()["approx_bytes"])
        from router.kv_index.index import BYTES_PER_BLOCK

        for plugin in self.plugins():
            held = getattr(plugin, "blocks_held", None)
            if held is not None:
                return sum(held(e.name) for e in self.engines) * BYTES_PER_BLOCK
        return 0

    def figures(self) -> dict[str, Any]:
        """The run's JSON figures (the CLI's ``--json``; keys in docs/simulate.md)."""
        n = len(self.ttft)
        end = max(self.finished_at) if n else self.clock.now
        virtual = end - (self.first_arrival or 0.0)
        oracle = sum(self.oracle)
        cached = sum(self.cached)
        ms = [s * 1000 for s in self.observer.decision_s]
        by_group: dict[str, dict[str, Any]] = {}
        for g, (lane, tenant) in enumerate(self.groups):
            values = [self.ttft[i] for i in range(n) if self.group_of[i] == g]
            by_group[f"{lane}/{tenant or '-'}"] = {"lane": lane, "tenant": tenant, "requests": len(values),
                                                   "ttft_p50_s": percentile(values, 50),
                                                   "ttft_p99_s": percentile(values, 99)}
        return {
            "policy": self.policy,
            "engines": len(self.engines),
            "requests": self.arrived,
            "completed": n,
            "dropped": dict(self.dropped),
            "processor_retries": self.retries,
            "make_room_evictions": self.make_room_evictions,
            "prompt_tokens": sum(self.prompt_tokens),
            "cached_tokens": cached,
            "oracle_reusable_tokens": oracle,
            "captured_reuse": cached / oracle if oracle else None,
            # as lab.toolkit.replay.summarize: cached beyond the oracle happens when requests run in
            # another order than they arrived, or a retry finds its own evicted attempt's prefill
            "cached_above_oracle_tokens": sum(max(c - o, 0) for c, o in zip(self.cached, self.oracle, strict=True)),
            "ttft_p50_s": percentile(self.ttft, 50),
            "ttft_p99_s": percentile(self.ttft, 99),
            "itl_p99_s": self.itl.percentile(99),
            "throughput_rps": n / virtual if virtual > 0 else None,
            "output_tokens_per_s": sum(e.generated for e in self.engines if e.role != "prefill") / virtual
            if virtual > 0 else None,
            "decision_p50_ms": percentile(ms, 50),
            "decision_p99_ms": percentile(ms, 99),
            "index_bytes": self.index_bytes(),
            "wall_s": self.wall_s,
            "virtual_s": virtual,
            "wall_us_per_request": 1e6 * self.wall_s / self.arrived if self.arrived else None,
            "events": self.events.processed,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "steps": sum(e.steps for e in self.engines),
            "preemptions": sum(e.core.num_preemptions for e in self.engines),
            "by_lane_tenant": by_group,
            "by_workload": {w: {"requests": len(v), "ttft_p50_s": percentile(v, 50), "ttft_p99_s": percentile(v, 99),
                                "itl_p99_s": self.itl_by_workload[w].percentile(99)
                                if w in self.itl_by_workload else None}
                            for w, v in sorted(self.ttft_by_workload.items())},
            "layout": {role: sum(e.role == role for e in self.engines) for role in ("both", "prefill", "decode")},
            "utilisation_by_role": self.utilisation(virtual),
            "generated_tokens_by_role": {role: sum(e.generated for e in self.engines if e.role == role)
                                         for role in ("both", "prefill", "decode")},
            "pd": self.pd_figures() if self.pd else None,
        }

    def utilisation(self, virtual_s: float) -> dict[str, float | None]:
        """Per role: the share of the run's virtual seconds its engines spent in steps (busy ÷
        engines × virtual), None for a role without engines."""
        out: dict[str, float | None] = {}
        for role in ("both", "prefill", "decode"):
            engines = [e for e in self.engines if e.role == role]
            out[role] = (sum(e.busy_s for e in engines) / (len(engines) * virtual_s)
                         if engines and virtual_s > 0 else None)
        return out

    def pd_figures(self) -> dict[str, Any]:
        """The P/D flow's figures: decisions by reason, disaggregated share, prefill legs and the
        tokens they generated per leg (vLLM's NIXL flow: ≤ 1), fallbacks, KV transfers (count,
        bytes, blocks, model seconds p50 / p99 / total), held blocks released by notification /
        expired / still held at the end."""
        decided = sum(self.pd_reasons.values())
        return {
            "decisions": dict(self.pd_reasons),
            "disaggregated": self.prefill_legs,
            "disaggregated_share": self.pd_reasons.get(PDReason.DISAGGREGATED.value, 0) / decided if decided else None,
            "prefill_retries": self.prefill_retries,
            "fallbacks": self.pd_fallbacks,
            "prefill_tokens_per_request": self.prefill_generated / self.prefill_legs if self.prefill_legs else None,
            "kv_transfers": self.kv_transfers,
            "kv_transfer_bytes": self.kv_transfer_bytes,
            "kv_transfer_blocks": self.kv_transfer_blocks,
            "kv_transfer_s_p50": percentile(self.kv_transfer_s, 50),
            "kv_transfer_s_p99": percentile(self.kv_transfer_s, 99),
            "kv_transfer_s_total": sum(self.kv_transfer_s),
            "held_released": self.held_released,
            "held_expired": self.held_expired,
            "held_blocks_at_end": sum(e.core.held_blocks for e in self.engines),
        }


@contextlib.contextmanager
def _collect_rarely(threshold: int | None) -> Iterator[None]:
    """Raise the garbage collector's young-generation threshold to ``threshold`` allocations for a
    run (None: leave it). A run allocates millions of short-lived objects (requests, step outcomes,
    events) beside millions of long-lived ones (cache blocks, index entries) that CPython's default
    threshold of 700 makes every young collection walk again (profiled: 40 % of a precise run's
    wall time in ``gc``); the objects are freed by reference counting either way."""
    if threshold is None:
        yield
        return
    before = gc.get_threshold()
    gc.set_threshold(threshold, before[1], before[2])
    try:
        yield
    finally:
        gc.set_threshold(*before)
