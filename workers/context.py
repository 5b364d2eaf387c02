"""The clients a lifecycle task uses: :class:`WorkerContext`.

Built by the composition root (:func:`workers.app.create_celery`) and handed to every task, step and
delivery; nothing here imports the tasks, so ``workers.app`` → ``workers.tasks`` →
``workers.lifecycle`` → ``workers.context`` only runs downwards.
"""

from __future__ import annotations

import os
from functools import cached_property

import httpx
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from batch_gateway.store.db import make_engine, make_sessionmaker
from batch_gateway.store.files import FileStore, build_file_store
from batch_gateway.store.outbox import TaskPublisher
from workers.fleet import FleetModels
from workers.metrics import WorkerMetrics
from workers.queue import BatchQueue
from workers.settings import WorkerSettings


class WorkerContext:
    """The clients a task uses, opened lazily in the process that runs the task (after the
    prefork pool forked, never before)."""

    def __init__(self, settings: WorkerSettings, celery: Celery):
        self.settings = settings
        self.celery = celery
        self.metrics = WorkerMetrics()
        self._pid = os.getpid()
        self._webhook_client: httpx.Client | None = None

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:  # inherited from the parent: start afresh
            self.__dict__.pop("sessionmaker", None)
            self.__dict__.pop("queue", None)
            self.__dict__.pop("fleet", None)
            self._pid = os.getpid()

    @cached_property
    def sessionmaker(self) -> sessionmaker[Session]:
        """Sessions on a small pool (2 connections) of this process."""
        return make_sessionmaker(make_engine(self.settings.database_url, pool_size=2))

    def session(self) -> Session:
        """A new session (the caller commits)."""
        self._check_fork()
        return self.sessionmaker()

    @cached_property
    def store(self) -> FileStore:
        """The file store the settings select (``DATA_DIR/files`` by default)."""
        return build_file_store(self.settings)

    @cached_property
    def queue(self) -> BatchQueue:
        """Redis Streams I/O of the batch lane and its results."""
        return BatchQueue(self.settings.redis_url, pool=self.settings.pool,
                          result_stream=self.settings.result_stream, consumer=f"collector-{os.getpid()}",
                          processor_group=self.settings.processor_group)

    @cached_property
    def fleet(self) -> FleetModels:
        """The models the fleet serves (the router's ``/v1/models``, cached briefly)."""
        return FleetModels(self.settings.router_url, timeout_seconds=self.settings.fleet_models_timeout_seconds,
                           cache_seconds=self.settings.fleet_models_cache_seconds)

    def webhook_client(self, timeout_seconds: float) -> httpx.Client:
        """One HTTP client for webhook deliveries, kept for the life of the process."""
        if self._webhook_client is None:
            self._webhook_client = httpx.Client(timeout=timeout_seconds, follow_redirects=False)
        return self._webhook_client

    @cached_property
    def publisher(self) -> TaskPublisher:
        """Outbox publisher sending on this app's broker and queue."""
        return TaskPublisher(self.celery, self.settings.task_queue)
