"""Which router answers are retried, and how long to wait (``shared/contracts/queue-and-headers.md``,
after llm-d-async's ``retryMessage``).

- Retryable: 429 and 503 (the router's "not now"), 408, 500, 502, 504, and no HTTP answer at all
  (connection refused or reset, timeout). Everything else (2xx, 400, 401, 404, 422, other 4xx) is
  final and becomes the result as it is.
- Delay of retry ``n`` (1-based): ``min(base * 2**(n-1), cap, time_left)`` times a jitter factor
  uniform in [0.5, 1). A ``Retry-After`` larger than that wins, clamped to half the time left (a
  server's guess may cost at most half the budget); the result never reaches the deadline.
- The router's fast refusal (429 or 503 with ``x-llm-d-request-dropped-reason: rejected-saturated``:
  sheddable work it would otherwise have queued) is not a failed attempt: the request is held for
  the ``Retry-After`` it names (fractional seconds allowed; :data:`DEFAULT_HOLD_S` when absent,
  :data:`MIN_HOLD_S` at least)
  times a jitter factor uniform in [1, 1 + :data:`HOLD_JITTER`), with no exponential growth, since
  the router's answer says when room is expected (:func:`saturated_hold`).
- The router's eviction (429 with ``x-llm-d-request-dropped-reason: evicted``: a running sheddable
  request aborted to make room for higher-priority work) is held the same way
  (:func:`is_held_refusal`): the request did nothing wrong, and a batch request evicted is re-run
  until its deadline, never failed for it.
"""

from __future__ import annotations

import email.utils
import random
import time

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

DROPPED_REASON_HEADER = "x-llm-d-request-dropped-reason"
"""The router's (llm-d's) header naming why a request was not run (shared/contracts/queue-and-headers.md)."""
REJECTED_SATURATED = "rejected-saturated"
"""Its value for sheddable work refused at once because no engine has room."""
EVICTED = "evicted"
"""Its value for a running sheddable request the router evicted for higher-priority work."""
DEFAULT_HOLD_S = 1.0
"""Hold of a fast refusal without a usable ``Retry-After``: the ``Retry-After: 1`` the router sends
with its other refusals."""
MIN_HOLD_S = 0.05
"""Shortest hold, even for ``Retry-After: 0``, so a refused lane never spins on the router."""
HOLD_JITTER = 0.2
"""Up to 20 % added to a hold, so refused requests do not all come back in the same instant."""


def is_retryable(status_code: int) -> bool:
    """True for statuses retried with backoff (0 = no HTTP answer counts as retryable)."""
    return status_code == 0 or status_code in RETRYABLE_STATUSES


def parse_retry_after(value: str | None, now_unix: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now_unix is None else now_unix)
    return max(0.0, seconds) if seconds == seconds else None


def backoff_delay(attempt: int, time_left_s: float, retry_after_s: float | None = None, *,
                  base_s: float = 2.0, cap_s: float = 60.0, rng: random.Random | None = None) -> float | None:
    """Seconds to wait before retry number ``attempt`` (>= 1), or None when no time is left.

    ``time_left_s``: seconds to the deadline. ``retry_after_s``: the server's ``Retry-After``.
    Always < ``time_left_s`` when a number is returned.
    """
    if time_left_s <= 0:
        return None
    uniform = rng.uniform if rng is not None else random.uniform
    delay = min(base_s * 2 ** (attempt - 1), cap_s, time_left_s) * uniform(0.5, 1.0)
    if retry_after_s is not None and retry_after_s > delay:
        delay = max(delay, min(retry_after_s, time_left_s / 2))
    return min(delay, time_left_s * 0.999)


def is_held_refusal(status_code: int, dropped_reason: str | None) -> bool:
    """True for the router's answers that are held rather than retried as failed attempts: 429
    or 503 with ``x-llm-d-request-dropped-reason`` ``rejected-saturated`` or ``evicted``."""
    return status_code in (429, 503) and (dropped_reason or "").strip().lower() in (REJECTED_SATURATED, EVICTED)


def saturated_hold(time_left_s: float, retry_after_s: float | None = None, *,
                   rng: random.Random | None = None) -> float | None:
    """Seconds to hold a request the router refused as saturated: ``retry_after_s`` (or
    :data:`DEFAULT_HOLD_S`; at least :data:`MIN_HOLD_S`) times a factor uniform in
    [1, 1 + :data:`HOLD_JITTER`); None when that reaches the deadline (``time_left_s`` seconds away)."""
    uniform = rng.uniform if rng is not None else random.uniform
    base = max(MIN_HOLD_S, DEFAULT_HOLD_S if retry_after_s is None else retry_after_s)
    delay = base * uniform(1.0, 1.0 + HOLD_JITTER)
    return delay if delay < time_left_s else None
