"""The endpoint pool: which engines exist, whether they are healthy, and their scraped load.

Sources of endpoints: a static list of base URLs and, optionally, Kubernetes pods matched by a label
selector (:class:`KubernetesSource`). For each endpoint the pool runs

* a **metrics scrape** every ``scrape_interval_s`` (``GET /metrics``, vLLM's Prometheus text): it
  fills the scheduler's :class:`~router.scheduling.types.Endpoint` in place (waiting, running, KV
  use, ``cache_config_info``) and stamps ``metrics_updated_at``; a failed scrape leaves the stamp
  alone, so the metrics go stale and the saturation detector counts the endpoint as saturated;
* a **health check** every ``health_interval_s`` (``GET /health``): ``unhealthy_after`` failures in
  a row (or one failed connection reported by the request path and confirmed by a check) take it
  out of the candidate set, reset its in-flight counters and call the ``on_down`` hooks, which drop
  its prefix-index entries and interrupt its requests (RELIABILITY.md F9). A healthy answer brings
  it back (F10).

**Slot count.** vLLM does not export ``max_num_seqs``. The scrape keeps ``peak_running``, the most
requests the engine was seen running (a lower bound of ``max_num_seqs``), and once a scrape shows
it running requests while others wait — it was full — sets ``learned_max_num_seqs`` to
``peak_running`` and keeps it equal from then on (every scrape's running count is at most
``max_num_seqs``, so the largest is the best estimate; the one at a scrape with waiting requests
alone may be low when the engine's token budget, not its slots, held a prefill back). A configured
``max_num_seqs`` overrides it. Both reset when the endpoint goes down.

The in-flight counters on each :class:`~router.scheduling.types.Endpoint` (requests forwarded,
uncached prompt tokens still to prefill, sheddable requests) change only through :meth:`EndpointPool.started`,
:meth:`EndpointPool.first_chunk` and :meth:`EndpointPool.finished`.

**Sheddable prefills in flight** (the batch prefill share, ``router/scheduling/saturation.py``):
a sheddable request's uncached prompt tokens count in ``in_flight_sheddable_prefill_tokens`` from
:meth:`EndpointPool.started` until its first streamed chunk, its end, or ``batch_prefill_window_s``
after it was sent (:meth:`EndpointPool.expire_prefills`), whichever comes first: batch requests are
not streamed, so the router cannot see their prefill end; the window (default 0.25 s, about one
full-budget step of an 8B model on an H100: 8,192 tokens × 32 µs) stands for it.

**Interactive arrivals and durations** (the reserve sized by Little's law): each non-sheddable
request forwarded adds to the endpoint's exponentially weighted arrival rate
(``rate ← rate × e^(−Δt/τ) + 1/τ``, τ = ``interactive_rate_tau_s``, 10 s: the rate of a Poisson
stream is estimated within about ±1/√(λτ), ±14 % at 5 requests/s), and each completed one to
``mean_interactive_duration_s`` (the same EWMA as ``mean_request_duration_s``).

Endpoints are named by their base URL, the key of every per-endpoint index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.kv_index.subscriber import KVEventSource
from router.scheduling.types import ROLE_BOTH, ROLES, Endpoint

log = logging.getLogger(__name__)

#: The series the router reads from an engine (shared/contracts/vllm-engine.md, "Metrics the
#: router reads"); other lines of the exposition are skipped before parsing.
SCRAPED_SERIES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_hits",
    "vllm:num_preemptions",
)
_WANTED_PREFIXES = tuple(s.encode() for s in SCRAPED_SERIES)


@dataclass(slots=True)
class EngineMetrics:
    """One scrape of an engine's ``/metrics``, summed over its ``engine`` series (data-parallel
    ranks): waiting/running in requests, ``kv_cache_usage_perc`` the mean fraction 0..1, prefix
    counters in tokens, block fields from ``vllm:cache_config_info`` (None when absent)."""

    num_requests_waiting: int = 0
    num_requests_running: int = 0
    kv_cache_usage_perc: float = 0.0
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    external_prefix_cache_hits: float = 0.0
    num_preemptions: float = 0.0


def parse_engine_metrics(text: bytes) -> EngineMetrics:
    """Parse the series in :data:`SCRAPED_SERIES` out of a Prometheus text exposition.

    Only the wanted lines reach ``prometheus_client``'s parser (a vLLM exposition is mostly
    histograms the router does not read). Counters are accepted with or without ``_total``.

    Raises:
        ValueError: the wanted lines do not parse as Prometheus text.
    """
    lines = [ln for ln in text.splitlines() if ln.startswith(_WANTED_PREFIXES)]
    out = EngineMetrics()
    kv_values: list[float] = []
    for family in text_string_to_metric_families(b"\n".join(lines).decode() + "\n"):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name == "vllm:num_requests_waiting":
                out.num_requests_waiting += int(sample.value)
            elif name == "vllm:num_requests_running":
                out.num_requests_running += int(sample.value)
            elif name == "vllm:kv_cache_usage_perc":
                kv_values.append(float(sample.value))
            elif name == "vllm:cache_config_info":
                labels = sample.labels
                out.block_size = _int_or_none(labels.get("block_size"))
                out.num_gpu_blocks = _int_or_none(labels.get("num_gpu_blocks"))
                out.num_cpu_blocks = _int_or_none(labels.get("num_cpu_blocks"))
            elif name == "vllm:prefix_cache_queries":
                out.prefix_cache_queries += sample.value
            elif name == "vllm:prefix_cache_hits":
                out.prefix_cache_hits += sample.value
            elif name == "vllm:external_prefix_cache_hits":
                out.external_prefix_cache_hits += sample.value
            elif name == "vllm:num_preemptions":
                out.num_preemptions += sample.value
    if kv_values:
        out.kv_cache_usage_perc = sum(kv_values) / len(kv_values)
    return out


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "None") else None
    except ValueError:
        return None


@dataclass(slots=True, eq=False)
class EndpointState:
    """The pool's record of one engine: the scheduler's :class:`Endpoint` plus health.

    Attributes:
        endpoint: what the scheduler reads (updated in place).
        healthy: in the candidate set.
        failures: failed health checks / connections in a row.
        models: model names from the engine's ``/v1/models`` (empty until read).
        metrics: the last successful scrape.
        last_error: text of the last failure, for the admin page.
    """

    endpoint: Endpoint
    healthy: bool = False
    failures: int = 0
    models: list[str] = field(default_factory=list)
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    last_error: str | None = None

    @property
    def name(self) -> str:
        """The endpoint's base URL."""
        return self.endpoint.name


OnDown = Callable[[str], None]


class InFlight:
    """One forwarded request's share of its endpoint's in-flight counters (from
    :meth:`EndpointPool.started`; changed only by the pool).

    The endpoint's ``in_flight_uncached_tokens`` carries the tokens the router expects the engine
    still has to compute for the request, removed when its first streamed chunk arrives (the
    prefill is over, :meth:`EndpointPool.first_chunk`) or when it ends (:meth:`EndpointPool.finished`),
    so the counter is the endpoint's queued prefill work, which the load-aware plugins
    (``token-load-scorer``, ``prefix-cache-affinity-filter``) turn into a wait estimate. When the
    endpoint goes down the pool resets its counters; the shares taken before no longer count.
    """

    __slots__ = ("endpoint", "tokens", "sheddable", "counted", "generation", "started_at", "prefill", "dispatched")

    def __init__(self, endpoint: Endpoint, tokens: int, generation: int, started_at: float,
                 sheddable: bool = False) -> None:
        self.endpoint = endpoint
        self.tokens = tokens
        self.dispatched = tokens  # uncached prompt tokens estimated at dispatch (kept after the prefill)
        self.sheddable = sheddable
        self.counted = True
        self.generation = generation
        self.started_at = started_at
        self.prefill = sheddable  # counted in the endpoint's in_flight_sheddable_prefill_tokens


class EndpointPool:
    """Engines, their health and load; :meth:`candidates` is what the scheduler chooses among.

    Args:
        session: an aiohttp session for scrapes and health checks (owned by the caller).
        scrape_interval_s, health_interval_s, unhealthy_after: see the module docstring.
        clock: the monotonic clock ``metrics_updated_at`` is stamped with (the saturation
            detector's clock).
        on_change: called with no argument whenever fresh metrics arrived or the candidate set
            changed (flow control re-checks saturation).
        duration_ewma_alpha: weight of the newest completed request in each endpoint's
            ``mean_request_duration_s`` (0 < alpha ≤ 1; default 0.1, ours: about the last ten
            requests, so a change of load shows within a few seconds on a busy engine).
        max_num_seqs: every engine's sequence slots (vLLM's ``--max-num-seqs``) when configured;
            None: each endpoint's is learned from its scrapes (module docstring).
        batch_prefill_window_s: seconds a sheddable request's tokens count as in prefill at most
            (module docstring).
        interactive_rate_tau_s: time constant of the interactive arrival rate, seconds.
    """

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        scrape_interval_s: float = 0.05,
        health_interval_s: float = 1.0,
        unhealthy_after: int = 2,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
        duration_ewma_alpha: float = 0.1,
        max_num_seqs: int | None = None,
        batch_prefill_window_s: float = 0.25,
        interactive_rate_tau_s: float = 10.0,
    ) -> None:
        if not 0.0 < duration_ewma_alpha <= 1.0:
            raise ValueError(f"duration_ewma_alpha must be in (0, 1], got {duration_ewma_alpha}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.batch_prefill_window_s = batch_prefill_window_s
        self.interactive_rate_tau_s = interactive_rate_tau_s
        self._prefills: dict[str, deque[InFlight]] = {}  # endpoint → sheddable shares in prefill, oldest first
        self.duration_ewma_alpha = duration_ewma_alpha
        self._session = session
        self.scrape_interval_s = scrape_interval_s
        self.health_interval_s = health_interval_s
        self.unhealthy_after = unhealthy_after
        self.clock = clock
        self.on_change = on_change or (lambda: None)
        self.states: dict[str, EndpointState] = {}
        self._candidates: list[Endpoint] = []
        self._by_model: dict[str, list[Endpoint]] = {}
        self._on_down: list[OnDown] = []
        self._generation: dict[str, int] = {}  # endpoint name → how many times its counters were reset
        self._tasks: dict[str, list[asyncio.Task]] = {}
        self._scrape_timeout = aiohttp.ClientTimeout(total=max(1.0, 10 * scrape_interval_s))
        self._health_timeout = aiohttp.ClientTimeout(total=max(1.0, health_interval_s))

    # ---- membership --------------------------------------------------------------------------
    def add_on_down(self, hook: OnDown) -> None:
        """Call ``hook(endpoint_name)`` when an endpoint leaves the candidate set or the pool."""
        self._on_down.append(hook)

    def set_endpoints(self, urls: Iterable[str], roles: Mapping[str, str] | None = None) -> None:
        """Make the pool hold exactly ``urls`` (base URLs): start probing new ones, drop gone ones.

        ``roles``: base URL → ``prefill`` | ``decode`` | ``both`` (:data:`~router.scheduling.types.ROLES`);
        an endpoint not named is ``both``. A known endpoint whose role changed takes the new one
        in place (its counters stay).

        Must be called from the event loop. New endpoints join the candidate set after their
        first healthy check.

        Raises:
            ValueError: a role that is not one of the three.
        """
        role_of = {u.rstrip("/"): r for u, r in (roles or {}).items()}
        for role in role_of.values():
            if role not in ROLES:
                raise ValueError(f"engine role must be one of {', '.join(ROLES)}, got {role!r}")
        wanted = {u.rstrip("/") for u in urls}
        for name in list(self.states):
            if name not in wanted:
                self._remove(name)
        changed = False
        for name in wanted:
            role = role_of.get(name, ROLE_BOTH)
            if name not in self.states:
                self.states[name] = EndpointState(Endpoint(name, max_num_seqs=self.max_num_seqs, role=role))
                self._tasks[name] = [
                    asyncio.create_task(self._health_loop(name), name=f"health {name}"),
                    asyncio.create_task(self._scrape_loop(name), name=f"scrape {name}"),
                ]
            elif self.states[name].endpoint.role != role:
                self.states[name].endpoint.role = role
                changed = True
        if changed:
            self._rebuild()

    def _remove(self, name: str) -> None:
        state = self.states.pop(name)
        for task in self._tasks.pop(name, []):
            task.cancel()
        if state.healthy:
            state.healthy = False
            self._down(name)
        self._rebuild()

    async def close(self) -> None:
        """Stop every probe task."""
        tasks = [t for ts in self._tasks.values() for t in ts]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- what others read ---------------------------------------------------------------------
    def candidates(self) -> list[Endpoint]:
        """Healthy endpoints, the scheduler's candidates (a shared list: do not mutate)."""
        return self._candidates

    def candidates_for(self, model: str) -> list[Endpoint]:
        """Healthy endpoints serving ``model`` (by their ``/v1/models``; an endpoint whose model
        list could not be read counts as serving every model). Empty when none does."""
        found = self._by_model.get(model)
        if found is None:
            found = self._by_model[model] = [s.endpoint for s in self.states.values()
                                             if s.healthy and (not s.models or model in s.models)]
        return found

    def get(self, name: str) -> EndpointState | None:
        """The state of endpoint ``name``, or None."""
        return self.states.get(name)

    def models(self) -> list[str]:
        """Model names served by healthy endpoints, sorted, each once."""
        return sorted({m for s in self.states.values() if s.healthy for m in s.models})

    # ---- in-flight counters ---------------------------------------------------------------------
    def started(self, endpoint: Endpoint, uncached_tokens: int, sheddable: bool = False) -> InFlight:
        """A request was forwarded to ``endpoint`` with ``uncached_tokens`` of prefill work;
        ``sheddable``: it is of a sheddable band (counted in ``in_flight_sheddable`` too)."""
        now = self.clock()
        endpoint.in_flight_requests += 1
        endpoint.in_flight_uncached_tokens += uncached_tokens
        share = InFlight(endpoint, uncached_tokens, self._generation.get(endpoint.name, 0), now, sheddable)
        if sheddable:
            endpoint.in_flight_sheddable += 1
            endpoint.in_flight_sheddable_prefill_tokens += uncached_tokens
            self._prefills.setdefault(endpoint.name, deque()).append(share)
        else:
            tau = self.interactive_rate_tau_s
            endpoint.interactive_rate_per_s = endpoint.interactive_rate(now, tau) + 1.0 / tau
            endpoint.interactive_rate_at = now
        return share

    def expire_prefills(self) -> None:
        """Stop counting as in prefill the sheddable requests sent over ``batch_prefill_window_s`` ago."""
        cutoff = self.clock() - self.batch_prefill_window_s
        emptied = []
        for name, queue in self._prefills.items():
            while queue and (queue[0].started_at <= cutoff or not queue[0].prefill):
                self._end_prefill(queue.popleft())
            if not queue:
                emptied.append(name)
        for name in emptied:  # so each read walks only the endpoints with sheddable work in prefill
            del self._prefills[name]

    def in_prefill(self, share: InFlight) -> bool:
        """Whether the request of ``share`` counts as in prefill now (sheddable ones only)."""
        return share.prefill and share.started_at > self.clock() - self.batch_prefill_window_s

    def _end_prefill(self, share: InFlight) -> None:
        if share.prefill:
            share.prefill = False
            if self._counts(share):
                ep = share.endpoint
                ep.in_flight_sheddable_prefill_tokens = max(0, ep.in_flight_sheddable_prefill_tokens - share.dispatched)

    def add_prefill(self, share: InFlight, tokens: int) -> None:
        """The request of ``share`` will prefill there after all (a disaggregated request whose
        prefill leg failed falls back to its decode endpoint): its ``tokens`` uncached prompt
        tokens join the endpoint's queued prefill work until its first chunk or its end."""
        if tokens <= 0 or not self._counts(share) or share.tokens:
            return
        share.tokens = share.dispatched = tokens
        share.endpoint.in_flight_uncached_tokens += tokens
        if share.prefill:  # a sheddable request still counted in the batch prefill share
            share.endpoint.in_flight_sheddable_prefill_tokens += tokens

    def first_chunk(self, share: InFlight) -> None:
        """The request's prefill is over: remove its uncached tokens (idempotent)."""
        self._end_prefill(share)
        if share.tokens and self._counts(share):
            ep = share.endpoint
            ep.in_flight_uncached_tokens = max(0, ep.in_flight_uncached_tokens - share.tokens)
        share.tokens = 0

    def finished(self, share: InFlight, completed: bool = False) -> None:
        """The request ended there: remove it from the endpoint's counters (once). With
        ``completed`` (the engine answered it to the end) its duration since :meth:`started` goes
        into the endpoint's ``mean_request_duration_s``."""
        self.first_chunk(share)
        if self._counts(share):
            ep = share.endpoint
            ep.in_flight_requests = max(0, ep.in_flight_requests - 1)
            if share.sheddable:
                ep.in_flight_sheddable = max(0, ep.in_flight_sheddable - 1)
            if completed:
                duration = max(0.0, self.clock() - share.started_at)
                mean = ep.mean_request_duration_s
                ep.mean_request_duration_s = duration if mean is None else \
                    mean + self.duration_ewma_alpha * (duration - mean)
                if not share.sheddable:
                    mean = ep.mean_interactive_duration_s
                    ep.mean_interactive_duration_s = duration if mean is None else \
                        mean + self.duration_ewma_alpha * (duration - mean)
        share.counted = False

    def _counts(self, share: InFlight) -> bool:
        if share.counted and share.generation != self._generation.get(share.endpoint.name, 0):
            share.counted = False  # the counters were reset since: this share is gone
        return share.counted

    # ---- reports from the request path ---------------------------------------------------------
    def report_failure(self, name: str, error: str) -> None:
        """A request could not reach ``name``: check its health now (a failed check takes it out)."""
        state = self.states.get(name)
        if state is None:
            return
        state.last_error = error
        if state.healthy:
            asyncio.get_running_loop().create_task(self._check_health(name, immediate=True))

    # ---- probes -------------------------------------------------------------------------------
    async def _health_loop(self, name: str) -> None:
        while True:
            await self._check_health(name)
            await asyncio.sleep(self.health_interval_s)

    async def _check_health(self, name: str, immediate: bool = False) -> None:
        state = self.states.get(name)
        if state is None:
            return
        try:
            async with self._session.get(f"{name}/health", timeout=self._health_timeout) as resp:
                ok = resp.status == 200
                await resp.read()
            if not ok:
                state.last_error = f"GET /health answered {resp.status}"
            if ok and not state.models:
                state.models = await self._read_models(name)
                self._by_model = {}
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            ok = False
            state.last_error = f"{type(exc).__name__}: {exc}"
        if name not in self.states:
            return
        if ok:
            state.failures = 0
            state.last_error = None
            if not state.healthy:
                state.healthy = True
                log.info("endpoint up", extra={"action": "endpoint_up", "endpoint": name})
                self._rebuild()
            return
        state.failures += 1
        if state.healthy and (immediate or state.failures >= self.unhealthy_after):
            state.healthy = False
            state.models = []
            log.warning("endpoint down", extra={"action": "endpoint_down", "endpoint": name, "error": state.last_error})
            self._down(name)
            self._rebuild()

    async def _read_models(self, name: str) -> list[str]:
        try:
            async with self._session.get(f"{name}/v1/models", timeout=self._health_timeout) as resp:
                if resp.status != 200:
                    return []
                body = await resp.json()
            return [m["id"] for m in body.get("data", []) if isinstance(m, dict) and "id" in m]
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, TypeError, KeyError):
            return []

    async def _scrape_loop(self, name: str) -> None:
        while True:
            started = self.clock()
            await self.scrape(name)
            await asyncio.sleep(max(0.0, self.scrape_interval_s - (self.clock() - started)))

    async def scrape(self, name: str) -> bool:
        """Scrape ``name``'s ``/metrics`` once into its :class:`Endpoint`; False when it failed."""
        state = self.states.get(name)
        if state is None:
            return False
        try:
            async with self._session.get(f"{name}/metrics", timeout=self._scrape_timeout) as resp:
                if resp.status != 200:
                    return False
                text = await resp.read()
            metrics = parse_engine_metrics(text)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return False
        self.record_metrics(state, metrics)
        return True

    def record_metrics(self, state: EndpointState, metrics: EngineMetrics) -> None:
        """Put one successful scrape into the endpoint's :class:`Endpoint` (counts, the slot count
        learned, block fields), stamp it fresh and call ``on_change``."""
        ep = state.endpoint
        ep.num_requests_waiting = metrics.num_requests_waiting
        ep.num_requests_running = metrics.num_requests_running
        ep.peak_running = max(ep.peak_running, metrics.num_requests_running)
        if ep.learned_max_num_seqs is not None or (metrics.num_requests_waiting > 0 and metrics.num_requests_running > 0):
            ep.learned_max_num_seqs = ep.peak_running  # it was full once: peak_running is its batch size
        ep.kv_cache_usage_perc = metrics.kv_cache_usage_perc
        ep.num_preemptions = int(metrics.num_preemptions)
        if metrics.block_size is not None:
            ep.block_size = metrics.block_size
        if metrics.num_gpu_blocks is not None:
            ep.num_gpu_blocks = metrics.num_gpu_blocks
        if metrics.num_cpu_blocks is not None:
            ep.num_cpu_blocks = metrics.num_cpu_blocks
        ep.metrics_updated_at = self.clock()
        state.metrics = metrics
        self.on_change()

    # ---- internals ----------------------------------------------------------------------------
    def _rebuild(self) -> None:
        self._candidates = [s.endpoint for s in self.states.values() if s.healthy]
        self._by_model = {}
        self.on_change()

    def _down(self, name: str) -> None:
        state = self.states.get(name)
        self._generation[name] = self._generation.get(name, 0) + 1
        if state is not None:
            state.endpoint.in_flight_requests = 0
            state.endpoint.in_flight_uncached_tokens = 0
            state.endpoint.in_flight_sheddable = 0
            state.endpoint.metrics_updated_at = None
            state.endpoint.peak_running = 0  # it may come back as another engine
            state.endpoint.learned_max_num_seqs = None
            state.endpoint.mean_request_duration_s = None
            state.endpoint.in_flight_sheddable_prefill_tokens = 0
            state.endpoint.interactive_rate_per_s = 0.0
            state.endpoint.interactive_rate_at = None
            state.endpoint.mean_interactive_duration_s = None
        self._prefills.pop(name, None)
        for hook in self._on_down:
            try:
                hook(name)
            except Exception:  # a hook's bug must not stop the others
                log.exception("on_down hook failed for %s", name)


#: Pod annotations naming an engine's KV-event ports (router HA: every replica connects to them);
#: without them the router's ``kv_events_port`` setting and the replay port offset apply.
KV_EVENTS_PORT_ANNOTATION = "backfill.io/kv-events-port"
KV_EVENTS_REPLAY_PORT_ANNOTATION = "backfill.io/kv-events-replay-port"


class KubernetesSource:
    """Keeps a pool's endpoints equal to the Ready pods matching a label selector.

    Uses the official ``kubernetes`` client (``pip install kubernetes``; in-cluster credentials,
    else the local kubeconfig) and lists pods every ``interval_s`` seconds — a list rather than a
    watch keeps it simple and self-healing; engines come and go on a scale of minutes.

    Args:
        pool: the pool to update.
        selector: label selector (``app.kubernetes.io/component=vllm``).
        port: engine port on each pod.
        namespace: namespace to list (default: the service account's namespace, else ``default``).
        interval_s: seconds between lists.
        static: URLs always kept in the pool besides the discovered ones.
        static_roles: role of each static URL that is not ``both`` (``--prefill-engine``,
            ``--decode-engine``); discovered pods take theirs from the :data:`ROLE_LABEL` label
            (:func:`pod_role`).
        on_kv_sources: called after each list with the KV-event sources of the Ready pods
            (:func:`ready_pod_kv_sources`); None: no KV events from discovery.
        kv_events_port: PUB port of pods without the :data:`KV_EVENTS_PORT_ANNOTATION` (None: such
            pods are not subscribed to).
        replay_port_offset: replay port = PUB port + this for pods without
            :data:`KV_EVENTS_REPLAY_PORT_ANNOTATION` (0: none).

    Raises:
        RuntimeError: the ``kubernetes`` package is not installed (raised by :meth:`start`).
    """

    NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

    def __init__(self, pool: EndpointPool, selector: str, port: int, namespace: str | None = None,
                 interval_s: float = 5.0, static: Iterable[str] = (), *,
                 static_roles: Mapping[str, str] | None = None,
                 on_kv_sources: Callable[[list[KVEventSource]], None] | None = None,
                 kv_events_port: int | None = None, replay_port_offset: int = 1) -> None:
        self.pool = pool
        self.selector = selector
        self.port = port
        self.namespace = namespace
        self.interval_s = interval_s
        self.static = list(static)
        self.static_roles = dict(static_roles or {})
        self.on_kv_sources = on_kv_sources
        self.kv_events_port = kv_events_port
        self.replay_port_offset = replay_port_offset
        self._task: asyncio.Task | None = None

    @staticmethod
    def load_credentials() -> None:
        """Load the Kubernetes client's credentials: the pod's service account, else the
        kubeconfig (``KUBECONFIG``, ``~/.kube/config``).

        Raises:
            RuntimeError: the ``kubernetes`` package is missing, or neither source is usable
                (the message says which flag needs them).
        """
        try:
            from kubernetes import config
        except ImportError as exc:
            raise RuntimeError("engine discovery by label selector needs the kubernetes package "
                               "(pip install 'backfill[k8s]')") from exc
        try:
            config.load_incluster_config()
        except config.ConfigException as in_cluster:
            try:
                config.load_kube_config()
            except (config.ConfigException, OSError) as exc:
                raise RuntimeError(f"--engine-selector needs Kubernetes credentials: not in a pod ({in_cluster}) "
                                   f"and no usable kubeconfig ({exc})") from None

    def start(self) -> None:
        """Load credentials (:meth:`load_credentials`, which raises RuntimeError) and start
        listing pods in the background."""
        self.load_credentials()
        from kubernetes import client
        if self.namespace is None:
            try:
                with open(self.NAMESPACE_FILE) as fh:
                    self.namespace = fh.read().strip()
            except OSError:
                self.namespace = "default"
        api = client.CoreV1Api()
        self._task = asyncio.create_task(self._loop(api), name="kubernetes discovery")

    async def stop(self) -> None:
        """Stop listing."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self, api) -> None:
        while True:
            try:
                pods = await asyncio.to_thread(api.list_namespaced_pod, self.namespace, label_selector=self.selector)
                self.apply(pods.items)
            except Exception:  # API unreachable: keep the last known set
                log.exception("listing engine pods failed")
            await asyncio.sleep(self.interval_s)

    def apply(self, pods: Iterable) -> None:
        """Make the pool (and the KV-event subscriber) follow one list of pods."""
        pods = list(pods)
        roles = {**self.static_roles, **ready_pod_roles(pods, self.port)}
        self.pool.set_endpoints([*self.static, *ready_pod_urls(pods, self.port)], roles)
        if self.on_kv_sources is not None:
            self.on_kv_sources(ready_pod_kv_sources(pods, self.port, self.kv_events_port, self.replay_port_offset))


def _ready_ip(pod) -> str | None:
    status = pod.status
    if status is None or status.phase != "Running" or not status.pod_ip:
        return None
    ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))
    return status.pod_ip if ready else None


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


#: The pod label naming an engine's role in prefill/decode disaggregation (llm-d's ``RoleLabel``,
#: ``pkg/plugins/filter/pd_role.go``): ``prefill``, ``decode`` or ``both``; no label: ``both``.
ROLE_LABEL = "llm-d.ai/role"
#: Label values read as ``both``: llm-d's newer name for it (``RolePrefillDecode``), which its
#: prefill and decode filters both accept.
_BOTH_ALIASES = ("prefill-decode",)


def pod_role(pod) -> str | None:
    """The role of ``pod`` from its :data:`ROLE_LABEL` label: ``prefill``, ``decode``, ``both``
    (also for llm-d's ``prefill-decode`` and for a pod without the label); None for any other
    value, which neither llm-d's prefill filter nor its decode filter keeps (the pod is not routed
    to; :func:`ready_pod_urls` leaves it out and logs it)."""
    labels = getattr(getattr(pod, "metadata", None), "labels", None) or {}
    value = labels.get(ROLE_LABEL)
    if value is None:
        return ROLE_BOTH
    value = str(value).strip().lower()
    if value in ROLES:
        return value
    return ROLE_BOTH if value in _BOTH_ALIASES else None


def ready_pod_urls(pods: Iterable, port: int) -> list[str]:
    """``http://<pod IP>:<port>`` of each running pod whose ``Ready`` condition is true and whose
    role label is valid (:func:`pod_role`)."""
    out = []
    for pod in pods:
        ip = _ready_ip(pod)
        if not ip:
            continue
        if pod_role(pod) is None:
            log.warning("engine pod with an unknown role label left out", extra={
                "action": "router.pod_role_unknown", "pod_ip": ip,
                "role": (getattr(getattr(pod, "metadata", None), "labels", None) or {}).get(ROLE_LABEL)})
            continue
        out.append(f"http://{_host(ip)}:{port}")
    return out


def ready_pod_roles(pods: Iterable, port: int) -> dict[str, str]:
    """Base URL → role (:func:`pod_role`) of each Ready pod with a valid role label."""
    return {f"http://{_host(ip)}:{port}": role for pod in pods
            if (ip := _ready_ip(pod)) and (role := pod_role(pod)) is not None}


def ready_pod_kv_sources(pods: Iterable, port: int, kv_events_port: int | None,
                         replay_port_offset: int = 1) -> list[KVEventSource]:
    """The KV-event sources of the Ready pods: PUB ``tcp://<pod IP>:<kv port>`` where the kv port
    is the pod's :data:`KV_EVENTS_PORT_ANNOTATION`, else ``kv_events_port`` (pods with neither are
    left out, as are annotations that are not a port number); replay at the pod's
    :data:`KV_EVENTS_REPLAY_PORT_ANNOTATION`, else kv port + ``replay_port_offset`` (0: none).
    The endpoint is the pod's URL as :func:`ready_pod_urls` names it."""
    out = []
    for pod in pods:
        ip = _ready_ip(pod)
        if ip is None:
            continue
        metadata = getattr(pod, "metadata", None)
        annotations = (metadata.annotations if metadata is not None else None) or {}
        kv_port = _port(annotations.get(KV_EVENTS_PORT_ANNOTATION)) or kv_events_port
        if kv_port is None:
            continue
        replay_port = _port(annotations.get(KV_EVENTS_REPLAY_PORT_ANNOTATION))
        if replay_port is None and replay_port_offset:
            replay_port = kv_port + replay_port_offset
        host = _host(ip)
        out.append(KVEventSource(f"http://{host}:{port}", f"tcp://{host}:{kv_port}",
                                 f"tcp://{host}:{replay_port}" if replay_port else None))
    return out


def _port(value: object) -> int | None:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() and 0 < int(text) < 65536 else None
