"""Waiting for a condition instead of for a fixed time: the one polling helper of the tests.

A test that sleeps a fixed time and then looks is a race against the machine's load; a test that
polls the condition it needs, with a deadline far above the usual time, passes as soon as the
condition holds and fails only when it never does (issue 23: the suite passes beside CPU hogs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: Seconds a condition gets by default: generous on a loaded 2-core machine, and a test that
#: passes waits no longer than the condition takes.
DEFAULT_TIMEOUT_S = 30.0


def wait_for(condition: Callable[[], T], what: str, timeout: float = DEFAULT_TIMEOUT_S,
             interval: float = 0.05, show: Callable[[], object] | None = None) -> T:
    """Call ``condition`` every ``interval`` seconds until it returns a true value; return that.

    Raises ``AssertionError`` naming ``what`` (and ``show()``'s value, when given) once ``timeout``
    seconds have passed without it.
    """
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f": {show()}" if show else ""))
        time.sleep(interval)
    return value
