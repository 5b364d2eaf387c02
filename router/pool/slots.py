"""An engine's sequence slots (vLLM's ``--max-num-seqs``): stated by the engine, else learned from its scrapes.

Which figure the router uses (:attr:`router.scheduling.types.Endpoint.slots`), first found wins:

1. a configured ``max_num_seqs`` (router setting; the operator's word);
2. the figure the engine **states** (:attr:`Endpoint.stated_max_num_seqs`): the
   ``backfill:engine_config_info{max_num_seqs}`` series backfill's vLLM plugin and the engine twin
   export in ``/metrics`` (:mod:`router.pool.engine_metrics`), else vLLM's own answer at
   ``GET /server_info?config_format=json`` (served only with ``VLLM_SERVER_DEV_MODE=1``:
   ``vllm_config.scheduler_config.max_num_seqs``, per data-parallel rank,
   :func:`server_info_max_num_seqs`). vLLM 0.32 exports ``max_num_seqs`` nowhere else: its
   ``vllm:cache_config_info`` carries ``CacheConfig`` only, ``/v1/models`` ``max_model_len``,
   ``/load`` a request count;
3. the figure **learned** from scrapes (:func:`learn_slots`), only while the engine states none.

Learning. Every scrape raises ``peak_running``, the most requests the engine was seen running (a
lower bound of ``max_num_seqs``). The engine counts as full when :data:`FULL_SCRAPES` scrapes in a
row show it running ``peak_running`` requests with others waiting (one such scrape is often a
request that arrived between two engine steps, or a prefill the token budget held back: the
operator's reproduction of issue 24 learned 4 slots on ``--max-num-seqs 8`` engines from one);
``learned_max_num_seqs`` is then ``peak_running`` and follows it upward. A learned figure is a
lower bound that the router's own slot reserve stops it from ever exceeding (it sends no more
sheddable work than the slots it assumes), so :data:`RELEARN_AFTER_S` after the last
confirmation it is probed (:attr:`Endpoint.probing`): sheddable work may then hold one request
more than the engine was ever seen running (``peak_running + 1``,
:func:`router.scheduling.saturation.sheddable_slots`), so an engine with more slots runs it,
raises ``peak_running`` and the estimate climbs (the probe goes on from each new peak); a full
engine holds it waiting, which confirms the figure; and :data:`PROBE_S` without a new peak ends
the probe with the figure confirmed as it is (with only sheddable work in flight the engine never
shows requests waiting, and an endless probe would leave the slot reserve short for good). Everything learned or stated is forgotten when the endpoint goes down
(:func:`forget_slots`): it may come back as another engine. A stated figure is never lowered by
what was seen: learning does not touch it.
"""

from __future__ import annotations

from typing import Any

from router.scheduling.types import Endpoint

FULL_SCRAPES = 2
"""Scrapes in a row that must show the engine running ``peak_running`` requests with others
waiting before it counts as full (ours: one scrape is often a request between two engine steps)."""

RELEARN_AFTER_S = 30.0
"""Seconds after the last confirmation that a learned slot count is probed upward again (ours:
a few batch requests' durations on the fleets measured in docs/benchmarks.md)."""

PROBE_S = 10.0
"""How long a probe offers one slot more than seen without the engine ever running more before
the count is taken as confirmed again (ours: long enough for the router to send a request into
the extra slot and a scrape to see it; a probe costs at most one request waiting in the engine's
queue, or the slot reserve's slot, for this long)."""


def learn_slots(endpoint: Endpoint, running: int, waiting: int, now: float) -> None:
    """Learn from one scrape at ``now`` (seconds, the pool's clock) showing ``running`` and
    ``waiting`` requests (module docstring). Sets ``peak_running``, ``full_scrapes``,
    ``learned_max_num_seqs``, ``slots_confirmed_at`` and ``probe_since``; never
    ``stated_max_num_seqs``."""
    raised = running > endpoint.peak_running
    endpoint.peak_running = max(endpoint.peak_running, running)
    if waiting > 0 and 0 < running >= endpoint.peak_running:
        endpoint.full_scrapes += 1
    else:
        endpoint.full_scrapes = 0
    if endpoint.full_scrapes >= FULL_SCRAPES:
        _confirm(endpoint, now)
        return
    if endpoint.learned_max_num_seqs is None:
        return
    confirmed = endpoint.slots_confirmed_at
    if confirmed is not None and now - confirmed <= RELEARN_AFTER_S:
        endpoint.learned_max_num_seqs = endpoint.peak_running
        return
    if endpoint.probe_since is None or raised:  # a probe starts, or it found a slot: go on from here
        endpoint.probe_since = now
    if now - endpoint.probe_since > PROBE_S:  # offered one request more for PROBE_S, never ran it
        _confirm(endpoint, now)
    else:
        endpoint.learned_max_num_seqs = endpoint.peak_running


def _confirm(endpoint: Endpoint, now: float) -> None:
    endpoint.learned_max_num_seqs = endpoint.peak_running
    endpoint.slots_confirmed_at = now
    endpoint.probe_since = None


def state_slots(endpoint: Endpoint, max_num_seqs: int | None) -> None:
    """Record the slot count the engine stated (requests; None: it stated none, the learned one
    applies again)."""
    endpoint.stated_max_num_seqs = max_num_seqs if max_num_seqs is not None and max_num_seqs > 0 else None


def server_info_max_num_seqs(body: Any, engine_ranks: int = 1) -> int | None:
    """The requests one engine admits into running, from vLLM's ``GET
    /server_info?config_format=json`` answer (``{"vllm_config": {"scheduler_config":
    {"max_num_seqs": N, "max_num_active_seqs": M | null, …}, …}, …}``, vLLM 0.32's
    ``vllm/entrypoints/serve/dev/server_info/api_router.py``): ``max_num_active_seqs`` when set
    (vLLM 0.32's ``SchedulerConfig``: the admission limit, at most ``max_num_seqs``), else
    ``max_num_seqs``; times ``engine_ranks`` (the data-parallel ranks behind one API server, each
    with its own slots; at least 1), requests. None when the body carries no positive integer
    there (never raises)."""
    try:
        config = body["vllm_config"]["scheduler_config"]
        value = config["max_num_seqs"]
        active = config.get("max_num_active_seqs")
    except (KeyError, TypeError, IndexError, AttributeError):
        return None
    if not _positive_int(value):
        return None
    if _positive_int(active):
        value = min(value, active)
    return value * max(1, engine_ranks)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def slots_source(endpoint: Endpoint) -> str | None:
    """Where :attr:`Endpoint.slots` comes from: ``"configured"``, ``"stated"``, ``"learned"``, or
    None while unknown."""
    if endpoint.max_num_seqs is not None:
        return "configured"
    if endpoint.stated_max_num_seqs is not None:
        return "stated"
    return "learned" if endpoint.learned_max_num_seqs is not None else None


def forget_slots(endpoint: Endpoint) -> None:
    """Forget what was learned and stated (the endpoint went down)."""
    endpoint.peak_running = 0
    endpoint.full_scrapes = 0
    endpoint.learned_max_num_seqs = None
    endpoint.slots_confirmed_at = None
    endpoint.probe_since = None
    endpoint.stated_max_num_seqs = None
