"""How long one attempt of a request may take: :func:`attempt_timeout`.

An attempt's bound follows the request instead of one fixed number:

- ``base_s`` (``request_timeout_s``) covers what comes before the first token (queueing at the
  engine, prefill) and a request that names no output budget;
- plus ``per_token_s`` for each output token asked for: the first of ``max_completion_tokens``,
  ``max_tokens``, ``max_output_tokens`` (chat, completions, responses), times ``n``;
- capped by the time left to the message's deadline.

A streamed request (``"stream": true``) is bounded by its progress instead: the attempt lives as
long as bytes keep coming (at most ``base_s`` apart) up to the deadline, however many tokens it
asks for (:attr:`AttemptTimeout.idle_s`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.contracts.openai_request import requested_output_tokens


@dataclass(frozen=True)
class AttemptTimeout:
    """``total_s``: the whole attempt at most; ``idle_s``: the longest silence of a streamed
    answer (None: not streamed, only ``total_s`` applies); ``tokens``: the output tokens the bound
    was computed for (0: none named); ``capped``: ``total_s`` is the time left to the deadline
(always so for a streamed request)."""

    total_s: float
    idle_s: float | None
    tokens: int
    capped: bool

    def describe(self, base_s: float, per_token_s: float) -> str:
        """The bound in words, for an error message."""
        if self.idle_s is not None:
            return f"{self.idle_s:.1f} s without a byte of the stream"
        if self.capped:
            return f"{self.total_s:.1f} s (the time left to the deadline)"
        if not self.tokens:
            return f"{self.total_s:.1f} s (request_timeout_s; the request names no max_tokens)"
        return (f"{self.total_s:.1f} s (request_timeout_s {base_s:g} s + {self.tokens} tokens x "
                f"{per_token_s:g} s)")


def attempt_timeout(payload: Mapping[str, Any], time_left_s: float, *, base_s: float,
                    per_token_s: float) -> AttemptTimeout:
    """The bound of one attempt of ``payload`` with ``time_left_s`` to its deadline (see the
    module docstring)."""
    tokens = requested_output_tokens(payload)
    if payload.get("stream") is True:
        return AttemptTimeout(time_left_s, min(base_s, time_left_s), tokens, capped=True)
    wanted = base_s + tokens * per_token_s
    if wanted >= time_left_s:
        return AttemptTimeout(time_left_s, None, tokens, capped=True)
    return AttemptTimeout(wanted, None, tokens, capped=False)

