"""Celery tasks of the batch lifecycle: validate, feed, collect, sweep, finalize (with expiry and
cancel), webhooks and file purging. Uses only the batch store of ``batch_gateway``
(:mod:`batch_gateway.store`).

The one way in is :func:`workers.app.create_celery`.
"""
