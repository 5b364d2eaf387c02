"""What the router reads of an engine's ``GET /metrics`` (vLLM's Prometheus text): :class:`EngineMetrics`,
parsed by :func:`parse_engine_metrics`. Pure: the probes (:mod:`router.pool.probes`) fetch the text,
a simulation builds :class:`EngineMetrics` itself; either hands it to
:meth:`router.pool.state.PoolState.record_metrics`.

What an engine states about its own size (router/README.md, "Engine slots"):

* ``vllm:cache_config_info`` — vLLM's info gauge, one series per engine (data-parallel rank), its
  labels every ``CacheConfig`` field (``vllm/v1/metrics/loggers.py``, ``log_metrics_info``):
  ``block_size``, ``num_gpu_blocks``, ``num_cpu_blocks`` … vLLM (0.32) exports no series with
  ``max_num_seqs``;
* ``backfill:engine_config_info{max_num_seqs, num_gpu_blocks, block_size}`` — the same kind of
  info gauge, exported by backfill's vLLM plugin (``vllm_plugin/``, distribution ``backfill-vllm``)
  and by the engine twin: the engine's sequence slots, stated.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

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
    "backfill:engine_config_info",
)
_WANTED_PREFIXES = tuple(s.encode() for s in SCRAPED_SERIES)


@dataclass(slots=True)
class EngineMetrics:
    """One scrape of an engine's ``/metrics``, summed over its ``engine`` series (data-parallel
    ranks): waiting/running in requests, ``kv_cache_usage_perc`` the mean fraction 0..1, prefix
    counters in tokens, block fields from ``vllm:cache_config_info`` (else from
    ``backfill:engine_config_info``; None when neither has them).

    ``max_num_seqs`` is the engine's sequence slots as stated by ``backfill:engine_config_info``,
    summed over its series (one per data-parallel rank, each rank has ``max_num_seqs`` of its own,
    and the running counts are summed the same way), requests; None when the engine states none.
    ``engine_ranks``: the ``vllm:cache_config_info`` series seen (its data-parallel ranks; 0 when
    absent), to scale a per-rank ``max_num_seqs`` the engine answered elsewhere
    (:func:`router.pool.slots.server_info_max_num_seqs`)."""

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
    max_num_seqs: int | None = None
    engine_ranks: int = 0


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
    stated: dict[str, str] = {}
    stated_slots: list[int] = []
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
                out.engine_ranks += 1
                out.block_size = _int_or_none(labels.get("block_size"))
                out.num_gpu_blocks = _int_or_none(labels.get("num_gpu_blocks"))
                out.num_cpu_blocks = _int_or_none(labels.get("num_cpu_blocks"))
            elif name == "backfill:engine_config_info":
                stated = sample.labels
                slots = _int_or_none(stated.get("max_num_seqs"))
                if slots is not None and slots > 0:
                    stated_slots.append(slots)
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
    if stated_slots:
        out.max_num_seqs = sum(stated_slots)
    if out.block_size is None:
        out.block_size = _int_or_none(stated.get("block_size"))
    if out.num_gpu_blocks is None:
        out.num_gpu_blocks = _int_or_none(stated.get("num_gpu_blocks"))
    return out


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "", "None") else None
    except ValueError:
        return None
