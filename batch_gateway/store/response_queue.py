"""Background responses onto the async lane: :func:`publish_responses`, used by the gateway at
create and by the workers for a response whose publish was never recorded (message layout:
:mod:`common.contracts.background`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from batch_gateway.store.models import BackgroundResponse
from common.contracts.background import ASYNC_LANE, engine_body, request_message
from common.contracts.queue import RequestMessage


class LanePublisher(Protocol):
    """What :func:`publish_responses` needs of a producer (``async_processor.backends``'
    ``TrackedLaneProducer``)."""

    def publish_tracked(self, lane: str, messages: Sequence[RequestMessage]) -> list[str]:
        """Put ``messages`` on ``lane``; their transport ids, in order."""
        ...


def response_message(row: BackgroundResponse, pool: str) -> RequestMessage:
    """The request message of ``row`` (its deadline: the row's, in Unix seconds, rounded as
    Postgres rounds ``created_at``)."""
    return request_message(row.id, row.tenant_id, created=int(row.created_at), deadline=round(row.deadline.timestamp()),
                           body=engine_body(row.request, row.input), pool=pool)


def publish_responses(lanes: LanePublisher, rows: Sequence[BackgroundResponse], pool: str) -> list[str]:
    """Publish the rows' messages on the async lane (one round trip); their stream entry ids.
    Raises whatever the producer raises (``BackendError``)."""
    return lanes.publish_tracked(ASYNC_LANE, [response_message(row, pool) for row in rows])
