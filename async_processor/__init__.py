"""Queue → router pump: queue backends, priority lanes, dispatch gates, retries, result publishing.

Built in a later issue; this package knows nothing of Postgres or batches.
"""
