"""``BackfillScheduler``: vLLM V1's scheduler with backfill's three protections.

Load with ``--scheduler-cls backfill_vllm.scheduler.BackfillScheduler --scheduling-policy priority``
and ``BACKFILL_BACKGROUND_PRIORITY_THRESHOLD`` set (:mod:`backfill_vllm.config`). Unset, or under
the FCFS policy (which ignores ``priority``, as the engine twin does), it is vLLM's scheduler
unchanged apart from the counters. It subclasses vLLM's ``Scheduler`` (``AsyncScheduler`` when
vLLM turned async scheduling on) and overrides hooks only; ``schedule`` itself runs as vLLM wrote it.

1. **Background prefill budget per step** (the twin's ``--max-background-prefill-tokens``,
   ``engine_twin/core.py`` item 4). A step that starts while a foreground prefill is pending (the
   head of the waiting queue is foreground, or a running foreground request has more than one token
   to compute) gives background prefills nothing; otherwise their chunks share at most
   ``BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS`` of the step, all together. Decode tokens are never
   limited. Hook: ``_reserve_prefill_lookahead``, which vLLM calls on every request's chunk size in
   both the running and the waiting pass, right before allocating its blocks; a chunk cut to 0 is
   skipped (running: ``continue``; waiting: the pass stops, and under the priority policy everything
   behind a background head is background too). The tokens cut are counted
   (``backfill:deferred_background_prefill_tokens_total``).
2. **Foreground admission.** Before vLLM's pass, when the waiting head is foreground and either no
   slot is free (``--max-num-seqs``) or the free blocks cannot hold its first chunk, running
   background requests are preempted by recompute, newest (latest arrival) first, until it fits;
   never a foreground one. vLLM's own waiting pass never preempts (the head just waits:
   vllm-project/vllm#40004, #24365). The victims go back to the waiting queue through vLLM's
   ``_preempt_request`` and are reported in the step's ``preempted_req_ids`` as vLLM's own are.
3. **Retention** (:mod:`backfill_vllm.retention`): the GPU block pool evicts blocks only background
   requests wrote or read before any block a foreground request wrote or read; the CPU offload
   tier does the same when its ``OffloadingConnector`` is given the plugin's cache policy
   (:mod:`backfill_vllm.offload`), which learns each request's class from ``add_request``.
4. **Counters** ride to vLLM's front end in ``SchedulerStats.num_kv_fetch_reqs_by_stage`` (keys
   ``backfill:…``, deltas since the last stats); :class:`backfill_vllm.metrics.BackfillStatLogger`
   takes them out before vLLM's loggers see the dict and exports them on ``/metrics``.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from backfill_vllm.config import BackfillConfig, load_config
from backfill_vllm.offload import OFFLOAD_EVICTIONS, record_request
from backfill_vllm.retention import BACKGROUND, FOREGROUND, TwoClassFreeQueue, install

logger = init_logger("vllm.backfill")  # under "vllm": vLLM configures that logger's handlers

STATS_PREFIX = "backfill:"
"""Keys of the plugin's counters in ``SchedulerStats.num_kv_fetch_reqs_by_stage``."""
DEFERRED_KEY = STATS_PREFIX + "deferred_background_prefill_tokens"
PREEMPTION_KEYS = {c: f"{STATS_PREFIX}preemptions:{c}" for c in (BACKGROUND, FOREGROUND)}
EVICTION_KEYS = {c: f"{STATS_PREFIX}evictions:{c}" for c in (BACKGROUND, FOREGROUND)}
OFFLOAD_EVICTION_KEYS = {c: f"{STATS_PREFIX}offload_evictions:{c}" for c in (BACKGROUND, FOREGROUND)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BackfillScheduler(Scheduler):
    """vLLM's ``Scheduler`` with the module's rules. Constructed by vLLM's engine core with
    ``Scheduler``'s arguments; becomes a :class:`BackfillAsyncScheduler` when
    ``vllm_config.scheduler_config.async_scheduling`` is on.

    Per-step figures for tests and logs: ``last_background_share`` (the background prefill tokens
    the step allowed), ``last_background_prefill_tokens`` (what background prefills got),
    ``last_deferred_tokens`` (what the share cut); totals in ``totals``."""

    def __new__(cls, *args: Any, **kwargs: Any) -> BackfillScheduler:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is BackfillScheduler and getattr(vllm_config.scheduler_config, "async_scheduling", False):
            cls = BackfillAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = load_config()
        if config.background_priority_threshold is not None and self.policy != SchedulingPolicy.PRIORITY:
            logger.warning("backfill: BACKFILL_BACKGROUND_PRIORITY_THRESHOLD is set but --scheduling-policy is %s; "
                           "the rules need 'priority' (FCFS ignores priority) and stay off", self.policy.value)
            config = BackfillConfig(None, config.max_background_prefill_tokens)
        self.backfill = config
        self._rules_on = config.background_priority_threshold is not None
        self.retention: TwoClassFreeQueue | None = None
        if self._rules_on:
            self.retention = install(self.kv_cache_manager.block_pool)
        self.totals = {DEFERRED_KEY: 0, **{k: 0 for k in PREEMPTION_KEYS.values()}}
        self._reported = {k: 0 for k in (DEFERRED_KEY, *PREEMPTION_KEYS.values(), *EVICTION_KEYS.values(),
                                          *OFFLOAD_EVICTION_KEYS.values())}
        self._bg_left = 0
        self.last_background_share = 0
        self.last_background_prefill_tokens = 0
        self.last_deferred_tokens = 0
        logger.info("backfill: scheduler %s, background priority threshold %s, max background prefill tokens %d",
                    type(self).__name__, config.background_priority_threshold, config.max_background_prefill_tokens)

    # ---- the step --------------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """vLLM's ``schedule`` after the foreground admission rule, under this step's background share."""
        if not self._rules_on:
            return super().schedule(throttle_prefills)
        self._admit_foreground()
        share = self._background_share()
        self._bg_left = share
        self.last_background_share = share
        self.last_deferred_tokens = 0
        output = super().schedule(throttle_prefills)
        self.last_background_prefill_tokens = share - self._bg_left
        return output

    def _is_background(self, request: Request) -> bool:
        return self.backfill.is_background(request.priority)

    @staticmethod
    def _is_prefilling(request: Request) -> bool:
        """Whether ``request`` has more than one token to compute: a prefill chunk (first or after a
        preemption), not a decode. Speculative tokens are not counted (a decode with drafts is still
        a decode), and under async scheduling a decode's ``num_computed_tokens`` runs ahead of
        ``num_tokens`` by its placeholders, so it never counts as prefilling."""
        return request.num_computed_tokens + 1 < request.num_tokens

    def _waiting_head(self) -> Request | None:
        return self.waiting.peek_request() if self.waiting else None

    def _background_share(self) -> int:
        """Background prefill tokens this step may carry (rule 1): none while a foreground prefill is
        pending, else ``BACKFILL_MAX_BACKGROUND_PREFILL_TOKENS``."""
        head = self._waiting_head()
        if head is not None and not self._is_background(head):
            return 0
        if any(not self._is_background(r) and self._is_prefilling(r) for r in self.running):
            return 0
        return self.backfill.max_background_prefill_tokens

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's chunk-size hook, then rule 1: a background prefill chunk is cut to what is left of
        the step's share (0: skipped this step). A running request's decode (with its speculative
        tokens) is never cut."""
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if not self._rules_on or n <= 0 or not self._is_background(request):
            return n
        if request.status == RequestStatus.RUNNING and not self._is_prefilling(request):
            return n
        granted = min(n, self._bg_left)
        self._bg_left -= granted
        cut = n - granted
        if cut:
            self.last_deferred_tokens += cut
            self.totals[DEFERRED_KEY] += cut
        return granted

    # ---- rule 2: foreground admission ------------------------------------------------------------
    def _head_needs(self, head: Request) -> tuple[bool, int]:
        """Whether the foreground ``head`` lacks a slot, and how many more free blocks its first chunk
        needs than the pool has (≤ 0: it fits). Its prefix hits held by running requests need no new
        block; hits on free (evictable) blocks leave the free count as a new block would."""
        no_slot = len(self.running) + self.num_waiting_for_streaming_input >= self.max_num_active_reqs
        block_size = self.block_size
        total = head.num_tokens
        computed = head.num_computed_tokens
        held = 0
        if computed == 0 and self.cache_config.enable_prefix_caching:
            hit_blocks, hit_tokens = self.kv_cache_manager.get_computed_blocks(head)[:2]
            computed = hit_tokens
            held = sum(1 for group in hit_blocks.blocks for b in group if b.ref_cnt > 0)
        chunk = min(total - computed, self.max_num_scheduled_tokens)
        need = _cdiv(computed + chunk, block_size) - held
        return no_slot, need - self.kv_cache_manager.block_pool.get_num_free_blocks()

    def _admit_foreground(self) -> None:
        """Rule 2: preempt running background requests, newest first, while the waiting foreground
        head lacks a slot or blocks for its first chunk. Never a foreground request."""
        head = self._waiting_head()
        if head is None or self._is_background(head) or self._pause_state != PauseState.UNPAUSED:
            return
        if self._is_blocked_waiting_status(head.status):  # waits on a KV load, a grammar, …: not for room
            return
        no_slot, short = self._head_needs(head)
        if not no_slot and short <= 0:
            return
        victims = sorted((r for r in self.running if self._is_background(r)),
                         key=lambda r: r.arrival_time, reverse=True)
        now = time.monotonic()
        block_pool = self.kv_cache_manager.block_pool
        for victim in victims:
            if not no_slot and short <= 0:
                break
            if not self._request_blocks_can_be_freed(victim):
                continue
            free_before = block_pool.get_num_free_blocks()
            self.running.remove(victim)
            self._preempt_request(victim, now, drop_stale_output=self.requires_kv_delivery)
            no_slot = False
            short -= block_pool.get_num_free_blocks() - free_before

    # ---- hooks: requests, preemption and block frees ---------------------------------------------
    def add_request(self, request: Request) -> None:
        """vLLM's ``add_request``, after recording the request's class for the CPU offload tier's
        policy (:mod:`backfill_vllm.offload`)."""
        if self._rules_on:
            record_request(request.request_id, self._is_background(request))
        super().add_request(request)

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        """vLLM's preemption, counted by class (``backfill:preemptions_total{class}``)."""
        cls = BACKGROUND if self._is_background(request) else FOREGROUND
        self.totals[PREEMPTION_KEYS[cls]] += 1
        super()._preempt_request(request, timestamp, drop_stale_output=drop_stale_output)

    def _free_request_blocks(self, request: Request) -> None:
        """Mark a foreground request's blocks (rule 3) before vLLM frees them."""
        if self.retention is not None and not self._is_background(request):
            blocks = self.kv_cache_manager.get_blocks(request.request_id).blocks
            for group in blocks:
                self.retention.mark_foreground(group)
        super()._free_request_blocks(request)

    # ---- counters --------------------------------------------------------------------------------
    def counter_totals(self) -> dict[str, int]:
        """Every counter's total since start: deferred tokens, preemptions and evictions by class."""
        totals = dict(self.totals)
        evictions = self.retention.evictions if self.retention is not None else {}
        for cls, key in EVICTION_KEYS.items():
            totals[key] = evictions.get(cls, 0)
        for cls, key in OFFLOAD_EVICTION_KEYS.items():
            totals[key] = OFFLOAD_EVICTIONS[cls]
        return totals

    def make_stats(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's ``SchedulerStats`` with the counters' increments since the last call added to
        ``num_kv_fetch_reqs_by_stage`` (a ``dict[str, int]`` vLLM ships to the front end as is; its
        loggers read only their own stage keys, and the plugin's stat logger removes these first)."""
        stats = super().make_stats(*args, **kwargs)
        if stats is None:
            return None
        for key, total in self.counter_totals().items():
            delta = total - self._reported[key]
            if delta:
                stats.num_kv_fetch_reqs_by_stage[key] = delta
                self._reported[key] = total
        return stats


class BackfillAsyncScheduler(BackfillScheduler, AsyncScheduler):
    """:class:`BackfillScheduler` over vLLM's ``AsyncScheduler`` (async scheduling on)."""

