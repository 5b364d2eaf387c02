"""HTTP routes: ``files`` and ``batches`` under ``/v1``."""
