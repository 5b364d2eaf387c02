"""Prometheus metrics of one simulated engine, with vLLM's names and labels (``model_name``,
``engine``), in a registry owned by the app (no process globals).

Live values (running, waiting, KV usage, prefix-cache counters, preemptions) are read from the core
and the cache at scrape time; latencies arrive from the driver (:mod:`engine_twin.engine`), in
wall-clock seconds. Histogram buckets are vLLM's (``vllm/v1/metrics/loggers.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.metrics import service_registry
from engine_twin.core import EngineCore
from engine_twin.settings import EngineSimSettings

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM 0.32's series, in its order
NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
"""``vllm:nixl_xfer_time_seconds`` buckets (``NixlPromMetrics``, vLLM's NIXL connector)."""
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
"""``vllm:nixl_bytes_transferred`` buckets: 2 KiB to 8 GiB in steps of 4× (``NixlPromMetrics``)."""
NIXL_DESCRIPTOR_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _LiveCollector(Collector):
    """Gauges and prefix-cache counters read from the engine at each scrape."""

    def __init__(self, settings: EngineSimSettings, core: EngineCore):
        self.settings = settings
        self.core = core
        self.labels = {"model_name": settings.model, "engine": settings.engine_index}

    def _gauge(self, name: str, doc: str, value: float, extra: dict[str, str] | None = None,
               base: dict[str, str] | None = None) -> Metric:
        labels = {**(self.labels if base is None else base), **(extra or {})}
        family = GaugeMetricFamily(name, doc, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        family = CounterMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        s, core = self.settings, self.core
        stats = core.cache.stats
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          core.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                          core.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                          core.cache.usage)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            core.num_preemptions)
        # vLLM labels this one with ``engine`` and CacheConfig fields only (no model_name)
        yield self._gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", 1.0, {
            "block_size": str(s.block_size), "num_gpu_blocks": str(s.num_gpu_blocks),
            "num_cpu_blocks": str(s.cpu_offload_blocks), "enable_prefix_caching": "True",
            "prefix_caching_hash_algo": "sha256_cbor", "cache_dtype": "auto",
        }, base={"engine": self.labels["engine"]})
        if s.plugin_metrics:  # backfill's vLLM plugin (vllm_plugin/): the config vLLM's info gauges leave out
            yield self._gauge("backfill:engine_config_info", "Engine configuration the router reads (backfill plugin)",
                              1.0, {"max_num_seqs": str(s.max_num_seqs), "num_gpu_blocks": str(s.num_gpu_blocks),
                                    "block_size": str(s.block_size)}, base={"engine": self.labels["engine"]})
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", stats.queries_tokens)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", stats.hits_tokens)
        tiers = stats.queries_tokens if (s.cpu_offload_blocks or s.disk_offload_blocks) else 0
        yield self._counter("vllm:external_prefix_cache_queries",
                            "External prefix cache queries from KV connector, in tokens.",
                            tiers + stats.connector_queries_tokens)
        yield self._counter("vllm:external_prefix_cache_hits",
                            "External prefix cache hits from KV connector (CPU/disk tiers, NIXL reads), in tokens.",
                            stats.external_hits_tokens + stats.connector_hits_tokens)


class EngineMetrics:
    """The engine's registry plus the hooks the driver calls to feed its histograms and counters."""

    def __init__(self, settings: EngineSimSettings):
        self.registry = service_registry()
        self.settings = settings
        labels = ["model_name", "engine"]
        self._values = (settings.model, settings.engine_index)
        reg = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=reg).labels(*self._values)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=reg).labels(*self._values)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*labels, "finished_reason"], registry=reg)
        for reason in FINISHED_REASONS:  # vLLM exports every reason from the start, at 0
            self._success.labels(*self._values, reason)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=reg).labels(*self._values)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=reg).labels(*self._values)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    labels, buckets=REQUEST_BUCKETS, registry=reg).labels(*self._values)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=REQUEST_BUCKETS, registry=reg).labels(*self._values)

        self.nixl = _NixlMetrics(settings, labels, self._values, reg) if settings.nixl else None

    def attach(self, core: EngineCore) -> None:
        """Register the live collector reading ``core`` (call once, after it exists)."""
        self.registry.register(_LiveCollector(self.settings, core))

    # ---- driver hooks (wall-clock seconds) -------------------------------------------------
    def first_token(self, ttft_seconds: float) -> None:
        self.ttft.observe(ttft_seconds)

    def finished(self, prompt_tokens: int, generated_tokens: int, itl_seconds: list[float], reason: str,
                 e2e_seconds: float) -> None:
        self.e2e.observe(e2e_seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self._success.labels(*self._values, reason).inc()
        for value in itl_seconds:
            self.itl.observe(value)

    def render(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)


class _NixlMetrics:
    """vLLM's NIXL connector metrics (``NixlPromMetrics`` in ``nixl_connector.py``), on the decode
    side, one observation per KV read: ``vllm:nixl_xfer_time_seconds`` (wall seconds from the read's
    start to its end, the modeled transfer × ``time_scale`` plus the side channel's round trips),
    ``vllm:nixl_bytes_transferred`` (blocks × block bytes), ``vllm:nixl_num_descriptors`` (one per
    block per K and V region per layer, as NIXL registers them), and the counters
    ``vllm:nixl_num_failed_transfers`` (a read whose prefill twin could not be reached) /
    ``vllm:nixl_num_failed_notifications`` (exported for parity; it stays 0: vLLM counts a failed
    notification-only message, sent on a full local prefix hit, and a decode twin always reads at
    least the block holding the last prompt token). vLLM's
    ``vllm:nixl_post_time_seconds`` (time to post a NIXL request) has no counterpart and is left out."""

    def __init__(self, settings: EngineSimSettings, labels: list[str], values: tuple[str, str], reg) -> None:
        self.regions = 2 * settings.num_hidden_layers
        self.xfer_time = Histogram("vllm:nixl_xfer_time_seconds",
                                   "Histogram of transfer duration for NIXL KV Cache transfers.", labels,
                                   buckets=NIXL_XFER_BUCKETS, registry=reg).labels(*values)
        self.bytes = Histogram("vllm:nixl_bytes_transferred",
                               "Histogram of bytes transferred per NIXL KV Cache transfers.", labels,
                               buckets=NIXL_BYTES_BUCKETS, registry=reg).labels(*values)
        self.descriptors = Histogram("vllm:nixl_num_descriptors",
                                     "Histogram of number of descriptors per NIXL  KV Cache transfers.", labels,
                                     buckets=NIXL_DESCRIPTOR_BUCKETS, registry=reg).labels(*values)
        self.failed_transfers = Counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.",
                                        labels, registry=reg).labels(*values)
        self.failed_notifications = Counter("vllm:nixl_num_failed_notifications",
                                            "Number of failed NIXL KV Cache notifications.", labels,
                                            registry=reg).labels(*values)

    def transfer(self, seconds: float, nbytes: int, blocks: int) -> None:
        """One finished KV read (wall seconds, bytes, blocks)."""
        self.xfer_time.observe(seconds)
        self.bytes.observe(nbytes)
        self.descriptors.observe(blocks * self.regions)
