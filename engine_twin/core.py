"""The simulated engine's core: vLLM V1's scheduler step by step, pure (no I/O, no clock, no asyncio).

:class:`EngineCore` holds the waiting and running requests and the tiered prefix cache. A driver
adds requests (:meth:`~EngineCore.add`), aborts them (:meth:`~EngineCore.abort`) and calls
:meth:`~EngineCore.step`, which schedules one step, advances every scheduled request as if the
model had run it and returns a :class:`StepOutcome`: the step's duration in model seconds
(:mod:`engine_twin.step_model`), the tokens each request got, who sampled a token, finished or was
preempted. Time only comes in as arguments; the HTTP server drives it in real time
(:mod:`engine_twin.engine`), a simulation can drive it in virtual time.

One step, as vLLM V1's ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``):

1. **Running requests first**, in the running list's order: each gets ``num_tokens −
   num_computed_tokens`` new tokens (1 when decoding; the next chunk of a partial prefill), capped
   by ``--long-prefill-token-threshold`` (when > 0) and by what is left of the step's token budget
   ``--max-num-batched-tokens``. The blocks those tokens need are allocated now. When the cache is
   short, a running request is **preempted** by recompute and the allocation retried: under
   ``--scheduling-policy priority`` the one with the largest ``(priority, arrival)`` (lowest
   priority, latest arrival; tokens it already got this step go back to the budget), under
   ``fcfs`` the last of the running list. A preempted request frees its blocks (cached ones stay
   evictable, so its redo hits them), restarts from 0 computed tokens and goes back to the front of
   the waiting queue; ``num_preemptions`` counts it (``vllm:num_preemptions_total``). When the
   request being scheduled is itself the one to go, the running pass stops.
2. **Then waiting requests**, only when this step preempted nobody, in policy order (``fcfs``:
   arrival; ``priority``: ``(priority, arrival)``, lowest first), while ``--max-num-seqs`` and the
   budget allow: the prefix cache is looked up (GPU, then CPU/disk tiers, at most ``num_tokens − 1``
   tokens), the rest of the prompt is chunked under the budget and the threshold, and the first
   request whose blocks do not fit stops the pass (head-of-line, as vLLM).
3. ``--max-num-partial-prefills`` / ``--max-long-partial-prefills`` (a prompt is *long* above the
   threshold): vLLM V1 accepts them but its scheduler does not enforce them (vllm-project/vllm#14003,
   open PRs #41399, #49075). The twin keeps V1's behaviour at the default of 1 and, when
   ``max_num_partial_prefills > 1``, enforces both per step as vLLM V0 and #49075 do: a prefill chunk
   beyond either limit is skipped this step (running) or left waiting (waiting).

4. **Background prefills bounded per step** (a twin extension: vLLM has no such knob; backfill's
   vLLM plugin, ``vllm_plugin/`` ``backfill_vllm.scheduler.BackfillScheduler``, carries it). With
   ``--background-priority-threshold`` set, a request whose ``priority`` is at least the threshold is
   *background* (the router sends vLLM priority −100 for interactive, −10 for async and 10 for
   batch work; the fleet's launchers set the threshold to −10, ``engine_twin/launch.py``). Only
   under ``--scheduling-policy priority``: under FCFS the priority field is ignored, as in vLLM. Its prefill chunks (any chunk of a request with more than one token
   left to compute; decode tokens are never limited) share at most
   ``--max-background-prefill-tokens`` of the step's budget, all background requests together, and
   get **none** in a step that starts while a foreground prefill is pending: a foreground request
   at the head of the waiting queue (under the priority policy the head is foreground whenever any
   foreground request waits) or a running foreground request with more than one token left. A
   background chunk past the share is skipped this step (running) or left waiting (waiting; the
   rest of the queue is background too). So a step never carries more than the share of batch
   prefill beside an interactive request's prefill, and an interactive request that arrives during
   a step waits at most one step of ``fixed + share × 32 µs`` (default step model) for its own.

5. **Prefill/decode disaggregation** (vLLM's NixlConnector, ``vllm/distributed/kv_transfer/
   kv_connector/v1/nixl/scheduler.py`` and the scheduler's ``WAITING_FOR_REMOTE_KVS`` handling). A
   request added by :meth:`~EngineCore.add_remote` (``do_remote_prefill``), on reaching the head of
   the waiting pass, takes its local GPU prefix hits and blocks for the rest of the prompt (or stops
   the pass when they do not fit), enters ``WAITING_FOR_REMOTE_KVS`` (not scheduled, not counted
   against ``max_num_seqs``, counted as waiting) and is reported as a :class:`KVLoad` (blocks to
   read, bytes = blocks × block size × KV bytes per token, model seconds over
   ``--kv-transfer-bandwidth``). :meth:`~EngineCore.kv_arrived` makes every prompt token but the
   last computed and the full blocks cached (``BlockStored``), and puts it back at the head of the
   queue; its next schedule computes the last prompt token and samples its first output token, so
   ``num_cached_tokens`` is prompt − 1. :meth:`~EngineCore.kv_load_failed` frees its blocks and
   requeues it for a local prefill (``kv_load_failure_policy: recompute``) or fails it (``fail``,
   vLLM's default). A request with ``remote_decode`` (``do_remote_decode``, ended length-capped)
   keeps its blocks after finishing in :attr:`~EngineCore.held` until
   :meth:`~EngineCore.release_held` (the decode engine's notification) or
   :meth:`~EngineCore.expire_held` past ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``; the time of every call
   is the caller's clock (wall for the HTTP server, virtual for a simulation).

After the schedule, every scheduled request's computed tokens advance; one that has computed all its
tokens samples one (its first token when it had none); one with ``max_tokens`` tokens finishes and
frees its blocks. Full blocks of prompt tokens are cached as they are computed (``BlockStored``);
blocks of generated tokens are not (vLLM caches those too; the twin's filler output is never
reused). ``n > 1`` is ``n`` requests here, as vLLM's front end fans a request out.

A request whose ``prompt + max_tokens`` needs more blocks than the whole GPU cache is refused by
:meth:`~EngineCore.add` (``ValueError``), so every request admitted can complete: under pressure the
preempted ones run again once the others finish.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from engine_twin.kv_cache import DEFAULT_RETENTION, Block, Hits, TieredPrefixCache
from engine_twin.settings import EngineSimSettings
from engine_twin.step_model import StepModel, StepWork


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    """vLLM's state of a decode-side request whose prompt KV is being read from a prefill engine."""
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"
    """The KV load failed under ``kv_load_failure_policy: fail`` (vLLM's ``FINISHED_ERROR``)."""


@dataclass(eq=False, slots=True)
class CoreRequest:
    """One sequence in the core. ``prompt`` are token ids, ``hashes`` its full blocks' chained hashes.

    ``priority``: vLLM's (lower runs first under the priority policy). ``retention``: KV retention of
    the blocks it computes (0 … 100, :mod:`engine_twin.kv_cache`). State fields are the core's.
    """

    request_id: str
    prompt: list[int]
    max_tokens: int
    hashes: list[bytes]
    priority: int = 0
    retention: int = DEFAULT_RETENTION
    arrival: float = 0.0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    output_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens found cached (any tier) at the first schedule, as vLLM's ``num_cached_tokens``."""
    num_preemptions: int = 0
    first_scheduled_at: float | None = None
    blocks: list[Block] = field(default_factory=list)
    committed: int = 0  # leading blocks of ``blocks`` that are cached
    seq: int = 0
    remote_prefill: bool = False
    """Decode side of P/D: the prompt's KV comes from a prefill engine (:meth:`EngineCore.add_remote`)."""
    remote_decode: bool = False
    """Prefill side of P/D: once finished, the blocks stay held for a decode engine to read."""
    held_until: float | None = None
    """Prefill side: when the held blocks are freed unread (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``)."""
    block_ids: list[int] = field(default_factory=list)
    """Prefill side: the ids of the held blocks (``remote_block_ids``; the twin numbers blocks itself)."""

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (what a recompute must compute again)."""
        return len(self.prompt) + self.output_tokens

    @property
    def finished(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED, Status.FAILED)


@dataclass(frozen=True, slots=True)
class KVLoad:
    """A decode-side request that started reading its prompt's KV from a prefill engine this step.

    ``tokens``: prompt tokens it did not have cached locally (vLLM's ``num_external_computed_tokens``);
    ``blocks``: the blocks read for them (whole blocks, as NIXL reads); ``bytes`` = blocks × block
    size × KV bytes per token; ``seconds``: model seconds over ``--kv-transfer-bandwidth``. The driver
    calls :meth:`EngineCore.kv_arrived` that long after the step's start (or
    :meth:`EngineCore.kv_load_failed`)."""

    request_id: str
    tokens: int
    blocks: int
    bytes: int
    seconds: float


@dataclass(slots=True)
class StepOutcome:
    """What one step did. ``duration`` in model seconds (0: nothing was scheduled)."""

    duration: float
    scheduled: dict[str, int]
    """Tokens computed per request id this step (prefill chunk or 1 decode token)."""
    sampled: list[str]
    """Requests that produced one output token at the end of this step (first tokens included)."""
    first_scheduled: list[str]
    """Requests scheduled for the first time (their queue time ends at the step's start)."""
    finished: list[str]
    preempted: list[str]
    work: StepWork
    kv_loads: list[KVLoad] = field(default_factory=list)
    """Decode-side requests that began waiting for remote KV this step (P/D, :class:`KVLoad`)."""


@dataclass(slots=True)
class _StepPlan:
    """The scratch state of one step while :meth:`EngineCore.step` schedules and runs it: the token
    ``budget`` and background share left, what was scheduled (tokens per request, in order),
    preempted, first scheduled and started loading, and what the run did."""

    budget: int
    bg_left: int
    scheduled: dict[CoreRequest, int] = field(default_factory=dict)
    preempted: list[CoreRequest] = field(default_factory=list)
    first: list[str] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    loads_cpu: int = 0
    loads_disk: int = 0
    tokens: int = 0
    pairs: int = 0
    context: int = 0
    sampled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    def take(self, req: CoreRequest, n: int, background: bool) -> None:
        """Schedule ``n`` tokens of ``req`` (a background prefill chunk when ``background``)."""
        self.scheduled[req] = n
        self.budget -= n
        if background:
            self.bg_left -= n


_DECODE = (1, False)
"""The chunk of a running request with one token left: a decode token, never a background prefill."""


class _WaitingQueue:
    """vLLM's request queues: FCFS (a deque, preempted requests go to the front) or a heap on
    ``(priority, arrival, seq)``. Aborted requests are dropped lazily when they reach the head."""

    def __init__(self, priority: bool):
        self.priority = priority
        self._fifo: deque[CoreRequest] = deque()
        self._heap: list[tuple[int, float, int, CoreRequest]] = []
        self.live = 0

    def __len__(self) -> int:
        return self.live

    def add(self, req: CoreRequest) -> None:
        if self.priority:
            heapq.heappush(self._heap, (req.priority, req.arrival, req.seq, req))
        else:
            self._fifo.append(req)
        self.live += 1

    def prepend(self, req: CoreRequest) -> None:
        if self.priority:
            self.add(req)
        else:
            self._fifo.appendleft(req)
            self.live += 1

    def peek(self) -> CoreRequest | None:
        if self.priority:
            while self._heap and self._heap[0][3].finished:
                heapq.heappop(self._heap)
            return self._heap[0][3] if self._heap else None
        while self._fifo and self._fifo[0].finished:
            self._fifo.popleft()
        return self._fifo[0] if self._fifo else None

    def pop(self) -> CoreRequest:
        """Remove the head (call :meth:`peek` first)."""
        self.live -= 1
        if self.priority:
            return heapq.heappop(self._heap)[3]
        return self._fifo.popleft()

    def discard(self) -> None:
        """One queued request was aborted (it stays in place until it reaches the head)."""
        self.live -= 1


class EngineCore:
    """Waiting and running requests, the prefix cache and the step loop of one engine (module doc)."""

    def __init__(self, settings: EngineSimSettings, cache: TieredPrefixCache):
        self.settings = settings
        self.cache = cache
        self.model = StepModel.from_settings(settings)
        self.block_size = settings.block_size
        self.policy_priority = settings.scheduling_policy == "priority"
        self.waiting = _WaitingQueue(self.policy_priority)
        self.running: list[CoreRequest] = []
        self.requests: dict[str, CoreRequest] = {}
        self.num_preemptions = 0
        self.steps = 0
        self._seq = itertools.count()
        self.transferring: dict[str, CoreRequest] = {}
        """Decode side: requests in ``WAITING_FOR_REMOTE_KVS`` (blocks allocated, not scheduled)."""
        self.held: dict[str, CoreRequest] = {}
        """Prefill side: finished requests whose blocks wait for a decode engine's read."""
        self._block_ids = itertools.count()
        cfg = settings.kv_transfer_config
        self._recompute_failed_loads = cfg is not None and cfg.kv_load_failure_policy == "recompute"
        threshold = settings.long_prefill_token_threshold
        self._threshold = threshold
        self._limit_partials = settings.max_num_partial_prefills > 1
        # FCFS zeroes every priority (as vLLM ignores it), so background needs the priority policy
        self._background = settings.background_priority_threshold if self.policy_priority else None

    # ---- views -----------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """vLLM's ``num_requests_running``: requests in the running list."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """vLLM's ``num_requests_waiting``: requests queued (new, preempted or waiting for remote KV,
        which vLLM keeps in its waiting queue)."""
        return len(self.waiting) + len(self.transferring)

    @property
    def held_blocks(self) -> int:
        """Prefill side: blocks held for decode engines to read."""
        return sum(len(r.blocks) for r in self.held.values())

    def has_work(self) -> bool:
        """True while a step would schedule something (or could, once blocks free up)."""
        return bool(self.running) or bool(self.waiting)

    # ---- requests --------------------------------------------------------------------------
    def add(self, req: CoreRequest, now: float) -> None:
        """Queue ``req`` (arrival ``now``). Raises ValueError when it can never fit in the GPU cache or
        its id is in use."""
        bs = self.block_size
        needed = -(-(len(req.prompt) + req.max_tokens) // bs)
        if needed > self.cache.num_gpu_blocks:
            raise ValueError(f"the request needs {needed} KV cache blocks for {len(req.prompt)} prompt tokens + "
                             f"{req.max_tokens} output tokens; the cache has {self.cache.num_gpu_blocks}")
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        req.arrival = now
        req.seq = next(self._seq)
        req.status = Status.WAITING
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def add_remote(self, req: CoreRequest, now: float) -> None:
        """Queue a decode-side P/D request (vLLM NixlConnector's ``do_remote_prefill``): when the
        scheduler reaches it, it allocates blocks for the whole prompt (local prefix hits on the GPU
        first), enters ``WAITING_FOR_REMOTE_KVS`` (not scheduled, counted as waiting) and is reported
        in :attr:`StepOutcome.kv_loads`; :meth:`kv_arrived` then makes the blocks computed and cached.
        Raises ValueError as :meth:`add`."""
        req.remote_prefill = True
        self.add(req, now)

    def kv_arrived(self, request_id: str, now: float) -> bool:
        """The remote KV of ``request_id`` has been read: as vLLM's ``_update_waiting_for_remote_kv``
        its blocks count as computed (every prompt token but the last, which the next step computes
        to sample the first token), the full ones are cached (``BlockStored`` with the next step's
        events) and the request waits at the head of the queue. False when it is not loading."""
        req = self.transferring.pop(request_id, None)
        if req is None:
            return False
        bs = self.block_size
        total = req.num_tokens
        computed = min(len(req.blocks) * bs, total)
        if computed == total:
            computed -= 1
        full = min(computed // bs, len(req.hashes))
        if full > req.committed:
            self.cache.commit(req.blocks, req.committed, full, req.hashes, req.prompt, req.retention)
            req.committed = full
        req.num_computed_tokens = computed
        req.remote_prefill = False  # one transfer per request, as vLLM
        req.status = Status.WAITING
        self.waiting.prepend(req)
        return True

    def kv_load_failed(self, request_id: str, now: float) -> Status | None:
        """The remote KV of ``request_id`` could not be read (prefill engine unreachable, handshake
        refused). Under ``kv_load_failure_policy: recompute`` its blocks are freed and it queues again
        at the head to compute the prompt locally (returns ``Status.WAITING``); under ``fail`` (vLLM's
        default) it leaves the engine (returns ``Status.FAILED``). None when it is not loading."""
        req = self.transferring.pop(request_id, None)
        if req is None:
            return None
        self.cache.free(req.blocks)
        req.committed = 0
        req.num_computed_tokens = 0
        req.remote_prefill = False
        if self._recompute_failed_loads:
            req.status = Status.WAITING
            self.waiting.prepend(req)
            return Status.WAITING
        req.status = Status.FAILED
        self.requests.pop(request_id, None)
        return Status.FAILED

    def release_held(self, request_id: str) -> bool:
        """Prefill side: a decode engine has read ``request_id``'s blocks (NIXL's notification): free
        them (cached ones stay evictable). False when they are not held (expired or unknown)."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.cache.free(req.blocks)
        return True

    def expire_held(self, now: float) -> list[str]:
        """Prefill side: free the held blocks whose ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` has passed at
        ``now`` (vLLM: "Releasing expired KV blocks"); returns their request ids."""
        gone = [rid for rid, r in self.held.items() if r.held_until is not None and r.held_until <= now]
        for rid in gone:
            self.release_held(rid)
        return gone

    def next_expiry(self) -> float | None:
        """The earliest deadline of the held blocks (None when nothing is held)."""
        return min((r.held_until for r in self.held.values() if r.held_until is not None), default=None)

    def abort(self, request_id: str) -> CoreRequest | None:
        """Drop a waiting, loading or running request and free its blocks; None when it is not here."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status == Status.RUNNING:
            self.running.remove(req)
            self.cache.free(req.blocks)
        elif req.status == Status.WAITING_FOR_REMOTE_KVS:
            del self.transferring[request_id]
            self.cache.free(req.blocks)
        else:
            self.waiting.discard()
            if req.blocks:  # its remote KV had arrived
                self.cache.free(req.blocks)
        req.status = Status.ABORTED
        return req

    # ---- the step ----------------------------------------------------------------------------
    def step(self, now: float) -> StepOutcome:
        """Schedule and run one step starting at ``now`` (module docstring); flushes KV events.

        The phases, as vLLM V1's ``Scheduler.schedule`` and ``update_from_output``: the background
        share (item 4), the running requests (item 1, with preemption), the waiting requests (item 2,
        only when nobody was preempted), then the model "runs" the step and finished requests leave."""
        cache = self.cache
        stores_before = (cache.stats.cpu_stores, cache.stats.disk_stores)
        plan = _StepPlan(self.settings.max_num_batched_tokens, self._background_share())
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan, now)
        self._execute(plan)
        if plan.finished:
            self._free_finished(plan.finished, now)
        cache.flush()
        work = StepWork(plan.tokens, plan.pairs, plan.context, plan.loads_cpu, plan.loads_disk,
                        cache.stats.cpu_stores - stores_before[0], cache.stats.disk_stores - stores_before[1])
        if plan.scheduled:
            self.steps += 1
        return StepOutcome(self.model.seconds(work), {r.request_id: n for r, n in plan.scheduled.items()},
                           plan.sampled, plan.first, plan.finished, [r.request_id for r in plan.preempted], work,
                           plan.kv_loads)

    def _background_share(self) -> int:
        """Background prefill tokens this step may carry (item 4 of the module doc): the whole budget
        without ``--background-priority-threshold``; none while a foreground prefill is pending (the
        head of the waiting queue, or a running request with more than one token left); otherwise
        ``--max-background-prefill-tokens``."""
        background = self._background
        if background is None:
            return self.settings.max_num_batched_tokens
        head = self.waiting.peek()
        pending = (head is not None and head.priority < background) or any(
            r.priority < background and r.num_tokens - r.num_computed_tokens > 1 for r in self.running)
        return 0 if pending else self.settings.max_background_prefill_tokens

    def _chunk(self, left: int, budget: int) -> int:
        """vLLM's chunked prefill: ``left`` tokens capped by ``--long-prefill-token-threshold`` (when
        > 0) and by the step's remaining token ``budget``."""
        if 0 < self._threshold < left:
            left = self._threshold
        return min(left, budget)

    def _schedule_running(self, plan: _StepPlan) -> None:
        """vLLM's running pass (item 1): each running request in order gets its next chunk or decode
        token; when its blocks do not fit, requests are preempted (:meth:`_preempt_until_fits`) and
        the pass stops when the request itself had to go."""
        running, cache, bs, scheduled = self.running, self.cache, self.block_size, plan.scheduled
        i = 0
        while i < len(running) and plan.budget > 0:
            req = running[i]
            decode = req.num_tokens - req.num_computed_tokens == 1
            chunk = _DECODE if decode else self._running_chunk(req, plan)
            if chunk is None:
                i += 1
                continue
            n, background = chunk
            need = -(-(req.num_computed_tokens + n) // bs) - len(req.blocks)
            if need > 0 and not cache.grow(req.blocks, need):
                fits, shift = self._preempt_until_fits(req, need, plan)
                if not fits:
                    break
                i -= shift
            scheduled[req] = n  # plan.take, inlined: the hot loop
            plan.budget -= n
            if background:
                plan.bg_left -= n
            i += 1

    def _running_chunk(self, req: CoreRequest, plan: _StepPlan) -> tuple[int, bool] | None:
        """The tokens running ``req`` gets this step and whether they are a background prefill chunk;
        None when it is skipped this step (background share spent, partial-prefill limits reached)."""
        n = self._chunk(req.num_tokens - req.num_computed_tokens, plan.budget)
        background = self._background is not None and n > 1 and req.priority >= self._background
        if background:
            if plan.bg_left <= 0:
                return None
            n = min(n, plan.bg_left)
        if self._limit_partials and n > 1 and not self._partial_allowed(req, plan.scheduled):
            return None
        return n, background

    def _preempt_until_fits(self, req: CoreRequest, need: int, plan: _StepPlan) -> tuple[bool, int]:
        """Preempt by recompute until ``need`` more blocks for running ``req`` fit (vLLM's
        ``allocate_slots`` retry loop): under the priority policy the running request with the
        largest ``(priority, arrival)`` (a request already scheduled this step gives its tokens back
        to the budget), under FCFS the last of the running list. Returns whether ``req`` got its
        blocks (False: it was preempted itself) and how many requests scheduled before it left the
        running list (the pass's index moves back by as many)."""
        shift = 0
        running = self.running
        while True:
            if self.policy_priority:
                victim = max(running, key=lambda r: (r.priority, r.arrival, r.seq))
                running.remove(victim)
                if victim in plan.scheduled:
                    plan.budget += plan.scheduled.pop(victim)
                    shift += 1
            else:
                victim = running.pop()
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return False, shift
            if self.cache.grow(req.blocks, need):
                return True, shift

    def _schedule_waiting(self, plan: _StepPlan, now: float) -> None:
        """vLLM's waiting pass (item 2): the queue's head, while ``--max-num-seqs`` and the budget
        allow. A P/D decode-side head starts its KV load (item 5); a head past the partial-prefill
        limits is set aside for this step (item 3); the first head that cannot be scheduled stops the
        pass (head-of-line, as vLLM)."""
        skipped: list[CoreRequest] = []
        limit = self.settings.max_num_seqs
        while plan.budget > 0 and len(self.running) < limit:
            req = self.waiting.peek()
            if req is None:
                break
            if req.remote_prefill:
                load = self._start_remote_load(req)
                if load is None:
                    break
                plan.kv_loads.append(load)
                continue
            if self._limit_partials and not self._partial_allowed(req, plan.scheduled):
                skipped.append(self.waiting.pop())
                continue
            scheduled = self._resume_loaded(req, plan, now) if req.blocks else self._admit(req, plan, now)
            if not scheduled:
                break
        for req in reversed(skipped):
            self.waiting.prepend(req)

    def _resume_loaded(self, req: CoreRequest, plan: _StepPlan, now: float) -> bool:
        """Schedule a waiting head whose remote KV arrived (P/D decode side): its blocks are there and
        computed; it gets the rest of its tokens under the budget. False when the blocks for them do
        not fit."""
        cached = req.num_computed_tokens
        n = min(req.num_tokens - cached, plan.budget)
        need = -(-(cached + n) // self.block_size) - len(req.blocks)
        if need > 0 and not self.cache.grow(req.blocks, need):
            return False
        self._start_running(req, cached, n, False, plan, now)
        return True

    def _admit(self, req: CoreRequest, plan: _StepPlan, now: float) -> bool:
        """Schedule a waiting head: look its prompt up in the prefix cache (GPU, then CPU/disk tiers, at
        most ``num_tokens − 1`` tokens), chunk the rest and allocate its blocks (vLLM's
        ``get_computed_blocks`` + ``allocate_slots``). False when the background share is spent or the
        blocks do not fit."""
        cache, bs = self.cache, self.block_size
        total = req.num_tokens
        hits = cache.find_hits(req.hashes, (total - 1) // bs)
        cached = hits.blocks * bs
        n = self._chunk(total - cached, plan.budget)
        background = self._background is not None and req.priority >= self._background
        if background:
            if plan.bg_left <= 0:
                return False
            n = min(n, plan.bg_left)
        table = cache.admit(req.hashes, hits, -(-(cached + n) // bs) - hits.blocks, req.prompt, req.retention)
        if table is None:
            return False
        req.blocks = table
        req.committed = hits.blocks
        req.num_computed_tokens = cached
        if req.num_cached_tokens < 0:
            cache.record_query(total, hits.gpu, hits.cpu + hits.disk)
        plan.loads_cpu += hits.cpu
        plan.loads_disk += hits.disk
        self._start_running(req, cached, n, background, plan, now)
        return True

    def _start_running(self, req: CoreRequest, cached: int, n: int, background: bool, plan: _StepPlan,
                       now: float) -> None:
        """Move the waiting head to the running list with ``n`` tokens this step; its first schedule
        records ``num_cached_tokens`` and the step's start as the end of its queue time."""
        self.waiting.pop()
        req.status = Status.RUNNING
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = cached
        if req.first_scheduled_at is None:
            req.first_scheduled_at = now
            plan.first.append(req.request_id)
        self.running.append(req)
        plan.take(req, n, background)

    def _execute(self, plan: _StepPlan) -> None:
        """The model "runs" the step (vLLM's ``update_from_output``): every scheduled request's computed
        tokens advance, its full prompt blocks are cached, one that computed all its tokens samples one
        and one with ``max_tokens`` tokens finishes. Fills the plan's work counts, ``sampled`` and
        ``finished``."""
        cache, bs = self.cache, self.block_size
        tokens = pairs = context = 0
        sampled, finished = plan.sampled, plan.finished
        for req, n in plan.scheduled.items():
            c = req.num_computed_tokens
            tokens += n
            pairs += n * c + n * (n + 1) // 2  # chunk_pairs(c, n), inlined: the hot loop
            context += c
            c += n
            req.num_computed_tokens = c
            full = min(c // bs, len(req.hashes))
            if full > req.committed:
                cache.commit(req.blocks, req.committed, full, req.hashes, req.prompt, req.retention)
                req.committed = full
            if c == req.num_tokens:
                req.output_tokens += 1
                sampled.append(req.request_id)
                if req.output_tokens >= req.max_tokens:
                    req.status = Status.FINISHED
                    finished.append(req.request_id)
        plan.tokens, plan.pairs, plan.context = tokens, pairs, context

    def _free_finished(self, finished: list[str], now: float) -> None:
        """Finished requests leave: their blocks are freed, or held for a decode engine's read until
        ``now`` + ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` (P/D prefill side, NixlConnector's
        ``request_finished`` delaying the free)."""
        timeout = self.settings.nixl_abort_request_timeout_s
        for rid in finished:
            req = self.requests.pop(rid)
            if req.remote_decode and req.blocks:
                n = self.cache.num_gpu_blocks
                req.block_ids = [next(self._block_ids) % n for _ in req.blocks]
                req.held_until = now + timeout
                self.held[rid] = req
            else:
                self.cache.free(req.blocks)
        self.running = [r for r in self.running if r.status == Status.RUNNING]

    # ---- internals -------------------------------------------------------------------------
    def _start_remote_load(self, req: CoreRequest) -> KVLoad | None:
        """Allocate the head request's prompt blocks (GPU prefix hits pinned, the rest new) and put it
        in ``WAITING_FOR_REMOTE_KVS``; None, changing nothing, when the blocks do not fit (the waiting
        pass stops there, head-of-line, as vLLM's ``allocate_slots`` failing)."""
        cache, bs = self.cache, self.block_size
        total = len(req.prompt)
        hits = cache.find_hits(req.hashes, (total - 1) // bs)
        local = Hits(gpu=hits.gpu)  # NixlConnector alone: the local prefix cache is the GPU's
        new_blocks = -(-total // bs) - local.gpu
        table = cache.admit(req.hashes, local, new_blocks, req.prompt, req.retention)
        if table is None:
            return None
        self.waiting.pop()
        cached = local.gpu * bs
        req.blocks = table
        req.committed = local.gpu
        req.num_computed_tokens = cached
        req.status = Status.WAITING_FOR_REMOTE_KVS
        self.transferring[req.request_id] = req
        cache.record_query(req.num_tokens, local.gpu, 0)
        cache.stats.connector_queries_tokens += req.num_tokens - cached
        cache.stats.connector_hits_tokens += total - cached
        model = self.model
        return KVLoad(req.request_id, total - cached, new_blocks,
                      int(new_blocks * bs * model.kv_bytes_per_token), model.kv_transfer_seconds(new_blocks))

    def _preempt(self, req: CoreRequest) -> None:
        """Recompute preemption: free the blocks, restart from 0, back to the front of waiting."""
        self.cache.free(req.blocks)
        req.committed = 0
        req.num_computed_tokens = 0
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    def _partial_allowed(self, req: CoreRequest, scheduled: dict[CoreRequest, int]) -> bool:
        """Whether one more prefill chunk (``req``'s) fits the partial-prefill limits of this step."""
        s = self.settings
        partial = long = 0
        for other, n in scheduled.items():
            if n > 1:
                partial += 1
                if len(other.prompt) > self._threshold:
                    long += 1
        if partial >= s.max_num_partial_prefills:
            return False
        return not (len(req.prompt) > self._threshold and long >= s.max_long_partial_prefills)
