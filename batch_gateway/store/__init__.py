"""The batch store: the record of tenants, keys, files, batches and their requests.

Used by the HTTP API (``batch_gateway.api``, ``batch_gateway.admin``) and by the workers
(``workers``), which import nothing else of ``batch_gateway``. Postgres is the record
(:mod:`~batch_gateway.store.models`, :mod:`~batch_gateway.store.db`); every query lives in
:mod:`~batch_gateway.store.queries`; file bytes live in a file store
(:mod:`~batch_gateway.store.storage`, :mod:`~batch_gateway.store.storage_s3`); outbox events reach
the broker through :mod:`~batch_gateway.store.outbox`.
"""
