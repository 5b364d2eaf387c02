"""Celery tasks of the batch lifecycle (validate now; feed, collect, finalize, expire, cancel later).

The one way in is :func:`workers.app.create_celery`.
"""
