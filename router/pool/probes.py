"""The pool's HTTP probes: health checks and metrics scrapes of every endpoint (the router process only).

:class:`PoolProbes` attaches to a :class:`~router.pool.state.PoolState` through its hooks: an
endpoint that joins the pool gets two tasks, removed when it leaves:

* a **metrics scrape** every ``scrape_interval_s`` (``GET /metrics``, vLLM's Prometheus text,
  :func:`~router.pool.engine_metrics.parse_engine_metrics`): it goes to
  :meth:`~router.pool.state.PoolState.record_metrics`, which fills the scheduler's
  :class:`~router.scheduling.types.Endpoint` in place and stamps ``metrics_updated_at``; a failed
  scrape leaves the stamp alone, so the metrics go stale and the saturation detector counts the
  endpoint as saturated;
* a **health check** every ``health_interval_s`` (``GET /health``): ``unhealthy_after`` failures in
  a row (or one failed connection reported by the request path, ``PoolState.report_failure``, and
  confirmed by a check) take it out of the candidate set (:meth:`~router.pool.state.PoolState.mark_down`,
  RELIABILITY.md F9); a healthy answer brings it back (``mark_up``, F10) and reads its
  ``/v1/models`` once;
* once per time an endpoint comes up, when its ``/metrics`` states no ``max_num_seqs``
  (``backfill:engine_config_info``), a read of ``GET /server_info?config_format=json`` (vLLM
  serves it with ``VLLM_SERVER_DEV_MODE=1`` only; a 404 is the usual answer): its
  ``scheduler_config.max_num_seqs`` is the engine's slot count (:mod:`router.pool.slots`).

:class:`EndpointPool` is a pool state with its probes in one object.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from router.pool.engine_metrics import parse_engine_metrics
from router.pool.slots import server_info_max_num_seqs
from router.pool.state import PoolState

SERVER_INFO_TIMEOUT_S = 30.0
"""Time allowed for ``/server_info`` (seconds): vLLM collects its environment report on the first
call (``vllm.collect_env``, subprocesses), seconds on a busy machine."""

log = logging.getLogger(__name__)


class PoolProbes:
    """Health checks and scrapes of ``pool``'s endpoints over ``session`` (module docstring).

    Args:
        pool: the pool state the results go to; its clock paces the scrapes.
        session: an aiohttp session (owned by the caller).
        scrape_interval_s, health_interval_s, unhealthy_after: module docstring (the router's
            settings of the same names).
    """

    def __init__(self, pool: PoolState, session: aiohttp.ClientSession, *, scrape_interval_s: float = 0.05,
                 health_interval_s: float = 1.0, unhealthy_after: int = 2) -> None:
        self.pool = pool
        self._session = session
        self.scrape_interval_s = scrape_interval_s
        self.health_interval_s = health_interval_s
        self.unhealthy_after = unhealthy_after
        self._tasks: dict[str, list[asyncio.Task[Any]]] = {}
        self._scrape_timeout = aiohttp.ClientTimeout(total=max(1.0, 10 * scrape_interval_s))
        self._health_timeout = aiohttp.ClientTimeout(total=max(1.0, health_interval_s))
        pool.add_on_join(self._start)
        pool.add_on_leave(self._stop)
        pool.add_on_failure(self._check_now)

    def _start(self, name: str) -> None:
        self._tasks[name] = [
            asyncio.create_task(self._health_loop(name), name=f"health {name}"),
            asyncio.create_task(self._scrape_loop(name), name=f"scrape {name}"),
        ]

    def _stop(self, name: str) -> None:
        for task in self._tasks.pop(name, []):
            task.cancel()

    def _check_now(self, name: str) -> None:
        asyncio.get_running_loop().create_task(self.check_health(name, immediate=True))

    async def close(self) -> None:
        """Stop every probe task."""
        tasks = [t for ts in self._tasks.values() for t in ts]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- health --------------------------------------------------------------------------------
    async def _health_loop(self, name: str) -> None:
        while True:
            await self.check_health(name)
            await asyncio.sleep(self.health_interval_s)

    async def check_health(self, name: str, immediate: bool = False) -> None:
        """Check ``name``'s ``/health`` once (and read its ``/v1/models`` while unknown);
        ``immediate``: one failure takes it out (a failed connection was reported)."""
        pool = self.pool
        state = pool.states.get(name)
        if state is None:
            return
        try:
            async with self._session.get(f"{name}/health", timeout=self._health_timeout) as resp:
                ok = resp.status == 200
                await resp.read()
            if not ok:
                state.last_error = f"GET /health answered {resp.status}"
            if ok and not state.models:
                pool.set_models(name, await self._read_models(name))
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            ok = False
            state.last_error = f"{type(exc).__name__}: {exc}"
        if name not in pool.states:
            return
        if ok:
            pool.mark_up(name)
            return
        state.failures += 1
        if state.healthy and (immediate or state.failures >= self.unhealthy_after):
            pool.mark_down(name)

    async def _read_models(self, name: str) -> list[str]:
        try:
            async with self._session.get(f"{name}/v1/models", timeout=self._health_timeout) as resp:
                if resp.status != 200:
                    return []
                body = await resp.json()
            return [m["id"] for m in body.get("data", []) if isinstance(m, dict) and "id" in m]
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, TypeError, KeyError):
            return []

    # ---- scrapes -------------------------------------------------------------------------------
    async def _scrape_loop(self, name: str) -> None:
        clock = self.pool.clock
        while True:
            started = clock()
            await self.scrape(name)
            await asyncio.sleep(max(0.0, self.scrape_interval_s - (clock() - started)))

    async def scrape(self, name: str) -> bool:
        """Scrape ``name``'s ``/metrics`` once into the pool; False when it failed."""
        state = self.pool.states.get(name)
        if state is None:
            return False
        try:
            async with self._session.get(f"{name}/metrics", timeout=self._scrape_timeout) as resp:
                if resp.status != 200:
                    return False
                text = await resp.read()
            metrics = parse_engine_metrics(text)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return False
        self.pool.record_metrics(state, metrics)
        if metrics.max_num_seqs is None and not state.server_info_read and name in self._tasks:
            state.server_info_read = True
            self._tasks[name].append(asyncio.create_task(self.read_server_info(name), name=f"server_info {name}"))
        return True

    async def read_server_info(self, name: str) -> int | None:
        """Read ``name``'s ``GET /server_info?config_format=json`` once into its state's
        ``server_info_max_num_seqs`` (per rank); the figure, or None when not served or unreadable."""
        state = self.pool.states.get(name)
        if state is None:
            return None
        try:
            async with self._session.get(f"{name}/server_info", params={"config_format": "json"},
                                         timeout=aiohttp.ClientTimeout(total=SERVER_INFO_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None
        found = server_info_max_num_seqs(body)
        if found is not None and self.pool.states.get(name) is state and state.server_info_read:
            state.server_info_max_num_seqs = found
        return found


class EndpointPool(PoolState):
    """A :class:`~router.pool.state.PoolState` with its :class:`PoolProbes` over ``session``, in
    one object: a pool that probes the endpoints it is given (:meth:`set_endpoints`).

    The router app builds the state with :func:`router.assembly.build_router` and attaches
    :class:`PoolProbes` in its lifespan; this class is the same two parts for a caller that wants
    them together.

    Args:
        session: an aiohttp session for scrapes and health checks (owned by the caller).
        scrape_interval_s, health_interval_s, unhealthy_after: :class:`PoolProbes`'.
        **state_options: :class:`~router.pool.state.PoolState`'s (``clock``, ``on_change``,
            ``duration_ewma_alpha``, ``max_num_seqs``, ``batch_prefill_window_s``,
            ``interactive_rate_tau_s``).

    Raises:
        ValueError: a bad state option (:class:`~router.pool.state.PoolState`).
    """

    def __init__(self, session: aiohttp.ClientSession, *, scrape_interval_s: float = 0.05,
                 health_interval_s: float = 1.0, unhealthy_after: int = 2, **state_options: Any) -> None:
        super().__init__(**state_options)
        self.probes = PoolProbes(self, session, scrape_interval_s=scrape_interval_s,
                                 health_interval_s=health_interval_s, unhealthy_after=unhealthy_after)

    async def close(self) -> None:
        """Stop every probe task."""
        await self.probes.close()

    async def scrape(self, name: str) -> bool:
        """:meth:`PoolProbes.scrape`."""
        return await self.probes.scrape(name)
