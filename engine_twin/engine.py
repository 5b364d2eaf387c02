"""One simulated engine: tokenizer, tiered prefix cache, KV event publisher, the pure core, metrics
and faults wired together, and the real-time driver of the core. Built, started and closed by the
app's lifespan (``server.create_app``).

The driver is one asyncio task: while the core has work it runs a step, sleeps the step's duration ×
``time_scale`` and then delivers the step's tokens to the request handlers (each waits on an event of
its request). Step ends are kept on a schedule measured against the monotonic clock: the next step
starts at the previous one's scheduled end, not at the moment the sleep returned, so timer overshoot
does not add up (after a lag over :data:`MAX_LAG_S` the schedule restarts from now). At
``time_scale`` 0 it never sleeps and yields to the event loop once per step. With nothing to do it
waits for the next request. A handler whose client goes away aborts its requests in the core.

Prefill/decode disaggregation (``--kv-transfer-config`` with NixlConnector, :mod:`engine_twin.pd`):
a request whose ``kv_transfer_params`` say ``do_remote_decode`` keeps its blocks held when it ends
length-capped, its answer carrying :func:`~engine_twin.pd.prefill_params`; the held blocks go on
the side channel's notification or after ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` (a timer). A request
with ``do_remote_prefill`` enters the core by :meth:`EngineCore.add_remote`; for each
:class:`~engine_twin.core.KVLoad` a task does the handshake with the prefill twin, sleeps the
modeled transfer × ``time_scale``, sends the notification and calls ``kv_arrived`` (or
``kv_load_failed`` when the prefill twin cannot be reached: the request then recomputes, or fails
with 500 as vLLM's ``GenerationError``, per ``kv_load_failure_policy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine_twin.core import CoreRequest, EngineCore, KVLoad, Status, StepOutcome
from engine_twin.errors import BadRequestError, EngineSimError
from engine_twin.faults import FaultState
from engine_twin.kv_cache import TieredPrefixCache, block_hashes, none_hash
from engine_twin.kv_events import KVEventPublisher
from engine_twin.metrics import EngineMetrics
from engine_twin.pd import (
    META_PATH,
    NOTIF_PATH,
    SIDE_CHANNEL_TIMEOUT_S,
    RemotePrefill,
    SideChannel,
    prefill_params,
    remote_prefill_of,
)
from engine_twin.protocol import GenerationSpec
from engine_twin.retention import request_retention
from engine_twin.settings import EngineSimSettings
from engine_twin.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

MAX_LAG_S = 0.25
"""Wall seconds the driver may run behind its step schedule before restarting it from now."""


@dataclass
class Outcome:
    """A finished prompt: its token count, cached tokens and generated tokens per sequence."""

    prompt_tokens: int
    cached_tokens: int
    generated: int
    kv_transfer_params: dict[str, Any] | None = None
    """Prefill side of P/D: what the answer carries for the decode engine (:func:`prefill_params`)."""


@dataclass(eq=False)
class RequestGroup:
    """The ``n`` core requests of one prompt, as one handler sees them (wall-clock times)."""

    children: list[CoreRequest]
    arrival: float
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    delivered: list[int] = field(default_factory=list)
    """Tokens delivered per child (the core may be ahead: it runs a step before it is slept)."""
    token_times: list[float] = field(default_factory=list)
    """Delivery times of the first child's tokens."""
    done: int = 0
    want: int = 1
    """Tokens per child the handler waits for; ``changed`` is set once they are all there."""
    error: EngineSimError | None = None
    """Set when a child failed (its KV load, under ``kv_load_failure_policy: fail``)."""

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from cache at the first schedule (any tier; 0 before it)."""
        return max(self.children[0].num_cached_tokens, 0)

    @property
    def generated(self) -> int:
        """Tokens every child has delivered."""
        return min(self.delivered)


class SimEngine:
    """Owns every part of one simulated engine. Not thread-safe: use from the event loop."""

    def __init__(self, settings: EngineSimSettings):
        self.settings = settings
        self.tokenizer = load_tokenizer(settings.tokenizer)
        cfg = settings.kv_events_config
        self.publisher = (KVEventPublisher(cfg, settings.kv_events_layout, settings.data_parallel_rank)
                          if cfg.active else None)
        self.cache = TieredPrefixCache(settings.num_gpu_blocks, settings.block_size, settings.cpu_offload_blocks,
                                       settings.disk_offload_blocks,
                                       sink=self.publisher.publish if self.publisher else None)
        self.core = EngineCore(settings, self.cache)
        self.metrics = EngineMetrics(settings)
        self.metrics.attach(self.core)
        self.root_hash = none_hash(settings.hash_seed)
        self.faults = FaultState(settings.failure_rate, settings.seed)
        text, ids = self.tokenizer.filler(64)
        self._filler_pieces = [self.tokenizer.decode([i]) for i in ids]
        self._groups: dict[str, tuple[RequestGroup, int]] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        transfer = settings.kv_transfer_config
        self.engine_id = transfer.engine_id if transfer is not None and transfer.engine_id else ""
        self.side_channel = SideChannel(self._side_channel_meta, self._notified) if settings.nixl else None
        self._remote: dict[str, RemotePrefill] = {}
        self._agents: dict[str, dict[str, Any]] = {}  # remote engine id -> its handshake answer
        self._transfers: set[asyncio.Task[None]] = set()
        self._http: httpx.AsyncClient | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the driver task on the running loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drive(), name="engine-twin-driver")

    async def start_side_channel(self) -> None:
        """Serve the NIXL side channel (prefill/decode) when NixlConnector is on; raises RuntimeError
        when its port is taken."""
        if self.side_channel is not None:
            await self.side_channel.start(self.settings.nixl_side_channel_host, self.settings.side_channel_port)

    async def aclose(self) -> None:
        """Stop the driver, the KV transfers, the side channel and the KV event publisher."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task in list(self._transfers):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self.side_channel is not None:
            await self.side_channel.aclose()
        self.close()

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    # ---- text ------------------------------------------------------------------------------
    def pieces(self, n: int) -> list[str]:
        """Text of each of ``n`` generated filler tokens (deterministic)."""
        unit = self._filler_pieces
        return (unit * (n // len(unit) + 1))[:n]

    def piece(self, index: int) -> str:
        """Text of generated token number ``index`` (1-based), the last of ``pieces(index)``."""
        unit = self._filler_pieces
        return unit[(index - 1) % len(unit)]

    # ---- requests --------------------------------------------------------------------------
    def retention_of(self, spec: GenerationSpec) -> int:
        """The KV retention of a request (:func:`engine_twin.retention.request_retention`): its
        ``kv_retention_priority``, else the lowest (0) when its vLLM ``priority`` reaches
        ``--retention-priority-threshold``, else the default."""
        return request_retention(spec.priority, self.settings.retention_priority_threshold, spec.retention)

    def submit(self, prompt: list[int], spec: GenerationSpec) -> RequestGroup:
        """Queue ``spec.n`` core requests for ``prompt``; raises BadRequestError when they can never fit."""
        self.start()
        hashes = block_hashes(prompt, self.settings.block_size, self.root_hash)
        base = f"req-{next(self._ids)}"
        retention = self.retention_of(spec)
        children = [CoreRequest(f"{base}-{k}", prompt, spec.max_tokens, hashes, spec.priority, retention)
                    for k in range(spec.n)]
        remote = None
        params = spec.kv_transfer_params
        if self.settings.nixl and params and spec.n == 1 and len(spec.prompts) == 1:
            remote = remote_prefill_of(params)
            # NixlConnector.request_finished: only a length-capped request keeps its blocks for a reader
            children[0].remote_decode = bool(params.get("do_remote_decode")) and spec.finish_reason == "length"
        now = time.monotonic()
        group = RequestGroup(children, now, delivered=[0] * spec.n)
        for k, child in enumerate(children):
            try:
                if remote is not None:
                    self.core.add_remote(child, now)
                    self._remote[child.request_id] = remote
                else:
                    self.core.add(child, now)
            except ValueError as exc:
                for added in children[:k]:
                    self.core.abort(added.request_id)
                    self._groups.pop(added.request_id, None)
                raise BadRequestError(str(exc), "messages") from None
            self._groups[child.request_id] = (group, k)
        self._wake.set()
        return group

    def finish(self, group: RequestGroup, reason: str) -> None:
        """Leave the engine: done, or aborted (client disconnect) with every unfinished child removed."""
        complete = group.done == len(group.children)
        for child in group.children:
            self._remote.pop(child.request_id, None)
            if self._groups.pop(child.request_id, None) is not None:
                self.core.abort(child.request_id)
        prompt = len(group.children[0].prompt)
        gaps = [b - a for a, b in zip(group.token_times, group.token_times[1:])]
        reason = "error" if group.error is not None else reason if complete else "abort"
        self.metrics.finished(prompt, sum(group.delivered), gaps, reason, time.monotonic() - group.arrival)

    def transfer_params(self, group: RequestGroup) -> dict[str, Any] | None:
        """Prefill side: the ``kv_transfer_params`` of a finished group whose blocks are held."""
        held = self.core.held.get(group.children[0].request_id)
        if held is None:
            return None
        s = self.settings
        return prefill_params(self.engine_id, held.request_id, held.block_ids, s.nixl_side_channel_host,
                              s.side_channel_port)

    async def _wait(self, group: RequestGroup, tokens: int) -> None:
        """Return once every child has delivered ``tokens`` tokens."""
        group.want = tokens
        while group.generated < tokens:
            if group.error is not None:
                raise group.error
            group.changed.clear()
            await group.changed.wait()

    async def run(self, spec: GenerationSpec) -> list[Outcome]:
        """Run every prompt of ``spec`` to completion (concurrently) and report each."""
        groups = []
        try:
            for prompt in spec.prompts:
                groups.append(self.submit(prompt, spec))
            for group in groups:
                await self._wait(group, spec.max_tokens)
        finally:
            for group in groups:
                self.finish(group, spec.finish_reason)
        return [Outcome(len(g.children[0].prompt), g.cached_tokens, g.generated, self.transfer_params(g))
                for g in groups]

    async def stream(self, spec: GenerationSpec) -> AsyncIterator[tuple[RequestGroup, int]]:
        """Yield ``(group, tokens so far)`` after the first token and after each later one.

        Closing the iterator early (client disconnect) aborts the request and frees its blocks.
        """
        group = self.submit(spec.prompts[0], spec)
        try:
            seen = 0
            while seen < spec.max_tokens:
                await self._wait(group, seen + 1)
                while seen < group.generated:
                    seen += 1
                    yield group, seen
        finally:
            self.finish(group, spec.finish_reason)

    # ---- the driver --------------------------------------------------------------------------
    async def _drive(self) -> None:
        core, scale = self.core, self.settings.time_scale
        clock = time.monotonic
        start = clock()
        while True:
            if not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                start = clock()
                continue
            outcome = core.step(start)
            for load in outcome.kv_loads:
                self._start_transfer(load)
            if not outcome.scheduled:  # nothing can run until a request arrives or leaves
                self._wake.clear()
                await self._wake.wait()
                start = clock()
                continue
            if scale > 0:
                end = start + outcome.duration * scale
                delay = end - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                now = clock()
                self._deliver(outcome, start, now)
                start = end if now - end < MAX_LAG_S else now
            else:
                now = clock()
                self._deliver(outcome, start, now)
                await asyncio.sleep(0)
                start = clock()

    def _deliver(self, outcome: StepOutcome, started: float, now: float) -> None:
        groups = self._groups
        for rid in outcome.first_scheduled:
            entry = groups.get(rid)
            if entry is not None:
                self.metrics.queue_time.observe(max(0.0, started - entry[0].arrival))
        for rid in outcome.sampled:
            entry = groups.get(rid)
            if entry is None:
                continue
            group, k = entry
            delivered = group.delivered
            delivered[k] += 1
            if k == 0:
                if not group.token_times:
                    self.metrics.first_token(now - group.arrival)
                group.token_times.append(now)
            if delivered[k] >= group.want and (len(delivered) == 1 or min(delivered) >= group.want):
                group.changed.set()
        for rid in outcome.finished:
            entry = groups.pop(rid, None)
            if entry is not None:
                entry[0].done += 1
            if rid in self.core.held:
                asyncio.get_running_loop().call_later(self.settings.nixl_abort_request_timeout_s, self._expire)

    # ---- prefill/decode (NixlConnector) ----------------------------------------------------------
    def _expire(self) -> None:
        """Free the held blocks past their deadline; a timer that fired early (the loop's clock is
        coarser than ``time.monotonic``) runs again for the rest."""
        timeout = self.settings.nixl_abort_request_timeout_s
        now = time.monotonic()
        for rid in self.core.expire_held(now):
            logger.warning("Releasing expired KV blocks for request %s which were retrieved by 0 decode worker(s) "
                           "within %g seconds.", rid, timeout)
        deadline = self.core.next_expiry()
        if deadline is not None and deadline - now < timeout:
            asyncio.get_running_loop().call_later(max(deadline - now, 0.001), self._expire)

    def _side_channel_meta(self) -> dict[str, Any]:
        s = self.settings
        return {"engine_id": self.engine_id, "block_size": s.block_size, "num_blocks": s.num_gpu_blocks,
                "kv_bytes_per_token": self.core.model.kv_bytes_per_token, "tp_size": 1,
                "num_hidden_layers": s.num_hidden_layers, "num_key_value_heads": s.num_key_value_heads,
                "head_dim": s.head_dim, "model_dtype_bytes": s.model_dtype_bytes}

    def _notified(self, request_id: str) -> bool:
        return self.core.release_held(request_id)

    def _start_transfer(self, load: KVLoad) -> None:
        remote = self._remote.get(load.request_id)
        if remote is None:  # its handler has gone (aborted) before the read began
            return
        task = asyncio.get_running_loop().create_task(self._transfer(load, remote), name=f"kv-read-{load.request_id}")
        self._transfers.add(task)
        task.add_done_callback(self._transfers.discard)

    async def _handshake(self, client: httpx.AsyncClient, remote: RemotePrefill) -> None:
        """NIXL's handshake, once per remote engine: its metadata, checked as vLLM checks it (engine id;
        the KV layout the compatibility hash covers). Raises RuntimeError or httpx.HTTPError."""
        if remote.engine_id in self._agents:
            return
        meta = (await client.get(remote.url + META_PATH)).raise_for_status().json()
        if meta.get("engine_id") != remote.engine_id:
            raise RuntimeError(f"Remote NIXL agent engine ID mismatch. Expected {remote.engine_id},"
                               f"received {meta.get('engine_id')}.")
        if meta.get("kv_bytes_per_token") != self.core.model.kv_bytes_per_token:
            raise RuntimeError("NIXL compatibility hash mismatch: prefill and decode instances have incompatible "
                               f"KV layouts ({meta.get('kv_bytes_per_token')} vs "
                               f"{self.core.model.kv_bytes_per_token} bytes per token)")
        self._agents[remote.engine_id] = meta

    async def _transfer(self, load: KVLoad, remote: RemotePrefill) -> None:
        """Read one request's KV from its prefill twin (engine docstring); never raises."""
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=SIDE_CHANNEL_TIMEOUT_S)
        client, clock, nixl = self._http, time.monotonic, self.metrics.nixl
        started = clock()
        try:
            await self._handshake(client, remote)
            delay = load.seconds * self.settings.time_scale
            if delay > 0:
                await asyncio.sleep(delay)
            # the READ completes with its notification: the prefill twin frees the blocks
            answer = await client.post(remote.url + NOTIF_PATH, json={"notif_msg": remote.notif_msg})
            answer.raise_for_status()
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            logger.warning("NIXL transfer failed for request %s from %s (%r). Marking blocks as invalid.",
                           load.request_id, remote.url, exc)
            self._agents.pop(remote.engine_id, None)
            if nixl is not None:
                nixl.failed_transfers.inc()
            if self.core.kv_load_failed(load.request_id, clock()) == Status.FAILED:
                entry = self._groups.get(load.request_id)
                if entry is not None:
                    entry[0].error = EngineSimError("Internal server error")
                    entry[0].changed.set()
        else:
            if nixl is not None:
                nixl.transfer(clock() - started, load.bytes, load.blocks)
            self.core.kv_arrived(load.request_id, clock())
        self._wake.set()
