"""The simulated fleet: engine twins in virtual time and their KV-event feed to the router's index.

Each :class:`FleetEngine` is the lab's model-time driver (:mod:`lab.toolkit.model_time`: the
twin's pure :class:`~engine_twin.core.EngineCore` over its own
:class:`~engine_twin.kv_cache.TieredPrefixCache`, the classes the ``engine-sim`` server drives in
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

from typing import Literal

from engine_twin import kv_events as twin
from engine_twin.settings import EngineSimSettings
from lab.toolkit.model_time import ModelTimeEngine
from router.kv_index import events as wire
from router.pool import EndpointState
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


class FleetEngine(ModelTimeEngine):
    """One engine twin (:class:`~lab.toolkit.model_time.ModelTimeEngine`, stepped by the
    simulation's event loop at its ``now``) and the router's view of it: ``name`` (its base URL),
    ``role``, the pool's :attr:`state`, and ``busy`` while a step runs. :attr:`pending` holds the
    KV events of the step running now (published when it ends, as vLLM publishes a step's events
    after it ran)."""

    def __init__(self, name: str, settings: EngineSimSettings, model: str, role: Role = "both", *,
                 collect_events: bool = True):
        super().__init__(settings, collect_events=collect_events)
        self.name = name
        self.role: Role = role
        self.busy = False
        self.state = EndpointState(Endpoint(name, role=role), healthy=True, models=[model])

    @classmethod
    def build(cls, name: str, settings: EngineSimSettings, model: str, role: Role = "both",
              collect_events: bool = True) -> FleetEngine:
        """An engine twin with ``settings`` (its cache sized from them), named ``name`` (a base URL),
        serving ``model``."""
        return cls(name, settings, model, role, collect_events=collect_events)

