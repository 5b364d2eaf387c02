"""How a process starts another ``backfill`` command: :func:`backfill_executable`.

``backfill up``, the router's and the engines' launch lines, the benchmarks and the tests start
services as subprocesses (``[*backfill_executable(), "router", …]``). Only the command's name is
known here; nothing is imported from the ``backfill`` package.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def backfill_executable() -> list[str]:
    """How to run ``backfill``: the script beside this interpreter, else the one on ``PATH``, else
    ``python -m backfill`` (same commands)."""
    script = Path(sys.executable).with_name("backfill")
    if script.exists():
        return [str(script)]
    found = shutil.which("backfill")
    return [found] if found else [sys.executable, "-m", "backfill"]
