"""Queue → router pump: queue backends, priority lanes, dispatch gates, retries, result publishing.

The pump (:mod:`.processor`) reads :mod:`.lanes` from a queue backend (:mod:`.backends`, the
queue port), admits work through :mod:`.gates`, POSTs it with :mod:`.router_client`, retries per
:mod:`.retry` and reports every event to an observer (:mod:`.observer`, :mod:`.metrics`).
This package knows nothing of Postgres or batches.
"""
