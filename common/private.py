"""Private files and folders: what the services write under the data directory (tenants' file bytes,
logs, the embedded stores) is readable by the service user only, whatever the process umask.

Files are ``0600`` and folders ``0700`` (the modes OpenSSH and PostgreSQL demand of private data).
The mode is set with ``chmod`` after creating, so a permissive umask (``0000``) cannot widen it and a
file or folder left by an older version is narrowed on its next use.
"""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
PRIVATE_UMASK = 0o077
"""The umask that makes what third-party code creates (Celery's schedule, Redis's snapshot) private
too; ``backfill up`` sets it for itself and its children."""


def private_dir(path: Path) -> Path:
    """Create folder ``path`` and its missing parents, each ``0700``, and narrow ``path`` itself to
    ``0700`` if it existed; parents that existed are left as they are. Returns ``path``. Raises
    ``OSError`` as ``mkdir`` does (``FileExistsError`` when ``path`` is a file)."""
    path = Path(path)
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            if not folder.is_dir():
                raise  # a file in the way; a folder made meanwhile by another process is fine
        os.chmod(folder, PRIVATE_DIR_MODE)
    os.chmod(path, PRIVATE_DIR_MODE)
    return path


def open_private(path: Path, flags: int) -> int:
    """``os.open(path, flags | O_CREAT, 0o600)``, then narrow the file to ``0600`` (one created
    under a permissive umask, or left by an older version, included). Returns the descriptor;
    raises ``OSError`` as ``os.open`` does."""
    fd = os.open(path, flags | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: Path, data: bytes) -> Path:
    """Write ``data`` to file ``path`` (replacing what it held), ``0600`` whatever the umask and
    whatever mode a file already there had (:func:`open_private`): the CLI's downloads of tenants'
    outputs. Returns ``path``; raises ``OSError`` as ``os.open`` does."""
    with os.fdopen(open_private(path, os.O_WRONLY | os.O_TRUNC), "wb") as handle:
        handle.write(data)
    return path
