"""The whole stack as a user runs it: a ``backfill up`` child process, found through the stack file
it writes once ready (:mod:`common.stack_file`) and stopped with SIGTERM, as Ctrl-C stops it.

The benchmarks that measure the whole path (ingest, end-to-end, mixed) start it here; the child's
own output goes to ``DATA_DIR/logs/up.log`` beside its services' logs.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.executable import backfill_executable
from common.stack_file import NoStack, load_stack

READY_TIMEOUT_S = 300.0
"""How long ``backfill up`` may take to write its stack file (its stores, migrations, engines,
router, processor, worker and gateway start one after another; each has 60 s)."""
STOP_GRACE_S = 60.0
"""How long ``backfill up`` may take to stop its children after SIGTERM before it is killed (its
children die with it: ``up`` asks Linux to SIGTERM them when it dies)."""
POLL_S = 0.2


class StackError(RuntimeError):
    """``backfill up`` exited or did not become ready; the message has the tail of its log."""


@dataclass
class RunningStack:
    """A running ``backfill up``: its process and what its stack file says (``info``: the
    :mod:`common.stack_file` fields)."""

    process: subprocess.Popen
    info: dict[str, Any]
    data_dir: Path
    children: dict[str, Any] = field(default_factory=dict)
    """``{child: psutil.Process}`` of ``up``'s children as its stack file names them (``gateway``,
    ``worker``, ``beat``, ``processor``, ``router``, ``engine-0`` …; those that exited are left out)."""

    @property
    def gateway_url(self) -> str:
        """The Files + Batches API's base URL (``…/v1``)."""
        return str(self.info["gateway_url"])

    @property
    def api_key(self) -> str:
        """The ``default`` tenant's API key."""
        return str(self.info["api_key"])

    @property
    def router_url(self) -> str | None:
        """The router's base URL (None without engines)."""
        return self.info.get("router_url")

    @property
    def engine_urls(self) -> list[str]:
        """Every engine's base URL."""
        return list(self.info.get("engine_urls") or [])

    @property
    def env(self) -> dict[str, str]:
        """The stores' URLs as the stack's children see them: ``DATABASE_URL``, ``REDIS_URL``."""
        return {"DATABASE_URL": self.info["database_url"], "REDIS_URL": self.info["redis_url"]}


def up_argv(data_dir: Path, host: str, port: int, *, engines: int | None = None,
            engine_urls: list[str] | tuple[str, ...] = ()) -> list[str]:
    """argv of ``backfill up`` on ``data_dir`` serving the gateway on ``host:port``: ``engines``
    simulated engines (None: ``up``'s default) or the running engines at ``engine_urls``."""
    argv = [*backfill_executable(), "up", "--data-dir", str(data_dir), "--host", host, "--port", str(port)]
    if engines is not None:
        argv += ["--engines", str(engines)]
    for url in engine_urls:
        argv += ["--engine-url", url]
    return argv


@contextlib.contextmanager
def backfill_up(data_dir: Path, host: str, port: int, *, engines: int | None = None,
                engine_urls: list[str] | tuple[str, ...] = (),
                ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[RunningStack]:
    """Run ``backfill up`` (:func:`up_argv`; environment: this process's, so variables set around
    the call reach every service) until its stack file says it is running, yield it, and stop it
    with SIGTERM on exit (SIGKILL after :data:`STOP_GRACE_S`). Raises :class:`StackError` when it
    exits first or is not ready within ``ready_timeout_s``."""
    data_dir = Path(data_dir).resolve()
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    log = data_dir / "logs" / "up.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(up_argv(data_dir, host, port, engines=engines, engine_urls=engine_urls),
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        info = _wait_for_stack_file(process, data_dir, log, ready_timeout_s)
        yield RunningStack(process, info, data_dir, _children(info))
    finally:
        _stop(process)


def _wait_for_stack_file(process: subprocess.Popen, data_dir: Path, log: Path, timeout_s: float) -> dict[str, Any]:
    """Poll the stack file until it names ``process``; raises :class:`StackError`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise StackError(f"backfill up exited with status {process.returncode}:\n{_tail(log)}")
        with contextlib.suppress(NoStack):
            info = load_stack(data_dir)
            if info.get("pid") == process.pid:
                return info
        time.sleep(POLL_S)
    raise StackError(f"backfill up wrote no stack file within {timeout_s:.0f} s:\n{_tail(log)}")


def _children(info: dict[str, Any]) -> dict[str, Any]:
    """``{child: psutil.Process}`` of the stack file's ``children`` (name → pid)."""
    import psutil

    out: dict[str, Any] = {}
    for name, pid in (info.get("children") or {}).items():
        with contextlib.suppress(psutil.Error):
            out[name] = psutil.Process(pid)
    return out


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM ``backfill up``, wait up to :data:`STOP_GRACE_S`, then SIGKILL."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(log: Path, chars: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return log.read_text(errors="replace")[-chars:]
    return ""
