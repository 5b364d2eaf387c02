"""The plugin registry: llm-d plugin type names → factories. The one place a plugin is added.

A factory takes ``(instance name, raw parameters map or None, PluginHandle)`` and returns the
plugin instance; it validates its parameters and raises
:class:`~router.scheduling.errors.ConfigError` on bad ones. :func:`builtin_factories` returns a
fresh dict each call, so a caller (a test, an extension) may add its own types without touching any
shared state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.scheduling.interfaces import PluginHandle
from router.scheduling.plugins import (
    affinity_filter,
    disagg,
    load,
    no_hit_lru,
    pickers,
    prefix,
    session,
    spare_capacity,
)

PluginFactory = Callable[[str, Mapping[str, Any] | None, PluginHandle], object]


def builtin_factories() -> dict[str, PluginFactory]:
    """Every built-in plugin type (see ``router/scheduling/README.md``) → its factory."""
    return {
        # data producers
        prefix.APPROX_PRODUCER_TYPE: prefix.build_approx_producer,
        prefix.PRECISE_PRODUCER_TYPE: prefix.build_precise_producer,
        # filters
        affinity_filter.AFFINITY_FILTER_TYPE: affinity_filter.build_affinity_filter,
        spare_capacity.SPARE_CAPACITY_FILTER_TYPE: spare_capacity.build_spare_capacity_filter,
        session.SESSION_FILTER_TYPE: session.build_session_filter,
        disagg.PREFILL_FILTER_TYPE: disagg.build_prefill_filter,
        disagg.DECODE_FILTER_TYPE: disagg.build_decode_filter,
        # profile handler (prefill/decode disaggregation) and llm-d's sidecar header plugin
        disagg.PD_PROFILE_HANDLER_TYPE: disagg.build_pd_profile_handler,
        disagg.PREFILL_HEADER_HANDLER_TYPE: disagg.build_prefill_header_handler,
        # scorers
        prefix.PREFIX_SCORER_TYPE: prefix.build_prefix_scorer,
        load.QUEUE_SCORER_TYPE: load.build_queue_scorer,
        load.KV_CACHE_SCORER_TYPE: load.build_kv_cache_scorer,
        load.TOKEN_LOAD_SCORER_TYPE: load.build_token_load_scorer,
        session.SESSION_AFFINITY_TYPE: session.build_session_affinity,
        no_hit_lru.NO_HIT_LRU_TYPE: no_hit_lru.build_no_hit_lru,
        # pickers
        pickers.MAX_SCORE_PICKER_TYPE: pickers.build_max_score_picker,
        pickers.WEIGHTED_RANDOM_PICKER_TYPE: pickers.build_weighted_random_picker,
        pickers.RANDOM_PICKER_TYPE: pickers.build_random_picker,
        pickers.ROUND_ROBIN_PICKER_TYPE: pickers.build_round_robin_picker,
    }
