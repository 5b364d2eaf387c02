"""OpenAI-compatible Files + Batches API with tenants, API keys and quotas.

The one way in is :func:`batch_gateway.app.create_app`.
"""
