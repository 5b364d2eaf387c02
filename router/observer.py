"""What the router reports about its requests: the hooks the director and the proxy call.

:class:`RouterObserver` is the one place the request path tells the outside what happened; the
Prometheus series (:class:`router.metrics.RouterMetrics`) implement it. The request path itself
keeps no counters of its own besides the pool's in-flight counters, which scheduling reads.
"""

from __future__ import annotations

from typing import Protocol


class RouterObserver(Protocol):
    """Hooks called on the request path; each must be cheap and must not raise."""

    def answered(self, objective: str, status: int) -> None:
        """The client got HTTP ``status`` (499: it went away before any answer)."""

    def shed(self, objective: str, reason: str) -> None:
        """Flow control refused (backpressure), dropped or evicted a request (``reason``: the drop
        reason; the metrics count backpressure and shedding apart)."""

    def made_room(self, endpoint: str) -> None:
        """A sheddable request on ``endpoint`` was evicted to make room for a non-sheddable one
        (the director's make-room; the victim's own ``shed(…, "evicted")`` follows when it ends)."""

    def evicted(self, endpoint: str, reason: str, wasted_tokens: int) -> None:
        """A sheddable request on ``endpoint`` was evicted for a non-sheddable one (``reason``:
        ``no_free_slot``, ``batch_prefill``, ``engine_queue``); ``wasted_tokens``: the router's
        estimate of the work lost (``Director.make_room``)."""

    def admitted(self, objective: str, waited_s: float) -> None:
        """Flow control released a request after ``waited_s`` seconds since it was received."""

    def scheduled(self, seconds: float, prefix_hit: bool) -> None:
        """A scheduling decision took ``seconds``; ``prefix_hit``: ≥ 1 block matched somewhere."""

    def plugin_timing(self, plugin: str, seconds: float) -> None:
        """One plugin's share of a decision (``plugin`` = its instance name)."""

    def first_byte(self, objective: str, seconds: float) -> None:
        """The engine answered, ``seconds`` after the request was received."""

    def upstream_error(self, kind: str) -> None:
        """Talking to an engine failed (``kind``: connect, stream, endpoint_down)."""

    def untrusted_header(self, header: str) -> None:
        """A caller without the trusted token sent identity header ``header``; it was ignored."""

    def pd_decision(self, reason: str) -> None:
        """The P/D profile handler decided (``reason``: ``disaggregated``, ``below_threshold``,
        ``no_prefill_endpoint``, ``not_generation``, ``multiple_outputs``)."""

    def prefill_failed(self, endpoint: str, reason: str) -> None:
        """A disaggregated request's prefill leg on ``endpoint`` failed (``reason``: ``connect``,
        ``timeout``, ``status``, ``client_error``, ``no_kv_transfer_params``, ``stream``,
        ``endpoint_down``)."""

    def prefill_retried(self) -> None:
        """A failed prefill leg is tried once more on another prefill engine."""

    def pd_fallback(self, reason: str) -> None:
        """No prefill engine answered: the request runs aggregated on its decode engine
        (``reason``: the last prefill failure's)."""
