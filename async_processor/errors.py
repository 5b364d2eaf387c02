"""The one exception root of ``async_processor`` and its subclasses.

::

    ProcessorError
    ├── BackendError        a queue backend refused an operation (connection lost, bad name, ...)
    └── NoAnswer            the router gave no HTTP answer (:mod:`async_processor.router_client`)

A message that cannot be decoded raises :class:`common.contracts.queue.InvalidMessage`, the
contract's own error.

Nothing here carries an HTTP status: the processor turns failures into result messages
(:mod:`common.contracts.queue`), never into HTTP answers of its own.
"""

from __future__ import annotations


class ProcessorError(Exception):
    """Root of every error raised by ``async_processor``."""


class BackendError(ProcessorError):
    """A queue backend operation failed (the message stays unacknowledged and comes back)."""

