"""``DATA_DIR/stack.json``, the writing side: ``backfill up`` writes it once the stack is ready and
removes it when it stops. The format and the reading side (:func:`load_stack`, used by the client
commands and the benchmarks) are in :mod:`common.stack_file`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from common.stack_file import STACK_FILE, NoStack, load_stack, stack_path, started

__all__ = ["STACK_FILE", "NoStack", "load_stack", "remove_stack", "stack_path", "write_stack"]


def write_stack(data_dir: Path, info: dict[str, Any]) -> Path:
    """Write ``info`` (plus ``status: running`` and this process's ``pid``) to ``stack.json``
    atomically, readable by its owner only; returns the path."""
    path = stack_path(data_dir)
    tmp = path.with_name(f".{STACK_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"status": "running", "pid": os.getpid(), "pid_started": started(os.getpid()), **info},
                  handle, indent=2)
        handle.write("\n")
    os.replace(tmp, path)
    return path


def remove_stack(data_dir: Path) -> None:
    """Remove ``stack.json`` if this process wrote it (a file of another stack is left alone)."""
    path = stack_path(data_dir)
    try:
        if json.loads(path.read_text()).get("pid") != os.getpid():
            return
    except (FileNotFoundError, ValueError, AttributeError):
        return
    path.unlink(missing_ok=True)
