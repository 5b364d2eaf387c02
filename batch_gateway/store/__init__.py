"""The batch store: the record of tenants, keys, files, batches and their requests.

Used by the HTTP API (``batch_gateway.api``, ``batch_gateway.admin``) and by the workers
(``workers``), which import nothing else of ``batch_gateway``.

- :mod:`~batch_gateway.store.models`, :mod:`~batch_gateway.store.db`: Postgres, the record;
- :mod:`~batch_gateway.store.states`: batch statuses, request states, legal transitions, the
  finalize decision;
- :mod:`~batch_gateway.store.queries`: every query, one module per table (the only SQL);
- :mod:`~batch_gateway.store.files`: where file bytes live (a local directory or S3);
- :mod:`~batch_gateway.store.outbox`, :mod:`~batch_gateway.store.task_names`: outbox events
  handed to the Celery broker, and the task names they carry;
- :mod:`~batch_gateway.store.settings`: the settings the gateway and the workers share;
- :mod:`~batch_gateway.store.quota`: the enqueued-token quota's wording.
"""
