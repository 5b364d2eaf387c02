"""The one exception root of ``async_processor`` and its subclasses.

::

    ProcessorError
    ├── InvalidMessage      a request message that cannot be decoded or lacks a required field
    ├── BackendError        a queue backend refused an operation (connection lost, bad name, ...)
    └── GateUnavailable     a dispatch gate cannot read its signal (the gate then fails closed)

Nothing here carries an HTTP status: the processor turns failures into result messages
(:mod:`async_processor.messages`), never into HTTP answers of its own.
"""

from __future__ import annotations


class ProcessorError(Exception):
    """Root of every error raised by ``async_processor``."""


class InvalidMessage(ProcessorError):
    """A request message that cannot be processed.

    ``reason``: human-readable cause. ``id``, ``metadata`` and ``result_queue_name`` are whatever
    could be salvaged from the raw bytes (empty when nothing could), so an ``INVALID_REQUEST``
    result can still be addressed to the producer.
    """

    def __init__(self, reason: str, *, id: str = "", metadata: dict[str, str] | None = None,
                 result_queue_name: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.id = id
        self.metadata = metadata or {}
        self.result_queue_name = result_queue_name


class BackendError(ProcessorError):
    """A queue backend operation failed (the message stays unacknowledged and comes back)."""


class GateUnavailable(ProcessorError):
    """A gate's signal is unreadable or stale; the gate admits nothing until it reads again."""
