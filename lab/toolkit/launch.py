"""Subprocesses of the router benchmarks: a fleet of simulated engines and one router in front.

Everything listens on 127.0.0.1 at free ports, runs in its own process group (so a router's or an
engine's children go with it) and is stopped when the ``with`` block ends, on error too: SIGTERM,
then SIGKILL after 5 s. Output goes to log files in a temporary directory; a process that exits
before it is ready raises :class:`LaunchError` with the tail of its log.

Routers (:data:`POLICIES`), each in front of a fresh fleet:

* ``round-robin``: ``vllm-router --policy round_robin`` (the same Rust proxy as the vLLM peers, so
  the comparison is of placement, not of proxy speed);
* ``approximate`` / ``precise``: ours, ``backfill router … --tokenizer estimate`` with
  ``router/scheduling/default-config.yaml`` / ``precise-config.yaml``; for ``precise`` the router
  binds ``--kv-events-bind`` and every engine's KV events connect to it (topic
  ``kv@<host>:<port>@<model>``);
* ``vllm-router-cache_aware``, ``vllm-router-kv_aware`` (engines bind their own KV event port,
  the router subscribes through ``--kv-event-source URL=tcp://…``, empty topic as vLLM's default),
  ``sglang-router-cache_aware`` (``sglang-router launch``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import yaml

from common.executable import backfill_executable
from engine_twin.launch import kv_events_config_json, sim_engine_argv, wait_ready
from router.scheduling import DEFAULT_CONFIG_PATH

PRECISE_CONFIG_PATH = DEFAULT_CONFIG_PATH.with_name("precise-config.yaml")
"""Our router's precise-prefix config (KV events); the ``precise`` policy is missing without it."""

HOST = "127.0.0.1"
SIM_MAX_NUM_SEQS = 256
"""The simulated engines' ``--max-num-seqs`` (the twin's default), told to the router as ``backfill up``
tells it."""


class LaunchError(RuntimeError):
    """A process exited or did not become ready; the message carries the tail of its log."""


@dataclass(frozen=True)
class EngineOptions:
    """Simulated engines of the fleet (``backfill engine-sim`` flags). Sizes in blocks of
    ``block_size`` tokens; ``time_scale`` is wall seconds per model second (0 = never sleep)."""

    engines: int = 4
    block_size: int = 16
    num_gpu_blocks: int = 1536
    cpu_offload_blocks: int = 3072
    max_model_len: int = 16384
    max_num_seqs: int = 64
    time_scale: float = 1.0
    model: str = "sim-model"
    scheduling_policy: str = "fcfs"
    """vLLM's ``--scheduling-policy`` of the engines; with ``priority`` our router sends vLLM's
    ``priority`` (``--engine-priority``), as ``backfill up`` runs them."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Set environment variables for the duration (children started inside inherit them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@dataclass
class Proc:
    """A started process, its name and log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""


@dataclass
class ProcessGroup:
    """Processes started by one benchmark step; :meth:`stop` ends them all (reverse start order)."""

    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cpus: set[int] | None = None) -> Proc:
        """Start ``argv`` (log: ``<log_dir>/<name>.log``); ``cpus`` pins it (where the OS can)."""
        log = self.log_dir / f"{name}.log"
        handle = open(log, "wb")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus and hasattr(os, "sched_setaffinity") else None
        try:
            popen = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=env, preexec_fn=pin)
        finally:
            handle.close()
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def wait_ready(self, proc: Proc, url: str, timeout: float = 60.0) -> None:
        """Wait for ``GET {url}/health`` = 200; raises :class:`LaunchError` with the log's tail."""
        try:
            wait_ready(url, timeout=timeout, process=proc.popen, interval=0.1)
        except (RuntimeError, TimeoutError) as exc:
            raise LaunchError(f"{proc.name} did not become ready ({exc})\n{proc.tail()}") from exc

    def stop_one(self, proc: Proc) -> None:
        """End one process (SIGTERM, SIGKILL after 5 s) and forget it."""
        _signal(proc.popen, signal.SIGTERM)
        try:
            proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            _signal(proc.popen, signal.SIGKILL)
            proc.popen.wait(timeout=5)
        self.procs.remove(proc)

    def stop(self) -> None:
        """End every process: SIGTERM to all, SIGKILL to those still alive 5 s later."""
        for proc in reversed(self.procs):
            _signal(proc.popen, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc.popen, signal.SIGKILL)
                proc.popen.wait(timeout=5)
        self.procs.clear()


def _signal(popen: subprocess.Popen, sig: int) -> None:
    """Signal the process group the child leads (it was started with its own session)."""
    if popen.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, sig)


@contextlib.contextmanager
def process_group(log_dir: Path | None = None) -> Iterator[ProcessGroup]:
    """A :class:`ProcessGroup` stopped on exit; logs in ``log_dir`` (default: a temporary one)."""
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="backfill-bench-")))
        group = ProcessGroup(Path(log_dir))
        try:
            yield group
        finally:
            group.stop()


# ---- peers ---------------------------------------------------------------------------------------
def peer_binary(name: str) -> str | None:
    """Path of a peer router's console script (``vllm-router``, ``sglang-router``): beside this
    interpreter, else on PATH; None when not installed."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    return shutil.which(name)


@cache
def our_router_available() -> bool:
    """True when ``backfill router --help`` exits 0 (our router has landed in this checkout)."""
    try:
        done = subprocess.run([*backfill_executable(), "router", "--help"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@dataclass(frozen=True)
class Policy:
    """How one policy is run. ``events``: where engines send KV events — ``"own"`` (each engine
    binds its own port; topic empty), ``"router"`` (every engine connects to the router's bound
    port; fleet topic). ``missing`` says why the policy cannot run here (None when it can)."""

    name: str
    events: str
    argv: Callable[[int, list[str], list[str], EngineOptions, int | None], list[str]]
    available: Callable[[], str | None]


def _vllm_router(policy: str) -> Callable[..., list[str]]:
    def argv(port: int, engines: list[str], event_endpoints: list[str], opts: EngineOptions,
             router_events_port: int | None) -> list[str]:
        cmd = [peer_binary("vllm-router") or "vllm-router", "--host", HOST, "--port", str(port), "--policy", policy,
               "--worker-urls", *engines, "--log-level", "warning", "--request-timeout-secs", "600",
               *_prometheus_on_a_free_port()]
        if policy == "kv_aware":
            cmd += ["--kv-event-model", opts.model, "--kv-event-block-size", str(opts.block_size)]
            for url, endpoint in zip(engines, event_endpoints, strict=True):
                cmd += ["--kv-event-source", f"{url}={endpoint}"]
        return cmd
    return argv


def _sglang_router(policy: str) -> Callable[..., list[str]]:
    def argv(port: int, engines: list[str], event_endpoints: list[str], opts: EngineOptions,
             router_events_port: int | None) -> list[str]:
        return [peer_binary("sglang-router") or "sglang-router", "launch", "--host", HOST, "--port", str(port),
                "--policy", policy, "--worker-urls", *engines, "--log-level", "warn",
                "--request-timeout-secs", "600", *_prometheus_on_a_free_port()]
    return argv


def _prometheus_on_a_free_port() -> list[str]:
    """The peers' metrics listener on a free port of :data:`HOST`: both Rust routers otherwise bind
    0.0.0.0:29000, so a second one running at the same time (another benchmark, a parallel test)
    panics with "Address already in use"."""
    return ["--prometheus-host", HOST, "--prometheus-port", str(free_port())]


def bench_flow_control() -> Path:
    """A flow-control file for our router in the routing benchmarks: the shipped defaults without
    the interactive band's per-tenant limits. A trace replayer is one untrusted client, so with the
    defaults all of its calls would share the ``anonymous`` tenant's 16 in flight and get 429s
    under load, while the peers it is compared with have no such limit; the benchmarks measure
    placement, not tenant limits (those have their own tests). Written once per process, in the
    temporary directory."""
    from router.flow_control.config import FlowControlConfig

    path = Path(tempfile.gettempdir()) / f"backfill-bench-flow-{os.getpid()}.yaml"
    if not path.exists():
        data = FlowControlConfig().model_dump(mode="json")
        for band in data["bands"]:
            if band["objective"] == "interactive":
                band["tenant_max_in_flight"] = band["tenant_max_queued"] = None
        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _ours(config: Path) -> Callable[..., list[str]]:
    def argv(port: int, engines: list[str], event_endpoints: list[str], opts: EngineOptions,
             router_events_port: int | None) -> list[str]:
        cmd = [*backfill_executable(), "router", "--host", HOST, "--port", str(port)]
        for url in engines:
            cmd += ["--engine", url]
        cmd += ["--config", str(config), "--profile", "default", "--tokenizer", "estimate",
                "--flow-control", str(bench_flow_control())]
        if router_events_port is not None:
            cmd += ["--kv-events-bind", f"tcp://{HOST}:{router_events_port}"]
        if opts.scheduling_policy == "priority":
            cmd.append("--engine-priority")
        return cmd
    return argv


def _peer_missing(name: str) -> Callable[[], str | None]:
    return lambda: None if peer_binary(name) else f"{name} is not installed (pip install {name})"


def _ours_missing(config: Path) -> Callable[[], str | None]:
    def check() -> str | None:
        if not our_router_available():
            return "`backfill router` is not in this checkout yet"
        if not config.exists():
            return f"{config.name} is not in this checkout yet"
        return None
    return check


def our_policy(name: str, config: Path) -> Policy:
    """Our router as policy ``name`` with scheduling config ``config``; ``precise`` gets the engines'
    KV events at the router's bound address."""
    return Policy(name, "router" if name == "precise" else "own", _ours(config), _ours_missing(config))


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("round-robin", "own", _vllm_router("round_robin"), _peer_missing("vllm-router")),
    our_policy("approximate", DEFAULT_CONFIG_PATH),
    our_policy("precise", PRECISE_CONFIG_PATH),
    Policy("vllm-router-cache_aware", "own", _vllm_router("cache_aware"), _peer_missing("vllm-router")),
    Policy("vllm-router-kv_aware", "own", _vllm_router("kv_aware"), _peer_missing("vllm-router")),
    Policy("sglang-router-cache_aware", "own", _sglang_router("cache_aware"), _peer_missing("sglang-router")),
)}
"""Every policy of ``backfill bench prefix``, in table order."""


@dataclass
class Fleet:
    """A started fleet and its router: engine base URLs, the router's base URL, the processes."""

    engines: list[str]
    router: str
    group: ProcessGroup


@contextlib.contextmanager
def fleet_with_router(policy: Policy, opts: EngineOptions, log_dir: Path | None = None,
                      settle_s: float = 1.0) -> Iterator[Fleet]:
    """Start ``opts.engines`` fresh simulated engines (cold caches) and ``policy``'s router in front;
    yield when every ``/health`` answers 200 and ``settle_s`` more seconds have passed (ZMQ
    subscribers connect). Raises :class:`LaunchError` when a process fails to start."""
    with process_group(log_dir) as group:
        router_port = free_port()
        router_events = free_port() if policy.events == "router" else None
        engines: list[str] = []
        endpoints: list[str] = []
        procs = []
        for i in range(opts.engines):
            port = free_port()
            if router_events is not None:
                endpoint = f"tcp://{HOST}:{router_events}"
                events = kv_events_config_json(endpoint, HOST, port, opts.model)
            else:
                endpoint_port = free_port()
                endpoint = f"tcp://{HOST}:{endpoint_port}"
                events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                     "endpoint": f"tcp://*:{endpoint_port}"})
            argv = sim_engine_argv(port, [opts.model], None, host=HOST, block_size=opts.block_size,
                                   num_gpu_blocks=opts.num_gpu_blocks, cpu_offload_blocks=opts.cpu_offload_blocks,
                                   max_num_seqs=opts.max_num_seqs, max_model_len=opts.max_model_len,
                                   time_scale=opts.time_scale, scheduling_policy=opts.scheduling_policy,
                                   extra=("--kv-events-config", events, "--engine-index", str(i)))
            procs.append(group.start(f"engine-{i}", argv))
            engines.append(f"http://{HOST}:{port}")
            endpoints.append(endpoint)
        for proc, url in zip(procs, engines):
            group.wait_ready(proc, url)
        router = group.start(policy.name, policy.argv(router_port, engines, endpoints, opts, router_events))
        router_url = f"http://{HOST}:{router_port}"
        group.wait_ready(router, router_url)
        time.sleep(settle_s)
        yield Fleet(engines, router_url, group)
