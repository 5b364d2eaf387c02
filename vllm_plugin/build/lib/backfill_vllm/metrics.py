"""The plugin's counters on vLLM's ``/metrics``: a stat logger in vLLM's front-end process.

vLLM V1 runs the scheduler in the engine-core process and serves ``/metrics`` from the API server
process; the scheduler's figures reach the front end only as ``SchedulerStats``, which the front
end hands to its stat loggers (``vllm/v1/metrics/loggers.py`` ``StatLoggerManager``; plugins from
the ``vllm.stat_logger_plugins`` entry-point group come first, before vLLM's ``LoggingStatLogger``
and ``PrometheusStatLogger``). :class:`BackfillStatLogger` is that plugin: it pops the
``backfill:…`` increments :class:`backfill_vllm.scheduler.BackfillScheduler` put in
``num_kv_fetch_reqs_by_stage`` and adds them to prometheus_client counters in the default registry,
which vLLM's ``/metrics`` serves (with ``--api-server-count`` > 1 vLLM sets
``PROMETHEUS_MULTIPROC_DIR`` first and prometheus_client's counters become multiprocess ones, as
vLLM's own).

Series (label ``engine``, the engine index, as vLLM's):

- ``backfill:deferred_background_prefill_tokens_total``: background prefill tokens the per-step
  share cut (rule 1);
- ``backfill:preemptions_total{class=background|foreground}``: recompute preemptions, vLLM's own and
  the plugin's (rule 2), by the preempted request's class;
- ``backfill:evictions_total{class=background|foreground}``: cached GPU blocks reused for new
  content, by the block's class (rule 3; 0 while the rules are off);
- ``backfill:offload_evictions_total{class=background|foreground}``: chunks the CPU offload tier
  evicted, by class (only with the plugin's cache policy, :mod:`backfill_vllm.offload`);
- ``backfill:engine_config_info{max_num_seqs, num_gpu_blocks, block_size}`` = 1: what the engine can
  hold (vLLM's ``vllm:cache_config_info`` has the blocks but not ``max_num_seqs``).
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from backfill_vllm.retention import BACKGROUND, FOREGROUND
from backfill_vllm.scheduler import (
    DEFERRED_KEY,
    EVICTION_KEYS,
    OFFLOAD_EVICTION_KEYS,
    PREEMPTION_KEYS,
    STATS_PREFIX,
)

_METRICS: dict[str, Any] = {}


def _metrics() -> dict[str, Any]:
    """The prometheus_client objects, created once per process (the registry refuses duplicates)."""
    if not _METRICS:
        _METRICS["deferred"] = prometheus_client.Counter(
            "backfill:deferred_background_prefill_tokens",
            "Background prefill tokens the per-step share (BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS) deferred.",
            labelnames=["engine"])
        _METRICS["preemptions"] = prometheus_client.Counter(
            "backfill:preemptions", "Recompute preemptions by the preempted request's class.",
            labelnames=["engine", "class"])
        _METRICS["evictions"] = prometheus_client.Counter(
            "backfill:evictions", "Cached GPU KV blocks evicted for reuse, by the block's class.",
            labelnames=["engine", "class"])
        _METRICS["offload_evictions"] = prometheus_client.Counter(
            "backfill:offload_evictions",
            "Chunks the CPU offload tier evicted, by class (with the plugin's cache policy only).",
            labelnames=["engine", "class"])
        _METRICS["config"] = prometheus_client.Gauge(
            "backfill:engine_config_info", "What the engine can hold (1): max_num_seqs, num_gpu_blocks, block_size.",
            labelnames=["engine", "max_num_seqs", "num_gpu_blocks", "block_size"], multiprocess_mode="mostrecent")
    return _METRICS


class BackfillStatLogger(AggregateStatLoggerBase):
    """A ``vllm.stat_logger_plugins`` logger (aggregate form: one for all engines of the front end)."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = engine_indexes or [0]
        self.vllm_config = vllm_config
        metrics = _metrics()
        for idx in self.engine_indexes:
            engine = str(idx)
            metrics["deferred"].labels(engine=engine)
            for cls in (BACKGROUND, FOREGROUND):
                metrics["preemptions"].labels(engine=engine, **{"class": cls})
                metrics["evictions"].labels(engine=engine, **{"class": cls})
                metrics["offload_evictions"].labels(engine=engine, **{"class": cls})
        self._set_config_info()

    def _set_config_info(self) -> None:
        cache = self.vllm_config.cache_config
        sched = self.vllm_config.scheduler_config
        for idx in self.engine_indexes:
            _metrics()["config"].labels(engine=str(idx), max_num_seqs=str(sched.max_num_seqs),
                                        num_gpu_blocks=str(cache.num_gpu_blocks), block_size=str(cache.block_size)).set(1)

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        """Take the ``backfill:…`` increments out of ``scheduler_stats`` and add them to the counters."""
        if scheduler_stats is None:
            return
        stages = scheduler_stats.num_kv_fetch_reqs_by_stage
        if not any(key.startswith(STATS_PREFIX) for key in stages):
            return
        ours = {key: stages.pop(key) for key in list(stages) if key.startswith(STATS_PREFIX)}
        metrics, engine = _metrics(), str(engine_idx)
        if ours.get(DEFERRED_KEY):
            metrics["deferred"].labels(engine=engine).inc(ours[DEFERRED_KEY])
        for cls in (BACKGROUND, FOREGROUND):
            if ours.get(PREEMPTION_KEYS[cls]):
                metrics["preemptions"].labels(engine=engine, **{"class": cls}).inc(ours[PREEMPTION_KEYS[cls]])
            if ours.get(EVICTION_KEYS[cls]):
                metrics["evictions"].labels(engine=engine, **{"class": cls}).inc(ours[EVICTION_KEYS[cls]])
            if ours.get(OFFLOAD_EVICTION_KEYS[cls]):
                metrics["offload_evictions"].labels(engine=engine, **{"class": cls}).inc(
                    ours[OFFLOAD_EVICTION_KEYS[cls]])

    def log_engine_initialized(self) -> None:
        """Refresh the config info (``num_gpu_blocks`` is known once the engine profiled its memory)."""
        self._set_config_info()
