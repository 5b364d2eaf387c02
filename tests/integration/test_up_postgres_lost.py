"""``backfill up`` stops, exit status 1 with a clear message, when its embedded PostgreSQL dies
underneath it (issue 26 item 16): before, it went on serving 5xx with every child restarting."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from backfill.up import free_port, postmaster_pid


def test_up_stops_when_its_embedded_postgres_dies(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    environ = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    proc = subprocess.Popen([sys.executable, "-m", "backfill", "up", "--data-dir", str(data_dir), "--port",
                             str(free_port()), "--api-key", "sk-up", "--engines", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("backfill ready"), line + (proc.stderr.read() if proc.poll() is not None else "")
        pid = postmaster_pid(data_dir / "postgres")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(60) == 1
        assert f"the embedded PostgreSQL (pid {pid}) exited; stopping" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
