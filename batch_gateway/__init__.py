"""OpenAI-compatible Files + Batches API with tenants, API keys and quotas.

Two parts: the batch store (:mod:`batch_gateway.store`: models, states, queries, file stores,
outbox), which the workers use too, and beside it the HTTP API (``api/``, ``app``, ``deps``,
``schemas``, ``uploads``, ``errors``, ``metrics``) and the admin dashboard (``admin/``), which
import the store. The one way into the API is :func:`batch_gateway.app.create_app`.
"""
