"""The simulated fleet: engine twins in virtual time and their KV-event feed to the router's index.

Each :class:`FleetEngine` is the twin's pure :class:`~engine_twin.core.EngineCore` over its own
:class:`~engine_twin.kv_cache.TieredPrefixCache` (the classes the ``engine-sim`` server drives in
real time), plus the pool's :class:`~router.pool.EndpointState` the router schedules on. Its
``role`` (``both``, or ``prefill`` / ``decode`` for disaggregation) is its endpoint's
:attr:`~router.scheduling.types.Endpoint.role`, which the P/D config's ``prefill-filter`` /
``decode-filter`` read; the simulation's two-stage flow (:mod:`lab.simulate.sim`) follows the
scheduler's picks.

KV events go from the twin's cache sink to the router's :class:`~router.kv_index.index.KVBlockIndex`
in process: each twin event becomes the router's event type with exactly the fields the wire
carries for vLLM's map layout (:func:`engine_twin.kv_events.encode_event`: ``extra_keys`` one
``None`` per block, ``group_idx`` 0, ``kv_cache_spec_kind`` ``full_attention``), as
:func:`router.kv_index.events.decode_event` would decode it — without the msgpack round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine_twin import kv_events as twin
from engine_twin.core import EngineCore, StepOutcome
from engine_twin.kv_cache import TieredPrefixCache
from engine_twin.settings import EngineSimSettings
from router.kv_index import events as wire
from router.pool import EndpointState, EngineMetrics
from router.scheduling.types import Endpoint

Role = Literal["both", "prefill", "decode"]


def to_router_events(events: list[twin.KVEvent]) -> list[wire.KVEvent]:
    """The twin's events as the router decodes them off the wire (map layout; module docstring)."""
    out: list[wire.KVEvent] = []
    append = out.append
    stored, removed, w_stored, w_removed = twin.BlockStored, twin.BlockRemoved, wire.BlockStored, wire.BlockRemoved
    for e in events:  # one event per offloaded block on a CPU tier: keep this loop lean
        kind = type(e)
        if kind is stored:
            append(w_stored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,  # type: ignore[union-attr]
                            e.medium, e.lora_name, [None] * len(e.block_hashes), 0, "full_attention"))  # type: ignore[union-attr]
        elif kind is removed:
            append(w_removed(e.block_hashes, e.medium, 0))  # type: ignore[union-attr]
        else:
            append(wire.AllBlocksCleared())
    return out


@dataclass(eq=False)
class FleetEngine:
    """One engine twin and the router's view of it. ``pending``: KV events of the step running now
    (published when it ends, as vLLM publishes a step's events after it ran)."""

    name: str
    core: EngineCore
    cache: TieredPrefixCache
    state: EndpointState
    role: Role = "both"
    busy: bool = False
    pending: list[twin.KVEvent] = field(default_factory=list)
    steps: int = 0
    busy_s: float = 0.0
    generated: int = 0
    """Output tokens sampled here (a prefill engine's: one per prefill leg)."""

    @classmethod
    def build(cls, name: str, settings: EngineSimSettings, model: str, role: Role = "both",
              collect_events: bool = True) -> FleetEngine:
        """An engine twin with ``settings`` (its cache sized from them), named ``name`` (a base URL)."""
        pending: list[twin.KVEvent] = []
        cache = TieredPrefixCache(settings.num_gpu_blocks, settings.block_size, settings.cpu_offload_blocks,
                                  settings.disk_offload_blocks, sink=pending.extend if collect_events else None)
        state = EndpointState(Endpoint(name, role=role), healthy=True, models=[model])
        return cls(name, EngineCore(settings, cache), cache, state, role, pending=pending)

    def step(self, now: float) -> StepOutcome:
        """One core step starting at ``now`` (its KV events land in :attr:`pending`)."""
        outcome = self.core.step(now)
        if outcome.duration:
            self.steps += 1
            self.busy_s += outcome.duration
            self.generated += len(outcome.sampled)
        return outcome

    def take_events(self) -> list[twin.KVEvent]:
        """The events collected since the last call."""
        if not self.pending:
            return []
        out = list(self.pending)
        self.pending.clear()
        return out

    def metrics(self) -> EngineMetrics:
        """What a scrape of this engine's ``/metrics`` would parse to (vLLM's series, :mod:`router.pool`)."""
        core, cache = self.core, self.cache
        stats = cache.stats
        return EngineMetrics(num_requests_waiting=core.num_waiting, num_requests_running=core.num_running,
                             kv_cache_usage_perc=cache.usage, block_size=cache.block_size,
                             num_gpu_blocks=cache.num_gpu_blocks, num_cpu_blocks=cache.cpu_capacity,
                             prefix_cache_queries=float(stats.queries_tokens), prefix_cache_hits=float(stats.hits_tokens),
                             external_prefix_cache_hits=float(stats.external_hits_tokens),
                             num_preemptions=float(core.num_preemptions))
